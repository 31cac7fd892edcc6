"""The replication step (`[gate] replicate_runs`): a promotion the gate granted is first repeated on
fresh seeds, and carried out only if the gain is there again.

Every promotion is a selection: of a stream of hypotheses, the ones whose looks happened to cross a
boundary. Where nearly every idea is null, the few nulls that cross are most of what is promoted
(`benchmarks/loop_quality.py`: 9.8 % false discoveries under the nearly-null prior at the default
gate). A replication on seeds nothing was selected on is the remedy science uses: the old baseline
and the challenger each run `replicate_runs` fresh seeds per task (the first seeds of the block the
challenger would own as champion, so the challenger's runs are the new champion's first baseline
runs when it passes, and only the old baseline's are the step's cost), paired seed by seed.

The test: per fresh seed, the horizontal paired value (the trimmed mean over tasks of Δ / σ_task, as
the gate's horizontal test has it), their mean against 0, one-sided at `replicate_alpha`, on the
spread of this hypothesis's own per-seed values: those of its decisive look (the gate's pairs) pooled
with the fresh ones, (m − 1) + (c − 1) df. Per-seed values carry whatever shock the tasks share at a
seed (a challenger that changes pretraining moves every task together at seed k: a t that pooled the
spread within each task as if tasks were independent passes 25-31 % of nulls at a nominal 10 %), and
this hypothesis's own pairs carry its own pairing (the gate's unpaired bound, which holds for any
pairing, costs most of the power at 2 pairs: `benchmarks/replication.py`, `loop_quality.py --rules
paired-replicate2 paired-replicate2-bound`). The look's spread was selected on (a look crosses its
boundary more easily where its pairs happen to agree), which loosens the level somewhat for exactly
the nulls the step is for: the simulator measures it with the selection in.

A challenger run that fails on a fresh seed fails the replication (a method that breaks on new seeds
is not replicated); a baseline run that fails leaves its pair out, and with fewer than 2 fresh seeds
left there is nothing replicated; per-seed values that do not vary measure no noise: never a pass.
"""

from __future__ import annotations

import math
from typing import Any, TypedDict



class TaskReplication(TypedDict):
    task: str
    pairs: int  # fresh seeds with a result in both arms
    delta: float | None  # mean challenger − baseline on them, metric units (raw sign)
    delta_sigma: float | None  # the same over σ_task, raw sign


class Replication(TypedDict):
    """The replication step's record (stored as a gate record of kind `replicate`)."""

    seeds: list[int]
    metric: str
    tasks: list[TaskReplication]
    mean: float | None  # horizontal Δ in σ units, oriented
    t: float | None
    df: int | None
    critical: float | None  # the t needed at `alpha`
    alpha: float
    passed: bool
    reason: str  # one line: why it passed or not


def record(seeds: list[int], tasks: list[str], raw: Any, scale: Any, test: tuple[float, float | None, int,
           float | None, bool], alpha: float, metric: str) -> Replication:
    """The record of a tested replication: `raw` the fresh Δ (tasks, seeds; metric units, raw sign,
    NaN: no pair), `scale` σ_task, `test` what `own_spread_test` said."""
    import numpy as np

    rows: list[TaskReplication] = []
    for i, t in enumerate(tasks):
        d = raw[i][np.isfinite(raw[i])]
        delta = float(d.mean()) if d.size else None
        s = float(scale[i]) if np.isfinite(scale[i]) and scale[i] > 0 else None
        rows.append({"task": t, "pairs": int(d.size), "delta": delta,
                     "delta_sigma": None if delta is None or s is None else delta / s})
    mean, t, df, crit, passed = test
    n = len(seeds)
    if t is None and crit is None:
        reason = f"not replicated: too few pairs on the {n} fresh seeds for a spread"
    elif t is None:
        reason = f"not replicated: the per-seed values do not vary (no spread to test on, {n} fresh seeds)"
    else:
        what = "replicated" if passed else "not replicated"
        stat = f"t {t:.2f} against {crit:.2f}" if t is not None else "no spread"
        reason = f"{what} on {n} fresh seeds: horizontal Δ {mean:+.3f}σ, {stat} (one-sided at {alpha:g}, {df} df)"
    return {"seeds": list(seeds), "metric": metric, "tasks": rows, "mean": None if math.isnan(mean) else mean,
            "t": t, "df": df, "critical": crit, "alpha": alpha, "passed": bool(passed), "reason": reason}


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
    if fresh_h.size < 2:  # one fresh seed is no replication, whatever the look's df
        return (float(fresh_h.mean()) if fresh_h.size else math.nan), None, 0, None, False
    mean = float(fresh_h.mean())
    df = max(look_h.size - 1, 0) + fresh_h.size - 1
    if df < 1:
        return mean, None, 0, None, False
    ss = float(((look_h - look_h.mean()) ** 2).sum()) if look_h.size else 0.0
    ss += float(((fresh_h - mean) ** 2).sum())
    se = math.sqrt(ss / df / fresh_h.size)
    crit = float(stats.t.ppf(1 - alpha, df))
    if se == 0:  # seeds that do not vary: nothing measured the noise (the plausibility hold's case)
        return mean, None, df, crit, False
    t = mean / se
    return mean, t, df, crit, t >= crit


def untested(seeds: list[int], tasks: list[str], reason: str, alpha: float, metric: str) -> Replication:
    """A replication with nothing to test (the baseline's fresh runs failed): never a pass."""
    return {"seeds": list(seeds), "metric": metric,
            "tasks": [{"task": t, "pairs": 0, "delta": None, "delta_sigma": None} for t in tasks],
            "mean": None, "t": None,
            "df": None, "critical": None, "alpha": alpha, "passed": False, "reason": f"not replicated: {reason}"}


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
