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
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict

from pipeline.errors import SimInputError
from pipeline.gate.protocol import PROTOCOLS, get_protocol
from pipeline.gate.protocols import (
    horizontal_look,
    most_improved,
    task_look,
    task_scale,
)
from pipeline.gate.stats import (
    HORIZONTAL_TRIM,
    PRIOR_DF_CAP,
    history_prior,
    horizontal_values,
    pooled_t,
    summarize,
    without_task,
)
from pipeline.gate.verdict import CODE, ORDER, Verdict, decide


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
    improvement_rate: float
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
            raise SimInputError(message)


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
) -> SimResult:
    """Simulate `trials` hypotheses through the protocol; see the module docstring for the rates."""
    looks = tuple(int(x) for x in looks)
    affected = tasks if affected is None else affected
    _check(protocol, effect, tasks, rho, trials, baseline_runs, looks, alpha, futility_p, history, affected,
           horizontal_trim)
    n, J, last = baseline_runs, tasks, looks[-1]
    shift = np.where(np.arange(J) < affected, effect, 0.0)
    rng = np.random.default_rng(seed)

    def draw(b: int, seeds: int) -> np.ndarray:
        common = rng.standard_normal((b, 1, seeds))
        own = rng.standard_normal((b, J, seeds))
        return math.sqrt(rho) * common + math.sqrt(1 - rho) * own

    sums = {"improvement": 0, "h": 0, "h_all": 0, "runs": 0}
    task_hits = np.zeros(J)
    task_hits_all = np.zeros(J)
    verdicts = np.zeros(len(ORDER))
    done = 0
    while done < trials:
        b = min(chunk, trials - done)
        base, chal = draw(b, n), draw(b, last) + shift[None, :, None]
        hist = draw(b, history) if history else None
        path = look_path(protocol, base, chal, looks, alpha=alpha, futility_p=futility_p, harm_q=harm_q,
                         horizontal_trim=horizontal_trim, history=hist)
        code, k_stop = path.first_stop()
        reached = np.arange(len(looks))[None, :] <= k_stop[:, None]  # (b, K): looks this trial took
        verdicts += np.bincount(code, minlength=len(ORDER))
        sums["improvement"] += int((code == CODE[Verdict.improvement]).sum())
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
        horizontal_rate=sums["h"] / trials,
        horizontal_rate_all_looks=sums["h_all"] / trials,
        per_task_rate=task_rate(task_hits, hit_cols),
        per_task_rate_all_looks=task_rate(task_hits_all, hit_cols),
        per_task_null_rate=task_rate(task_hits, null_cols),
        per_task_null_rate_all_looks=task_rate(task_hits_all, null_cols),
        mean_challenger_runs=sums["runs"] / trials,
        verdict_rates={v.value: float(verdicts[i] / trials) for i, v in enumerate(ORDER)},
    )


@dataclass(frozen=True)
class LookPath:
    """A batch of hypotheses judged at every planned look, as if each look were taken.

    Arrays are (b, K) or (b, K, tasks), oriented so that + is better: the verdict code at each
    look, whether the horizontal test and each task's test crossed their improvement boundaries,
    and the horizontal Δ (σ units) and per-task Δ (metric units) at each look.
    """

    looks: tuple[int, ...]
    codes: np.ndarray
    horizontal_up: np.ndarray
    task_up: np.ndarray
    horizontal_delta: np.ndarray
    task_delta: np.ndarray

    def first_stop(self) -> tuple[np.ndarray, np.ndarray]:
        """The verdict where each hypothesis stops (its first verdict other than `escalate`, or the
        last look's) and the index of that look: what the loop's escalate-or-decide rule does."""
        going = self.codes == CODE[Verdict.escalate]
        going[:, -1] = False
        k_stop = np.argmin(going, axis=1)  # the first look that does not escalate
        return self.codes[np.arange(len(k_stop)), k_stop], k_stop


def look_path(
    protocol: str,
    base: np.ndarray,
    chal: np.ndarray,
    looks: tuple[int, ...],
    *,
    alpha: float = 0.025,
    futility_p: float = 0.30,
    harm_q: float = 0.10,
    horizontal_trim: float = HORIZONTAL_TRIM,
    history: np.ndarray | None = None,
    scale: np.ndarray | None = None,
) -> LookPath:
    """Judge a batch of hypotheses at every look with the statistics and verdict table `evaluate`
    uses: `base` (b, tasks, n) baseline runs, `chal` (b, tasks, ≥ looks[-1]) challenger runs by seed,
    `history` (b, tasks, h) extra baseline-commit runs (the variance prior), all oriented so that +
    is better. `scale` (b, tasks) overrides σ_task (default: from the baseline's runs and history).
    Runs have no failures here (NaN is a failed run, as in `evaluate`, but failures are not counted).
    """
    looks = tuple(int(x) for x in looks)
    b, J, n = base.shape
    proto = get_protocol(protocol)
    hist_arm = summarize(history) if history is not None and history.shape[-1] else None
    prior_df = int(hist_arm.count.max()) - 1 if hist_arm is not None else 0
    prior_df = max(prior_df, 0)
    weight = float(min(prior_df, PRIOR_DF_CAP))
    tb = proto.boundaries(n, looks, looks[-1], alpha, prior_df, weight if proto.moderated else 0.0)
    hbnd = proto.boundaries(n, looks, looks[-1], alpha)
    base_arm = summarize(base)
    prior = history_prior(history, base_arm.mean.shape) if proto.moderated and hist_arm is not None else None
    if scale is None:
        scale, _ = task_scale(base_arm, hist_arm)
    hb, hc = horizontal_values(base, chal, base_arm.mean, scale, horizontal_trim)
    K = len(looks)
    codes = np.empty((b, K), dtype=np.int8)
    h_up, t_up = np.zeros((b, K), bool), np.zeros((b, K, J), bool)
    h_delta, t_delta = np.zeros((b, K)), np.zeros((b, K, J))
    for k, mk in enumerate(looks):
        test = pooled_t(base_arm, summarize(chal[..., :mk]), prior)
        tl = task_look(test, np.float64(tb.nominal[k]), protocol, alpha, harm_q)
        breadth, required = None, True
        if J > 1:
            top, required = most_improved(test.delta, scale)
            breadth = horizontal_values(without_task(base, top), without_task(chal[..., :mk], top), base_arm.mean,
                                        scale, horizontal_trim)
        hl = horizontal_look(hb, hc[:, :mk], hbnd.upper[k], breadth, required)
        codes[:, k] = decide(
            wins=tl.wins, harms=tl.harms, horizontal_up=hl.up, horizontal_breadth=hl.breadth_up,
            horizontal_down=hl.down, horizontal_p=hl.p_up, failures=np.zeros(b, int),
            last=k == K - 1, futility_p=futility_p,
        )
        h_up[:, k] = hl.up
        t_up[:, k] = test.t >= tb.upper[k]
        h_delta[:, k] = hl.test.delta
        t_delta[:, k] = test.delta
    return LookPath(looks=looks, codes=codes, horizontal_up=h_up, task_up=t_up, horizontal_delta=h_delta,
                    task_delta=t_delta)
