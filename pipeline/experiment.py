"""The measurement protocol: which runs measure an arm, and what the gate says about them.

The agent hands in commits and gets back run ids, gate results and re-verifications; it never
picks a seed, builds a gate input or touches an executor. One object per lab and store:

    exp = Experiment(lab, store)
    ids = exp.queue_look(base, commit, look)          # the baseline's runs and the challenger's, idempotent
    if exp.finished(ids):
        result = exp.judge_look(base, commit, look)   # pipeline.gate.GateResult
    exp.queue_champion(commit, tag)                   # a promoted champion's fresh baseline runs
    exp.reverification(tag, commit, base, look)       # how it held up on them (None until all are in)
    exp.smoke(base, files)                            # the whole pipeline on tiny data, sandboxed
    exp.release(commit)                               # a decided challenger's worktree goes
    exp.close()

Seeds. A baseline's own runs use seeds BASELINE_SEED0, BASELINE_SEED0 + 1, ...; the challengers of
a baseline that has had g promotions use g * SEED_BLOCK, g * SEED_BLOCK + 1, ... So the two arms of
a comparison never share a seed; a promoted champion re-verifies on seeds it was not selected on;
and its own challengers never replay the lucky seeds it was selected on (with deterministic
training, a no-op of the champion would reproduce them run for run). Challengers of one baseline
share their seeds, hence their seed-scoped stages (pretraining) through the cache.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from pipeline import runner
from pipeline.lab import BASELINE_SEED0, SEED_BLOCK, Lab

BASELINE_TAGS = "baseline/v*"  # one tag per promotion: the generation of a baseline is how many it holds


def baseline_seeds(n: int) -> range:
    """The seeds of a baseline's own first `n` runs (disjoint from every challenger's)."""
    return range(BASELINE_SEED0, BASELINE_SEED0 + n)


def challenger_seeds(n_runs: int, generation: int = 0) -> range:
    """The seeds of the first `n_runs` runs of a challenger of a baseline with `generation` promotions."""
    start = (generation % (BASELINE_SEED0 // SEED_BLOCK)) * SEED_BLOCK
    return range(start, start + n_runs)


@functools.lru_cache(maxsize=256)
def generation(root: str, commit: str) -> int:
    """How many promotions (tags baseline/v*) the commit's history holds: 0 for the first baseline."""
    import git

    return len(git.Repo(root).git.tag("--merged", commit, "--list", BASELINE_TAGS).split())


class Experiment:
    """The measurement protocol of one lab, over one store."""

    def __init__(self, lab: Lab, store: Any):
        self.lab = lab
        self.store = store
        self._smoke_runner: Any = None

    # --- seeds ---------------------------------------------------------------------------------

    def baseline_seeds(self, n: int | None = None) -> range:
        return baseline_seeds(self.lab.config.gate.baseline_runs if n is None else n)

    def challenger_seeds(self, base_commit: str, look: int) -> range:
        return challenger_seeds(look, generation(str(self.lab.root), base_commit))

    # --- looks ---------------------------------------------------------------------------------

    def queue_look(self, base_commit: str, commit: str, look: int, label: str | None = None) -> list[int]:
        """Queue (idempotently) the baseline's runs and the challenger's runs for a look."""
        tasks = self.lab.tasks()
        ids = runner.ensure_runs(self.store, self.lab, base_commit, tasks, self.baseline_seeds(), label="baseline")
        ids += runner.ensure_runs(self.store, self.lab, commit, tasks, self.challenger_seeds(base_commit, look),
                                  label=label, priority=1)
        return ids

    def finished(self, ids: list[int]) -> bool:
        return all(r.status in ("done", "failed") for r in self.store.runs(ids))

    def judge_look(self, base_commit: str, commit: str, look: int) -> Any:
        """The gate's result at a look, from the store's results (never from the policy)."""
        from pipeline.gate import evaluate

        cfg = self.lab.config
        tasks = self.lab.tasks()
        base = runner.results(self.store, self.lab, base_commit, tasks)
        chal = runner.results(self.store, self.lab, commit, tasks)
        seeds = self.challenger_seeds(base_commit, look)
        inp = {
            "config": cfg.gate.model_dump(),
            "tasks": [
                {
                    "task": t,
                    "baseline": [base.get(t, {}).get(s) for s in self.baseline_seeds()],
                    # an infrastructure failure that exhausted its retries has no result: counted as failed
                    "challenger": [chal.get(t, {}).get(s) for s in seeds],
                    # the variance prior: every run of the baseline commit on baseline seeds (gate runs and
                    # variance studies), not the runs a promoted champion was selected on
                    "history": [v for s, v in sorted(base.get(t, {}).items()) if s >= BASELINE_SEED0],
                }
                for t in tasks
            ],
            "looks_done": [n for n in cfg.gate.looks if n < look],
            "at_look": True,
        }
        return evaluate(inp)

    # --- champions -----------------------------------------------------------------------------

    def queue_champion(self, commit: str, label: str) -> list[int]:
        """A new champion's own runs, on the baseline seeds no challenger uses: it re-verifies on
        seeds it was not selected on (a fast-forward keeps the commit, so its challenger runs stay
        as history)."""
        return runner.ensure_runs(self.store, self.lab, commit, self.lab.tasks(), self.baseline_seeds(), label=label)

    def reverification(self, champion: str, commit: str, base_commit: str, look: int) -> dict[str, Any] | None:
        """How a champion (`champion`, e.g. its tag) did on its fresh baseline seeds, against the
        runs its challenger `commit` was selected on at `look` (the winner's curse, measured).
        None until every fresh run has finished."""
        lab, cfg = self.lab, self.lab.config
        tasks = lab.tasks()
        fresh = runner.results(self.store, lab, runner.resolve_commit(lab, champion), tasks)
        chosen = runner.results(self.store, lab, commit, tasks)
        seeds, picked = list(self.baseline_seeds()), list(self.challenger_seeds(base_commit, look))
        if any(s not in fresh.get(t, {}) for t in tasks for s in seeds):
            return None
        rows, sign = [], 1.0 if cfg.benchmark.higher_is_better else -1.0
        for t in tasks:
            f = [v for s in seeds if (v := fresh[t].get(s)) is not None]
            c = [v for s in picked if (v := chosen.get(t, {}).get(s)) is not None]
            if f and c:
                rows.append({"task": t, "fresh": sum(f) / len(f), "selected": sum(c) / len(c), "fresh_runs": len(f)})
        if not rows:
            return None
        fresh_mean = sum(r["fresh"] for r in rows) / len(rows)
        sel_mean = sum(r["selected"] for r in rows) / len(rows)
        return {"tag": champion, "tasks": rows, "fresh_mean": fresh_mean, "selected_mean": sel_mean,
                "shrinkage": fresh_mean - sel_mean,
                "tasks_worse": sum(sign * (r["fresh"] - r["selected"]) < 0 for r in rows), "fresh_seeds": seeds}

    def standing(self, commit: str) -> dict[str, Any] | None:
        """A baseline commit measured on its own runs (baseline seeds, never the runs it was selected
        on): the mean over tasks on the gate split and, on the same runs, on the sealed holdout
        (None without one). For status, the digest and the chart only: nothing that decides reads it."""
        lab = self.lab
        sha = runner.resolve_commit(lab, commit)
        tasks = lab.tasks()
        gate = runner.results(self.store, lab, sha, tasks)
        hold = self.store.holdout_scores(sha)
        g_means, h_means, runs = [], [], 0
        for t in tasks:
            seeds = [s for s, v in gate.get(t, {}).items() if s >= BASELINE_SEED0 and v is not None]
            paired = [s for s in seeds if s in hold.get(t, {})]
            use = paired or seeds
            if not use:
                continue
            runs += len(use)
            g_means.append(sum(gate[t][s] for s in use) / len(use))
            if paired:
                h_means.append(sum(hold[t][s] for s in paired) / len(paired))
        if not g_means:
            return None
        return {"commit": sha, "gate": sum(g_means) / len(g_means),
                "holdout": sum(h_means) / len(h_means) if len(h_means) == len(g_means) else None,
                "tasks": len(g_means), "runs": runs}

    def release(self, commit: str) -> None:
        """A decided challenger's worktree is not needed any more (its tag keeps the commit)."""
        from pipeline.worktrees import Worktrees

        Worktrees(self.lab.root, self.lab.state).remove(commit)

    # --- smoke runs ----------------------------------------------------------------------------

    def smoke(self, base: str, files: dict[str, str], stop: threading.Event | None = None) -> float:
        """The candidate (`base` with `files` applied) through every stage on tiny data, in a warm
        worker of its own; the metric, or `pipeline.smoke.SmokeFailed` with what went wrong."""
        from pipeline.smoke import SmokeRunner, smoke_run

        self._smoke_runner = self._smoke_runner or SmokeRunner(self.lab)
        return smoke_run(self.lab, base, files, stop=stop, runner=self._smoke_runner)

    def close(self) -> None:
        if self._smoke_runner is not None:
            self._smoke_runner.close()
            self._smoke_runner = None
