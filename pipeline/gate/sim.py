"""Vectorised simulation of a protocol's error rates, power and cost (`autoresearch gate-sim`).

Each trial is one hypothesis on J tasks: the baseline's runs (n seeds) and the challenger's (up
to the last planned look), every seed a vector over tasks with cross-task correlation ρ (tasks
share pretraining), per-run σ = 1 on every task and a true improvement `effect` (in σ units) on
the first `affected` tasks. The trial goes through the planned looks with exactly the statistics
and verdict table `evaluate` uses, stopping at the first verdict other than `escalate`.

Rates reported (each over trials; a task rate over trial × task pairs):
- improvement_rate: the verdict is `improvement` (the false-positive rate when effect = 0);
- horizontal_rate: the horizontal test crossed its improvement boundary at a look reached;
- per_task_rate: an affected task's test crossed its improvement boundary at a look reached
  (unaffected tasks: per_task_null_rate); `*_all_looks`: the same if every look were taken
  whatever the verdicts said (the stricter check, since futility stops only remove chances);
- mean_challenger_runs: challenger runs per task when the trial stopped.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from pipeline.errors import UserError
from pipeline.gate.protocol import PROTOCOLS, get_protocol
from pipeline.gate.paths import LookPath
from pipeline.gate.stats import HORIZONTAL_TRIM
from pipeline.gate.verdict import CODE, ORDER, Verdict


class SimResult(BaseModel):
    """Outcome of a gate simulation; `to_json` gives the CLI's stable JSON."""

    model_config = ConfigDict(frozen=True)

    protocol: str
    effect: float
    tasks: int
    affected: int
    rho: float
    trials: int
    baseline_runs: int
    looks: list[int]
    alpha: float
    futility_p: float
    harm_q: float
    history: int
    horizontal_trim: float
    seed: int
    improvement_rate: float  # every `improvement` verdict, held ones included
    held_rate: float  # `improvement` held for review: its seeds do not vary, or it is noisier than the lab
    pair_rho: float
    history_pair_rho: float | None
    pair_history: int
    lazy: bool
    challenger_sd: float
    horizontal_rate: float
    horizontal_rate_all_looks: float
    per_task_rate: float | None
    per_task_rate_all_looks: float | None
    per_task_null_rate: float | None
    per_task_null_rate_all_looks: float | None
    mean_challenger_runs: float
    verdict_rates: dict[str, float]

    def standard_error(self, rate: float) -> float:
        """Binomial standard error of a rate over the trials."""
        return math.sqrt(max(rate * (1 - rate), 1e-12) / self.trials)

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = self.model_dump()
        key = "power" if self.effect != 0 else "false_positive_rate"
        out[key] = self.improvement_rate
        out[key + "_se"] = self.standard_error(self.improvement_rate)
        return out


def _check(protocol: str, effect: float, tasks: int, rho: float, trials: int, baseline_runs: int,
           looks: tuple[int, ...], alpha: float, futility_p: float, history: int, affected: int,
           horizontal_trim: float) -> None:
    problems = [
        (protocol not in PROTOCOLS, f"--protocol: expected one of {', '.join(sorted(PROTOCOLS))}"),
        (not math.isfinite(effect), "--effect: expected a finite number (σ units)"),
        (tasks < 1, "--tasks: expected at least 1"),
        (not (0 <= rho < 1), "--rho: expected a correlation in [0, 1)"),
        (trials < 1, "--trials: expected at least 1"),
        (baseline_runs < 2, "--baseline-runs: expected at least 2"),
        (not looks or looks[0] < 1 or any(b <= a for a, b in zip(looks, looks[1:])),
         "--looks: expected strictly increasing positive run counts"),
        (not (0 < alpha < 0.5), "--alpha: expected a one-sided level in (0, 0.5)"),
        (not (0 < futility_p <= 1), "--futility-p: expected a number in (0, 1]"),
        (history < 0, "--history: expected 0 or more extra baseline runs"),
        (not (0 <= affected <= tasks), "--affected: expected between 0 and --tasks"),
        (not (0 <= horizontal_trim < 0.5), "--trim: expected a share in [0, 0.5)"),
    ]
    for bad, message in problems:
        if bad:
            raise UserError(message)


def simulate(
    protocol: str = "sequential",
    effect: float = 0.0,
    tasks: int = 8,
    rho: float = 0.0,
    trials: int = 20_000,
    baseline_runs: int = 10,
    looks: tuple[int, ...] = (2, 5, 10),
    alpha: float = 0.025,
    futility_p: float = 0.30,
    harm_q: float = 0.10,
    history: int = 0,
    affected: int | None = None,
    horizontal_trim: float = HORIZONTAL_TRIM,
    seed: int = 0,
    chunk: int = 20_000,
    pair_rho: float = 0.0,
    history_pair_rho: float | None = None,
    pair_history: int = 10,
    lazy: bool = True,
    challenger_sd: float = 1.0,
) -> SimResult:
    """Simulate `trials` hypotheses through the protocol; see the module docstring for the rates.

    `pair_rho`: the correlation of the challenger's seed-k run with the baseline's seed-k run (common
    random numbers; the two-sample protocols ignore it). `paired` only: `pair_history` earlier
    comparisons of 2 pairs each, paired at `history_pair_rho` (default: `pair_rho`), are the
    lab's history behind its prior; `lazy`: the gate sees the baseline seeds a look needs (the
    first challenger of a baseline), else all `baseline_runs`. `challenger_sd`: the challenger's
    per-run σ over the baseline's (and the lab's earlier arms'): a branch that is noisier than the lab.
    """
    looks = tuple(int(x) for x in looks)
    affected = tasks if affected is None else affected
    hist_rho = pair_rho if history_pair_rho is None else history_pair_rho
    _check(protocol, effect, tasks, rho, trials, baseline_runs, looks, alpha, futility_p, history, affected,
           horizontal_trim)
    for bad, message in ((not 0 <= pair_rho < 1, "--pair-rho: expected a correlation in [0, 1)"),
                         (not (math.isfinite(challenger_sd) and challenger_sd > 0), "--challenger-sd: expected a positive σ ratio"),
                         (not 0 <= hist_rho < 1, "--history-pair-rho: expected a correlation in [0, 1)"),
                         (pair_history < 0, "--pair-history: expected 0 or more earlier comparisons"),
                         ):
        if bad:
            raise UserError(message)
    proto = get_protocol(protocol)
    problem = proto.looks_problem(looks, baseline_runs)
    if problem is not None:
        raise UserError(f"--{problem}")
    n, J, last = baseline_runs, tasks, looks[-1]
    shift = np.where(np.arange(J) < affected, effect, 0.0)
    rng = np.random.default_rng(seed)

    def draw(b: int, *seeds: int) -> np.ndarray:
        common = rng.standard_normal((b, 1, *seeds))
        own = rng.standard_normal((b, J, *seeds))
        return math.sqrt(rho) * common + math.sqrt(1 - rho) * own

    def challenger(base: np.ndarray, b: int) -> np.ndarray:
        fresh = draw(b, last)
        if pair_rho == 0 or base.shape[-1] < last:
            return challenger_sd * fresh
        return challenger_sd * (pair_rho * base[..., :last] + math.sqrt(1 - pair_rho**2) * fresh)

    sums = {"improvement": 0, "held": 0, "h": 0, "h_all": 0, "runs": 0}
    task_hits = np.zeros(J)
    task_hits_all = np.zeros(J)
    verdicts = np.zeros(len(ORDER))
    done = 0
    while done < trials:
        b = min(chunk, trials - done)
        base = draw(b, n)
        chal = challenger(base, b) + shift[None, :, None]
        hist = draw(b, history) if history else None
        pairs, arms = proto.lab_history(draw, b, pair_history, hist_rho)  # the lab's earlier comparisons, if it reads them
        path = proto.path(base, chal, looks, alpha=alpha, futility_p=futility_p, harm_q=harm_q,
                          horizontal_trim=horizontal_trim, history=hist, pair_history=pairs,
                          base_depth=np.zeros(b, int) if lazy else None, arm_history=arms)
        code, k_stop = path.first_stop()
        reached = np.arange(len(looks))[None, :] <= k_stop[:, None]  # (b, K): looks this trial took
        verdicts += np.bincount(code, minlength=len(ORDER))
        sums["improvement"] += int((code == CODE[Verdict.improvement]).sum())
        sums["held"] += int(((code == CODE[Verdict.improvement]) & path.held[np.arange(b), k_stop]).sum())
        sums["h"] += int((path.horizontal_up & reached).any(axis=1).sum())
        sums["h_all"] += int(path.horizontal_up.any(axis=1).sum())
        sums["runs"] += int(np.asarray(looks)[k_stop].sum())
        task_hits += (path.task_up & reached[..., None]).any(axis=1).sum(axis=0)
        task_hits_all += path.task_up.any(axis=1).sum(axis=0)
        done += b

    def task_rate(hits: np.ndarray, cols: slice) -> float | None:
        chosen = hits[cols]
        return float(chosen.sum() / (chosen.size * trials)) if chosen.size else None

    hit_cols, null_cols = (slice(0, affected), slice(affected, J)) if effect != 0 else (slice(0, J), slice(J, J))
    return SimResult(
        protocol=protocol, effect=effect, tasks=J, affected=affected, rho=rho, trials=trials,
        baseline_runs=n, looks=list(looks), alpha=alpha, futility_p=futility_p, harm_q=harm_q,
        history=history, horizontal_trim=horizontal_trim, seed=seed,
        improvement_rate=sums["improvement"] / trials,
        held_rate=sums["held"] / trials,
        pair_rho=pair_rho, **proto.sim_fields(hist_rho, pair_history, lazy), challenger_sd=challenger_sd,
        horizontal_rate=sums["h"] / trials,
        horizontal_rate_all_looks=sums["h_all"] / trials,
        per_task_rate=task_rate(task_hits, hit_cols),
        per_task_rate_all_looks=task_rate(task_hits_all, hit_cols),
        per_task_null_rate=task_rate(task_hits, null_cols),
        per_task_null_rate_all_looks=task_rate(task_hits_all, null_cols),
        mean_challenger_runs=sums["runs"] / trials,
        verdict_rates={v.value: float(verdicts[i] / trials) for i, v in enumerate(ORDER)},
    )


def look_path(protocol: str, base: np.ndarray, chal: np.ndarray, looks: tuple[int, ...], **kw: Any) -> LookPath:
    """Judge a batch of hypotheses at every look with the statistics and verdict table `evaluate`
    uses: `base` (b, tasks, n) baseline runs, `chal` (b, tasks, ≥ looks[-1]) challenger runs by seed,
    `history` (b, tasks, h) extra baseline-commit runs (the variance prior), all oriented so that +
    is better. `scale` (b, tasks) overrides σ_task (default: from the baseline's runs and history).
    Runs have no failures here (NaN is a failed run, as in `evaluate`, but failures are not counted).
    The protocol's own path (`GateProtocol.path`: pipeline.gate.paths); a paired protocol also takes
    `pair_history`, `base_depth` and `arm_history`. A result held because its seeds do not vary is
    `held` (never promoted automatically)."""
    return get_protocol(protocol).path(base, chal, tuple(int(x) for x in looks), **kw)
