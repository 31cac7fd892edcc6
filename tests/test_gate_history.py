"""What the paired gate borrows from the lab's store (`Experiment.histories`): earlier comparisons'
paired differences and their arms' runs, frozen at the comparison being judged, on one dataset."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pipeline.experiment import Experiment
from pipeline.store import Owner, Result, Store

pytestmark = pytest.mark.integration

TASKS = ["a", "b"]


def measure(store: Store, commit: str, values: dict[tuple[str, int], float], dataset: str = "d1") -> None:
    """Runs of `commit` through the real queue: enqueue, claim, finish with a result."""
    store.ensure_arm(commit)
    store.enqueue(commit, list(values))
    for claim in store.claim(Owner.current(), len(values), commits=[commit]):
        r = claim.run
        assert store.finish(claim, Result(run_id=r.id, commit=commit, task=r.task, seed=r.seed,
                                          value=values[(r.task, r.seed)], dataset_id=dataset))


def runs(base: float, seeds: range) -> dict[tuple[str, int], float]:
    return {(t, s): base + 0.01 * j + 0.001 * s for j, t in enumerate(TASKS) for s in seeds}


def test_histories_are_frozen_at_the_comparison_and_leave_its_own_arms_out(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    exp = Experiment(lab=None, store=store)  # histories reads the store only
    base, old, cur, later = "b" * 40, "o" * 40, "c" * 40, "l" * 40
    measure(store, base, runs(0.70, range(3)))
    measure(store, old, runs(0.71, range(2)))
    store.mark_comparison(old, base)
    measure(store, old, {("a", 5): 0.5}, dataset="d0")  # measured on another dataset: left out
    time.sleep(0.01)
    store.mark_comparison(cur, base)  # the comparison being judged
    measure(store, cur, runs(0.72, range(2)))
    time.sleep(0.01)
    measure(store, later, runs(0.9, range(2)))
    store.mark_comparison(later, base)  # recorded after it: not part of its prior
    measure(store, old, {("a", 7): 0.99})  # a run of an earlier arm added after it: left out too

    pairs, arms = exp.histories(TASKS, exclude=(cur, base), dataset="d1")
    assert len(pairs) == 1 and [round(x, 6) for x in pairs[0]["a"]] == [0.01, 0.01]
    # one arm: the earlier challenger; the current baseline and challenger are never in it
    assert arms == [{"a": [0.71, 0.711], "b": [0.72, 0.721]}]
    # a look without a recorded comparison (a no-op: the same commit) sees every comparison and run
    pairs_all, arms_all = exp.histories(TASKS, exclude=None, dataset="d1")
    assert len(pairs_all) == 3 and len(arms_all) == 4
    assert {"a": [0.71, 0.711, 0.99], "b": [0.72, 0.721, None]} in arms_all  # seed 7, not d0's seed 5
    store.dispose()
