"""The replication step (`[gate] replicate_runs`): a promotion the gate granted is first repeated on
fresh seeds, and carried out only if the gain is there again.

Every promotion is a selection: of a stream of hypotheses, the ones whose looks happened to cross a
boundary. Where nearly every idea is null, the few nulls that cross are most of what is promoted
(`benchmarks/loop_quality.py`: 9.8 % false discoveries under the nearly-null prior at the default
gate). A replication on seeds nothing was selected on is the remedy science uses: the old baseline
and the challenger each run `replicate_runs` fresh seeds per task (the first seeds of the block the
challenger would own as champion, so the challenger's runs are the new champion's first baseline
runs when it passes, and only the old baseline's are the step's cost), paired seed by seed.

The test is the gate's own horizontal test, at one fixed-sample look of `replicate_runs` pairs and
level `replicate_alpha` (`Experiment.replication` builds the input): per seed, the trimmed mean over
tasks of Δ / σ_task; its variance moderated by the lab's unpaired bound, frozen with the comparison
(the earlier arms and the baseline's own runs), so the error rate holds whatever the tasks' Δ share
at one seed (a challenger that changes pretraining moves every task together at seed k: a test that
pooled the spread within each task as if tasks were independent would pass 18-29 % of nulls at a
nominal 10 %, `benchmarks/replication.py`) and however this hypothesis pairs. A challenger run that
fails on a fresh seed fails the replication (a method that breaks on new seeds is not replicated);
a baseline run that fails leaves its pair out, and with no pair left there is nothing replicated.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:
    from pipeline.gate.report import GateResult


class TaskReplication(TypedDict):
    task: str
    pairs: int  # fresh seeds with a result in both arms
    delta: float | None  # mean challenger − baseline on them, metric units (raw sign)
    t: float | None  # the task's paired t, oriented (+ is better): shown, not tested


class Replication(TypedDict):
    """The replication step's record (stored as a gate record of kind `replicate`)."""

    seeds: list[int]
    metric: str
    tasks: list[TaskReplication]
    mean: float | None  # horizontal Δ in σ units, oriented
    t: float | None
    df: float | None
    critical: float | None  # the horizontal t needed at `alpha` (the gate's boundary at this one look)
    alpha: float
    passed: bool
    reason: str  # one line: why it passed or not


def from_gate(result: GateResult, seeds: list[int], alpha: float, metric: str) -> Replication:
    """The replication's verdict from the gate's record of its one look (`GateResult`): passed when
    the horizontal t reaches the look's boundary (no pair to test: never a pass)."""
    hz = result.horizontal
    rows: list[TaskReplication] = [{"task": t.task, "pairs": int(t.pairs or 0), "delta": t.delta, "t": t.t}
                                   for t in result.tasks]
    out: Replication = {"seeds": list(seeds), "metric": metric, "tasks": rows, "mean": hz.delta, "t": hz.t,
                        "df": hz.df, "critical": hz.boundary, "alpha": alpha, "passed": False, "reason": ""}
    n = len(seeds)
    if hz.t is None or hz.boundary is None or hz.delta is None:
        out["reason"] = f"not replicated: no horizontal test on the {n} fresh seeds"
    else:
        out["passed"] = hz.t >= hz.boundary
        out["reason"] = (f"{'replicated' if out['passed'] else 'not replicated'} on {n} fresh seeds: horizontal "
                         f"Δ {hz.delta:+.3f}σ, t {hz.t:.2f} against {hz.boundary:.2f} (one-sided at {alpha:g})")
    return out


def own_spread_test(look_h: Any, fresh_h: Any, alpha: float) -> tuple[float, float | None, int, float | None, bool]:
    """The replication's test on this hypothesis's own paired spread: the fresh seeds' per-seed
    horizontal paired values (`fresh_h`, oriented) against 0, their variance pooled with that of the
    decisive look's per-seed values (`look_h`: the same hypothesis, the same pairing and the same
    shock shared across tasks at a seed), (m − 1) + (c − 1) df. (mean, t, df, critical, passed)."""
    import numpy as np
    from scipy import stats

    look_h = np.asarray(look_h, dtype=float)
    fresh_h = np.asarray(fresh_h, dtype=float)
    look_h, fresh_h = look_h[np.isfinite(look_h)], fresh_h[np.isfinite(fresh_h)]
    if fresh_h.size == 0:
        return math.nan, None, 0, None, False
    mean = float(fresh_h.mean())
    df = max(look_h.size - 1, 0) + fresh_h.size - 1
    if df < 1:
        return mean, None, 0, None, False
    ss = float(((look_h - look_h.mean()) ** 2).sum()) if look_h.size else 0.0
    ss += float(((fresh_h - mean) ** 2).sum())
    se = math.sqrt(ss / df / fresh_h.size)
    crit = float(stats.t.ppf(1 - alpha, df))
    if se == 0:
        return mean, None, df, crit, mean > 0
    t = mean / se
    return mean, t, df, crit, t >= crit


def untested(seeds: list[int], tasks: list[str], reason: str, alpha: float, metric: str) -> Replication:
    """A replication with nothing to test (the baseline's fresh runs failed): never a pass."""
    return {"seeds": list(seeds), "metric": metric,
            "tasks": [{"task": t, "pairs": 0, "delta": None, "t": None} for t in tasks], "mean": None, "t": None,
            "df": None, "critical": None, "alpha": alpha, "passed": False, "reason": f"not replicated: {reason}"}


def render_markdown(r: dict[str, Any]) -> str:
    """The record as the summary's and `report --md`'s paragraph."""
    metric = r.get("metric") or "the metric"
    head = f"**Replication** ({', '.join(str(s) for s in r['seeds'])}): {r['reason']}."
    lines = [head, "", f"| task | fresh pairs | Δ {metric} | t |", "|---|---|---|---|"]
    for t in r["tasks"]:
        d, z = t.get("delta"), t.get("t")
        lines.append(f"| {t['task']} | {t['pairs']} | {'—' if d is None else f'{d:+.4f}'} | "
                     f"{'—' if z is None else f'{z:+.2f}'} |")
    return "\n".join(lines)
