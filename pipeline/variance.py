"""The variance study: N identical baseline runs per task, the numbers every gate setting rests on.

Seed noise per task (σ), how correlated tasks are across seeds (they share pretraining, which is
why task-level sign tests mislead), and the minimum detectable effect at each planned look.
"""

from __future__ import annotations

import math

from typing import Any

import numpy as np

from pipeline.executors import ExecutorOptions
from pipeline.experiment import Experiment, ensure_runs, results
from pipeline.labrepo import resolve_commit
from pipeline.lab import BASELINE_BRANCH, Lab
from pipeline.outcomes import ResultOutcome


def study(lab: Lab, store: Any, runs: int, executor: ExecutorOptions | None = None, *,
          commit: str = BASELINE_BRANCH, stop: Any = None) -> dict[str, Any]:
    """The variance study (`autoresearch variance`): `runs` identical runs of `commit` per task,
    queued idempotently (the baseline's own seeds: its gate runs are reused) and driven on
    `executor`; per task σ, the correlation across tasks and the MDE table."""
    from pipeline.gate import mde

    tasks = lab.tasks()
    sha = resolve_commit(lab, commit)
    exp = Experiment(lab, store)
    seeds = exp.baseline_seeds(sha, runs)  # the baseline's own seeds: its gate runs are reused
    store.mark_baseline(sha)
    ids = ensure_runs(store, lab, sha, tasks, seeds, label="variance study")
    # `Experiment.driver`: on a cluster whose nodes differ, in the baseline's environment (its gate runs are reused)
    with exp.driver(executor) as driver:
        driver.drive(until=ids, stop=stop)
    values = results(store, lab, sha, tasks)
    gate = lab.config.gate
    per_task = {}
    matrix = np.full((runs, len(tasks)), np.nan)
    for j, task in enumerate(tasks):
        vals = [values.get(task, {}).get(s) for s in seeds]
        ok = np.array([v for v in vals if v is not None], dtype=float)
        matrix[:, j] = [np.nan if v is None else v for v in vals]
        sd = float(ok.std(ddof=1)) if len(ok) > 1 else None
        per_task[task] = {
            "mean": float(ok.mean()) if len(ok) else None,
            "sd": sd,
            "runs": int(len(ok)),
            "failed": int(runs - len(ok)),
            "mde": {str(m): (mde(sd, gate.baseline_runs, m, alpha=gate.alpha) if sd else None) for m in gate.looks},
        }
    complete = matrix[~np.isnan(matrix).any(axis=1)]
    corr = None
    if len(complete) > 2 and len(tasks) > 1:
        c = np.corrcoef(complete, rowvar=False)
        corr = float(np.nanmean(c[np.triu_indices(len(tasks), 1)]))
    sds = [t["sd"] for t in per_task.values() if t["sd"]]
    return {
        "commit": sha,
        "runs": runs,
        "tasks": per_task,
        "mean_cross_task_correlation": corr,
        "median_sd": float(np.median(sds)) if sds else None,
        "mde_note": (f"one-sided alpha {gate.alpha}, 95% power, {gate.baseline_runs} baseline runs vs each look; "
                     f"an MDE is a size: the smallest {'increase' if lab.config.benchmark.higher_is_better else 'decrease'} "
                     f"of {lab.config.benchmark.metric} detected"),
    }


def _pair_stats(b: list[float], c: list[float]) -> dict[str, Any]:
    """Seed-k pairs of one task: their correlation, the sd of the differences and the variance ratio
    var(d) / (var(b) + var(c)) (1: the pairing buys nothing; 0.31: a third of the unpaired variance).
    Plain Python: `status` computes it for every task of 500 comparisons, a few pairs each, where
    numpy's per-call overhead was 0.2 s."""
    x, y = [float(v) for v in b], [float(v) for v in c]
    if len(x) != len(y):
        raise ValueError(f"pairs need one challenger run per baseline run ({len(x)} and {len(y)})")
    n = len(x)
    mx, my = sum(x) / n if n else 0.0, sum(y) / len(y) if y else 0.0
    sxx = sum((v - mx) ** 2 for v in x)
    syy = sum((v - my) ** 2 for v in y)
    out: dict[str, Any] = {"pairs": n, "pair_correlation": None, "sd_paired_difference": None,
                           "variance_ratio": None, "sd": math.sqrt(sxx / (n - 1)) if n > 1 else None,
                           "challenger_sd": math.sqrt(syy / (len(y) - 1)) if len(y) > 1 else None}
    if n < 2:
        return out
    d = [v - u for u, v in zip(x, y)]
    md = sum(d) / n
    var_d = sum((v - md) ** 2 for v in d) / (n - 1)
    out["sd_paired_difference"] = math.sqrt(var_d)
    unpaired = (sxx + syy) / (n - 1)
    if unpaired > 0:
        out["variance_ratio"] = var_d / unpaired
    if n > 2 and sxx > 0 and syy > 0:
        sxy = sum((u - mx) * (v - my) for u, v in zip(x, y))
        out["pair_correlation"] = max(-1.0, min(1.0, sxy / math.sqrt(sxx * syy)))
    return out


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.median(vals)) if vals else None


def pairing(lab: Lab, store: Any, rev: str, runs: int, executor: ExecutorOptions | None = None, *,
            stop: Any = None) -> dict[str, Any]:
    """What the seeds buy: `rev` and the baseline on the baseline's first `runs` seeds (queued
    idempotently, gate runs reused), per task the correlation of rev's seed-k run with the baseline's,
    the sd of the paired differences and the variance ratio. The JSON is a noise model for
    `benchmarks/loop_quality.py --noise`."""
    tasks = lab.tasks()
    base_sha, sha = resolve_commit(lab, BASELINE_BRANCH), resolve_commit(lab, rev)
    exp = Experiment(lab, store)
    seeds = list(exp.baseline_seeds(base_sha, runs))
    store.mark_baseline(base_sha)
    ids = ensure_runs(store, lab, base_sha, tasks, seeds, label="variance study")
    ids += ensure_runs(store, lab, sha, tasks, seeds, label=f"pairing {rev}")
    if sha != base_sha:
        store.mark_comparison(sha, base_sha)
    # `Experiment.driver`: on a cluster whose nodes differ, in the baseline's environment (its gate runs are reused)
    with exp.driver(executor) as driver:
        driver.drive(until=ids, stop=stop)
    base, chal = results(store, lab, base_sha, tasks), results(store, lab, sha, tasks)
    per_task = {}
    for t in tasks:
        both = [s for s in seeds if base.get(t, {}).get(s) is not None and chal.get(t, {}).get(s) is not None]
        per_task[t] = _pair_stats([base[t][s] for s in both], [chal[t][s] for s in both])
    return {
        "commit": sha, "baseline": base_sha, "runs": runs, "tasks": per_task,
        "median_pair_correlation": _median([v["pair_correlation"] for v in per_task.values()]),
        "median_variance_ratio": _median([v["variance_ratio"] for v in per_task.values()]),
    }


LAB_PAIRING_LATEST = 500  # `lab_pairing` reads the latest comparisons, not a year of them at every `status`


def lab_pairing(lab: Lab, store: Any) -> dict[str, Any] | None:
    """The pairing this lab's latest comparisons (LAB_PAIRING_LATEST) measured (no runs queued):
    the median over (comparison, task) of the seed-k correlation and of the variance ratio, for
    `status`. None before any comparison has 3 pairs on a task."""
    tasks = lab.tasks()
    comps = store.comparisons(latest=LAB_PAIRING_LATEST)
    rows: dict[str, dict[str, dict[int, float | None]]] = {}
    commits = {x for c in comps for x in c}
    for r in store.result_rows(commits, tasks):
        if ResultOutcome(r.outcome).counts():
            rows.setdefault(r.commit, {}).setdefault(r.task, {})[r.seed] = r.value
    corr, ratio, used = [], [], 0
    for chal, base in comps:
        counted = False
        for t in tasks:
            b, c = rows.get(base, {}).get(t, {}), rows.get(chal, {}).get(t, {})
            both = sorted(s for s in set(b) & set(c) if b[s] is not None and c[s] is not None)
            if len(both) >= 3:
                st = _pair_stats([b[s] for s in both], [c[s] for s in both])
                corr.append(st["pair_correlation"])
                ratio.append(st["variance_ratio"])
                counted = True
        used += counted
    if not used:
        return None
    return {"comparisons": used, "median_pair_correlation": _median(corr), "median_variance_ratio": _median(ratio)}
