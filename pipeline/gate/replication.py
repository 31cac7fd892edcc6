"""The replication step (`[gate] replicate_runs`): a promotion the gate granted is first repeated on
fresh seeds, and carried out only if the gain is there again.

Every promotion is a selection: of a stream of hypotheses, the ones whose looks happened to cross a
boundary. Where nearly every idea is null, the few nulls that cross are most of what is promoted
(`benchmarks/loop_quality.py`: 9.8 % false discoveries under the nearly-null prior at the default
gate). A replication on seeds nothing was selected on is the remedy science uses: the old baseline
and the challenger each run `replicate_runs` fresh seeds per task (the first seeds of the block the
challenger would own as champion, so the challenger's runs are the new champion's first baseline
runs when it passes, and only the old baseline's are the step's cost), paired seed by seed, and the
promotion stands if a one-sided t test of their horizontal mean Δ (each task's Δ over its σ_task,
averaged over tasks) passes at `replicate_alpha`, on the spread of the pairs within each task
pooled over tasks (tasks × (pairs − 1) degrees of freedom: two pairs a task give as many df as
tasks). Measured in the simulator first: `loop_quality.py --rules paired-confirm2-t10`.

The test's inputs are fixed before the runs exist (the seeds, σ_task from the baseline's own runs
on its block, the level), so a challenger cannot choose its replication; a challenger run that
fails on a fresh seed fails the replication (a method that breaks on new seeds is not replicated),
a baseline run that fails leaves its pair out.
"""

from __future__ import annotations

import math
from typing import Any, TypedDict


class TaskReplication(TypedDict):
    task: str
    pairs: int  # fresh seeds with a result in both arms
    delta: float | None  # mean challenger − baseline on them, metric units (raw sign)
    delta_sigma: float | None  # the same, over σ_task, oriented (+ is better)
    sigma: float | None  # σ_task: the baseline's spread on its own block


class Replication(TypedDict):
    """The replication step's record (stored as a gate record of kind `replicate`)."""

    seeds: list[int]
    metric: str
    tasks: list[TaskReplication]
    mean: float | None  # horizontal mean Δ in σ units, oriented
    t: float | None
    df: int
    critical: float | None  # t needed at `alpha`
    alpha: float
    p: float | None  # one-sided
    passed: bool
    reason: str  # one line: why it passed or not


def replicate(base: dict[str, dict[int, float | None]], chal: dict[str, dict[int, float | None]],
              sigma: dict[str, float | None], seeds: list[int], alpha: float, higher_is_better: bool,
              metric: str = "the metric") -> Replication:
    """The replication's verdict from the fresh runs of both arms ({task: {seed: metric or None}}),
    each task's σ_task and the level. A task without a usable σ_task (a baseline that does not vary,
    or fewer than 2 own runs) is left out; with none left the replication cannot test anything and
    stands aside (`passed`, said so): the gate's verdict was on noise-free runs."""
    from scipy import stats

    sign = 1.0 if higher_is_better else -1.0
    rows: list[TaskReplication] = []
    z: list[list[float]] = []
    failed = [f"{t} seed {s}" for t in sorted(chal) for s in seeds if s in chal[t] and chal[t][s] is None]
    for t in sorted(set(base) | set(chal)):
        both = [s for s in seeds if base.get(t, {}).get(s) is not None and chal.get(t, {}).get(s) is not None]
        d = [chal[t][s] - base[t][s] for s in both]  # type: ignore[operator]
        sd = sigma.get(t)
        usable = sd is not None and math.isfinite(sd) and sd > 0
        rows.append({"task": t, "pairs": len(d), "delta": sum(d) / len(d) if d else None,
                     "delta_sigma": sign * sum(d) / len(d) / sd if d and usable else None,  # type: ignore[operator]
                     "sigma": sd})
        if d and usable:
            z.append([sign * v / sd for v in d])  # type: ignore[operator]
    out: Replication = {"seeds": list(seeds), "metric": metric, "tasks": rows, "mean": None, "t": None, "df": 0, "critical": None,
                        "alpha": alpha, "p": None, "passed": False, "reason": ""}
    if failed:
        out["reason"] = f"a challenger run failed on a fresh seed ({', '.join(failed[:3])})"
        return out
    if not z:
        out["passed"] = True
        out["reason"] = "no task has a measured noise (σ_task 0 or unknown): nothing to replicate against"
        return out
    means = [sum(v) / len(v) for v in z]
    mean = sum(means) / len(means)
    df = sum(len(v) - 1 for v in z)
    out["mean"], out["df"] = mean, df
    if df == 0:
        out["reason"] = "too few fresh pairs for a spread (one per task)"
        return out
    s2 = sum((x - m) ** 2 for v, m in zip(z, means) for x in v) / df
    se = math.sqrt(s2 * sum(1 / len(v) for v in z)) / len(z)
    crit = float(stats.t.ppf(1 - alpha, df))
    out["critical"] = crit
    if se == 0:
        out["t"], out["p"] = None, 0.0 if mean > 0 else 1.0
        out["passed"] = mean > 0
    else:
        t = mean / se
        out["t"], out["p"] = t, float(stats.t.sf(t, df))
        out["passed"] = t > crit
    what = "replicated" if out["passed"] else "not replicated"
    t_text = "no spread" if out["t"] is None else f"t {out['t']:.2f} against {crit:.2f}"
    out["reason"] = (f"{what} on {len(seeds)} fresh seeds: horizontal Δ {mean:+.3f}σ, {t_text} "
                     f"(one-sided at {alpha:g}, {df} df)")
    return out


def render_markdown(r: dict[str, Any]) -> str:
    """The record as the summary's and `report --md`'s paragraph."""
    metric = r.get("metric") or "the metric"
    head = f"**Replication** ({', '.join(str(s) for s in r['seeds'])}): {r['reason']}."
    lines = [head, "", f"| task | fresh pairs | Δ {metric} | Δ/σ_task |", "|---|---|---|---|"]
    for t in r["tasks"]:
        d, z = t.get("delta"), t.get("delta_sigma")
        lines.append(f"| {t['task']} | {t['pairs']} | {'—' if d is None else f'{d:+.4f}'} | "
                     f"{'—' if z is None else f'{z:+.2f}'} |")
    return "\n".join(lines)
