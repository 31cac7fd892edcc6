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
           looks: tuple[int, ...], alpha: float, futility_p: float, history: int, affected: int) -> None:
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
    baseline_runs: int = 5,
    looks: tuple[int, ...] = (2, 5, 10),
    alpha: float = 0.025,
    futility_p: float = 0.30,
    harm_q: float = 0.10,
    history: int = 0,
    affected: int | None = None,
    seed: int = 0,
    chunk: int = 20_000,
) -> SimResult:
    """Simulate `trials` hypotheses through the protocol; see the module docstring for the rates."""
    looks = tuple(int(x) for x in looks)
    affected = tasks if affected is None else affected
    _check(protocol, effect, tasks, rho, trials, baseline_runs, looks, alpha, futility_p, history, affected)
    n, J, last = baseline_runs, tasks, looks[-1]
    prior_df = history - 1 if history >= 2 else 0
    weight = float(min(prior_df, PRIOR_DF_CAP))
    proto = get_protocol(protocol)
    tb = proto.boundaries(n, looks, last, alpha, prior_df, weight if proto.moderated else 0.0)
    hbnd = proto.boundaries(n, looks, last, alpha)
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
        base_arm = summarize(base)
        hist_arm = summarize(hist) if hist is not None else None
        prior = history_prior(hist, base_arm.mean.shape) if proto.moderated else None
        scale, _ = task_scale(base_arm, hist_arm)
        hb, hc = horizontal_values(base, chal, base_arm.mean, scale)

        active = np.ones(b, dtype=bool)
        code = np.full(b, -1, dtype=np.int8)
        stop = np.full(b, last)
        cross, cross_all = np.zeros((b, J), bool), np.zeros((b, J), bool)
        hx, hx_all = np.zeros(b, bool), np.zeros(b, bool)
        for k, mk in enumerate(looks):
            test = pooled_t(base_arm, summarize(chal[..., :mk]), prior)
            tl = task_look(test, np.float64(tb.nominal[k]), protocol, alpha, harm_q)
            breadth, required = None, True
            if J > 1:
                top, required = most_improved(test.delta, scale)
                breadth = horizontal_values(without_task(base, top), without_task(chal[..., :mk], top), base_arm.mean, scale)
            hl = horizontal_look(hb, hc[:, :mk], hbnd.upper[k], breadth, required)
            hit = test.t >= tb.upper[k]
            cross_all |= hit
            cross |= hit & active[:, None]
            hx_all |= hl.up
            hx |= hl.up & active
            now = decide(
                wins=tl.wins, harms=tl.harms, horizontal_up=hl.up, horizontal_breadth=hl.breadth_up,
                horizontal_down=hl.down, horizontal_p=hl.p_up, failures=np.zeros(b, int),
                last=k == len(looks) - 1, futility_p=futility_p,
            )
            stopping = active & (now != CODE[Verdict.escalate])
            code[stopping] = now[stopping]
            stop[stopping] = mk
            active &= ~stopping
        verdicts += np.bincount(code, minlength=len(ORDER))
        sums["improvement"] += int((code == CODE[Verdict.improvement]).sum())
        sums["h"] += int(hx.sum())
        sums["h_all"] += int(hx_all.sum())
        sums["runs"] += int(stop.sum())
        task_hits += cross.sum(axis=0)
        task_hits_all += cross_all.sum(axis=0)
        done += b

    def task_rate(hits: np.ndarray, cols: slice) -> float | None:
        chosen = hits[cols]
        return float(chosen.sum() / (chosen.size * trials)) if chosen.size else None

    hit_cols, null_cols = (slice(0, affected), slice(affected, J)) if effect != 0 else (slice(0, J), slice(J, J))
    return SimResult(
        protocol=protocol, effect=effect, tasks=J, affected=affected, rho=rho, trials=trials,
        baseline_runs=n, looks=list(looks), alpha=alpha, futility_p=futility_p, harm_q=harm_q,
        history=history, seed=seed,
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
