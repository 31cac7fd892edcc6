"""The variance study: N identical baseline runs per task, the numbers every gate setting rests on.

Seed noise per task (σ), how correlated tasks are across seeds (they share pretraining, which is
why task-level sign tests mislead), and the minimum detectable effect at each planned look.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeline import runner
from pipeline.experiment import Experiment
from pipeline.lab import BASELINE_BRANCH, Lab


def study(lab: Lab, store: Any, executor: Any, runs: int, *, commit: str = BASELINE_BRANCH,
          stop: Any = None) -> dict[str, Any]:
    """Queue (idempotently) and drive `runs` seeds of `commit` on every task; summarise them."""
    from pipeline.gate import mde

    tasks = lab.tasks()
    sha = runner.resolve_commit(lab, commit)
    exp = Experiment(lab, store)
    seeds = exp.baseline_seeds(sha, runs)  # the baseline's own seeds: its gate runs are reused
    store.mark_baseline(sha)
    ids = runner.ensure_runs(store, lab, sha, tasks, seeds, label="variance study")
    with runner.Driver(lab, store, executor) as driver:
        driver.drive(until=ids, stop=stop)
    values = runner.results(store, lab, sha, tasks)
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
