"""The driver end to end: real lab repo, real SQLite store, real warm-worker executor, real scorer."""

from __future__ import annotations

import json
import math
import os
import signal
import threading
from collections import Counter
from pathlib import Path

import pytest

from support.tiny import TASKS, TinyHarness, commit_change, make_lab, open_tiny_lab
from pipeline import runner
from pipeline.dag import UserError
from pipeline.executors.local import LocalExecutor
from pipeline.store import Store
from pipeline import experiment, labrepo
from test_exec_store import db  # noqa: F401  (SQLite and PostgreSQL, a private schema each)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BASE = "autoresearch/baseline"


def local(slots: int = 2) -> LocalExecutor:
    return LocalExecutor(preload=("numpy",), slots=slots)


def run_batch(lab, store: Store, commit: str, tasks: list[str], seeds: list[int], **driver_kw) -> list[int]:
    harness = TinyHarness()
    ids = experiment.ensure_runs(store, lab, commit, tasks, seeds, harness=harness)
    with runner.Driver(lab, store, driver_kw.pop("executor", None) or local(), harness=harness, **driver_kw) as d:
        d.drive(until=ids, timeout_s=120)
    return ids


def executed(store: Store, ids: list[int]) -> Counter[tuple[str, str]]:
    """(stage, outcome) counts of the given runs' stage records."""
    return Counter((e.stage, e.outcome) for e in store.stage_execs(ids))


@pytest.fixture
def lab(tmp_path: Path):
    return make_lab(tmp_path / "lab", timeout_s=20)


def test_a_batch_runs_each_pretraining_once_per_seed_and_scores_every_run(lab) -> None:
    store = experiment.open_store(lab)
    ids = run_batch(lab, store, BASE, TASKS, [0, 1])
    res = experiment.results(store, lab, BASE, TASKS)
    assert sorted(res) == TASKS and all(sorted(v) == [0, 1] for v in res.values())
    assert all(0.5 < v < 1.0 for per_seed in res.values() for v in per_seed.values())  # type: ignore[operator]
    counts = executed(store, ids)
    # the other tasks of a seed wait on the pretraining in flight, or find it published
    assert counts[("pretrain", "ok")] == 2 and counts[("pretrain", "shared")] + counts[("pretrain", "cache_hit")] == 4
    assert counts[("finetune", "ok")] == 6
    assert store.queue_counts() == {"queued": 0, "running": 0, "done": 6, "failed": 0}
    # asking again queues nothing and computes nothing
    before = len(store.stage_execs())
    assert run_batch(lab, store, BASE, TASKS, [0, 1]) == ids
    assert len(store.stage_execs()) == before
    g = store.goodput()
    assert g.useful_cpu_s > 0 and g.cache_hits == 4 and g.saved_by_cache_cpu_s > 0 and g.goodput == 1.0


def test_a_finetune_only_change_reruns_zero_pretrain_stages(lab) -> None:
    store = experiment.open_store(lab)
    run_batch(lab, store, BASE, TASKS, [0, 1])
    base_values = experiment.results(store, lab, BASE, TASKS)
    branch = commit_change(lab.root, "hyp/1-shrink", "config.toml", "shrink = 0.1", "shrink = 0.5")
    ids = run_batch(lab, store, branch, TASKS, [0, 1])
    counts = executed(store, ids)
    assert counts[("pretrain", "cache_hit")] == 6
    assert sum(n for (stage, outcome), n in counts.items() if stage == "pretrain" and outcome != "cache_hit") == 0
    assert counts[("finetune", "ok")] == 6
    assert experiment.results(store, lab, branch, TASKS) != base_values  # the change did something
    # control: a model change invalidates pretraining (once per seed)
    model = commit_change(lab.root, "hyp/2-scale", "model.py", "SCALE = 1.0", "SCALE = 2.0")
    counts = executed(store, run_batch(lab, store, model, TASKS, [0, 1]))
    assert counts[("pretrain", "ok")] == 2 and counts[("finetune", "ok")] == 6


def test_method_failures_are_results_with_their_kind(tmp_path: Path) -> None:
    lab = make_lab(tmp_path / "lab", timeout_s=10)  # every stage's limit: only `hang` waits it out
    store = experiment.open_store(lab)
    failing = ["crash", "hang", "nan", "garbage", "missing", "segv"]
    run_batch(lab, store, BASE, ["a", *failing], [0])
    by_task = {r.task: r for r in store.results_for(labrepo.resolve_commit(lab, BASE))}
    assert by_task["a"].outcome == "ok" and math.isfinite(by_task["a"].value)  # type: ignore[arg-type]
    kinds = {t: (by_task[t].outcome, by_task[t].kind) for t in failing}
    assert kinds == {
        "crash": ("method_failure", "crash"),
        "hang": ("method_failure", "timeout"),
        "nan": ("method_failure", "nan"),
        "garbage": ("method_failure", "predictions"),
        "missing": ("method_failure", "predictions"),
        "segv": ("method_failure", "signal"),
    }
    assert "diverged" in Path(by_task["crash"].detail.split("log ")[-1]).read_text()  # type: ignore[union-attr]
    assert experiment.results(store, lab, BASE, failing) == {t: {0: None} for t in failing}
    g = store.goodput()
    assert g.method_failed_cpu_s > 0 and g.infra_lost_cpu_s == 0


def test_a_failing_pretraining_fails_every_dependent_run_once(lab) -> None:
    store = experiment.open_store(lab)
    branch = commit_change(lab.root, "hyp/3-broken", "model.py", "SCALE = 1.0", "SCALE = 1 / 0")
    ids = run_batch(lab, store, branch, TASKS, [0])
    counts = executed(store, ids)
    assert counts[("pretrain", "method")] == 1 and counts[("pretrain", "upstream_failed")] == 2
    assert experiment.results(store, lab, branch, TASKS) == {t: {0: None} for t in TASKS}
    # a new driver (after a restart) knows: the failed key is not executed again
    more = run_batch(lab, store, branch, TASKS, [0, 1])
    assert executed(store, more)[("pretrain", "method")] == 2  # seed 1 ran once; seed 0 not again


def test_a_failure_recorded_in_an_older_stage_environment_is_run_again_once(lab) -> None:
    """A method failure an older version of the tool recorded may have been the tool's own doing (a
    limit CUDA cannot start under, too small a /dev/shm): after an upgrade its key runs once more
    instead of failing every run that needs it; a failure in this environment still stands."""
    from sqlalchemy import text

    store = experiment.open_store(lab)
    branch = commit_change(lab.root, "hyp/4-broken", "model.py", "SCALE = 1.0", "SCALE = 1 / 0")
    first = run_batch(lab, store, branch, TASKS[:1], [0])
    assert executed(store, first)[("pretrain", "method")] == 1
    with store.engine.begin() as c:  # as recorded by a version that kept no environment
        c.execute(text("update stage_exec set env = null"))
    second = run_batch(lab, store, branch, TASKS[1:2], [0])
    assert executed(store, second)[("pretrain", "method")] == 1  # the old record not trusted: ran again
    third = run_batch(lab, store, branch, TASKS[2:], [0])
    assert executed(store, third)[("pretrain", "method")] == 0  # this environment's record stands
    assert executed(store, third)[("pretrain", "upstream_failed")] == len(TASKS[2:])


def test_infrastructure_failures_retry_with_the_same_seed(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SLOW_S", "2")
    lab = make_lab(tmp_path / "lab", retries=1)
    store = experiment.open_store(lab)
    harness = TinyHarness()
    (run_id,) = experiment.ensure_runs(store, lab, BASE, ["slow"], [0], harness=harness)
    killed: list[int] = []

    with runner.Driver(lab, store, local(), harness=harness) as d:
        def kill_worker_once() -> bool:
            proc = d.executor._proc  # type: ignore[attr-defined]
            stage = next(iter(d.flights.values()), None)
            if not killed and proc is not None and stage is not None and stage.node.name == "finetune":
                os.kill(proc.pid, signal.SIGKILL)
                killed.append(proc.pid)
            return store.runs([run_id])[0].status in ("done", "failed")

        d.drive(until=kill_worker_once, timeout_s=60)
    (run,) = store.runs([run_id])
    (res,) = store.results_for(run.commit)
    assert killed and run.infra_failures == 1 and res.outcome == "ok" and math.isfinite(res.value)  # type: ignore[arg-type]
    outcomes = [e.outcome for e in store.stage_execs([run_id]) if e.stage == "finetune"]
    assert outcomes == ["infra", "ok"]
    assert store.goodput().infra_retries == 1


def test_infrastructure_failures_beyond_retries_are_recorded_but_not_measurements(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SLOW_S", "30")
    lab = make_lab(tmp_path / "lab", retries=0)
    store = experiment.open_store(lab)
    harness = TinyHarness()
    (run_id,) = experiment.ensure_runs(store, lab, BASE, ["slow"], [0], harness=harness)
    with runner.Driver(lab, store, local(), harness=harness) as d:
        def kill_worker() -> bool:
            if d.flights and next(iter(d.flights.values())).node.name == "finetune" and d.executor._proc:  # type: ignore[attr-defined]
                os.kill(d.executor._proc.pid, signal.SIGKILL)  # type: ignore[attr-defined]
            return store.runs([run_id])[0].status in ("done", "failed")

        d.drive(until=kill_worker, timeout_s=60)
    (run,) = store.runs([run_id])
    (res,) = store.results_for(run.commit)
    assert run.status == "failed" and res.outcome == "infra_failure" and res.kind == "infra"
    assert experiment.results(store, lab, BASE, ["slow"]) == {"slow": {}}


def test_a_stage_argument_into_the_sealed_labels_is_refused(lab) -> None:
    toml = lab.config_path.read_text().replace("--out {out}\"\nscope = \"run\"",
                                               "--out {out} --labels ../../sealed\"\nscope = \"run\"")
    assert "../../sealed" in toml
    lab.config_path.write_text(toml)
    lab = open_tiny_lab(lab.root)
    store = experiment.open_store(lab)
    harness = TinyHarness()
    ids = experiment.ensure_runs(store, lab, BASE, ["a"], [0], harness=harness)
    with pytest.raises(UserError):
        with runner.Driver(lab, store, local(), harness=harness) as d:
            d.drive(until=ids, timeout_s=30)
    assert store.runs(ids)[0].status == "queued"  # given back, not failed and not lost


def test_graceful_stop_requeues_and_a_new_driver_finishes(tmp_path: Path) -> None:
    lab = make_lab(tmp_path / "lab", finetune_sleep=3.0)
    store = experiment.open_store(lab)
    harness = TinyHarness()
    ids = experiment.ensure_runs(store, lab, BASE, TASKS, [0], harness=harness)
    stop = threading.Event()
    with runner.Driver(lab, store, local(), harness=harness) as d:

        def finetune_in_flight() -> bool:
            # stop (the event drive() honours) once a finetune stage runs (it sleeps 3 s): the stop lands mid-stage
            if any(fl.node.name == "finetune" for fl in d.flights.values()):
                stop.set()
            return store.count_unfinished(ids) == 0

        d.drive(until=finetune_in_flight, stop=stop, timeout_s=30, poll_s=0.05)
        assert stop.is_set()
    counts = store.queue_counts()
    assert counts["running"] == 0 and counts["queued"] >= 1
    assert any(e.outcome == "cancelled" for e in store.stage_execs(ids))
    with runner.Driver(lab, store, local(), harness=harness) as d:
        d.drive(until=ids, timeout_s=60)
    assert store.queue_counts()["done"] == 3 and len(store.results_for(labrepo.resolve_commit(lab, BASE))) == 3
    assert all(r.requeues == 0 for r in store.runs(ids))  # a graceful stop is not a retry


def test_a_driver_abandoned_in_this_process_leaves_nothing_stuck(tmp_path: Path) -> None:
    lab = make_lab(tmp_path / "lab", finetune_sleep=1.0)
    store = experiment.open_store(lab)
    harness = TinyHarness()
    ids = experiment.ensure_runs(store, lab, BASE, TASKS, [0], harness=harness)
    lost = runner.Driver(lab, store, local(), harness=harness)
    lost.step(0.5)  # claims, launches: then the caller drops it without close() (an exception upstream)
    lost.heartbeat.stop()
    lost.executor.close()
    assert store.queue_counts()["running"] >= 1
    with runner.Driver(lab, store, local(), harness=harness) as d:  # same pid: alive, yet orphaned
        d.drive(until=ids, timeout_s=60)
    assert store.queue_counts() == {"queued": 0, "running": 0, "done": 3, "failed": 0}
    assert len(store.results_for(labrepo.resolve_commit(lab, BASE))) == 3


def test_status_records_are_plain_json(lab) -> None:
    store = experiment.open_store(lab)
    run_batch(lab, store, BASE, ["a"], [0])
    (res,) = store.results_for(labrepo.resolve_commit(lab, BASE))
    doc = json.loads(res.model_dump_json())
    assert doc["task"] == "a" and doc["outcome"] == "ok" and isinstance(doc["value"], float)
    assert set(store.goodput().as_dict()) >= {"useful_cpu_s", "infra_lost_cpu_s", "saved_by_cache_cpu_s", "goodput"}


def test_the_driver_works_the_same_on_sqlite_and_postgresql(db, tmp_path: Path) -> None:  # noqa: F811
    url, schema = db
    lab = make_lab(tmp_path / "lab")
    store = Store(url, schema=schema)
    ids = run_batch(lab, store, BASE, ["a", "b", "crash"], [0, 1])
    res = experiment.results(store, lab, BASE, ["a", "b", "crash"])
    assert res["crash"] == {0: None, 1: None}
    assert all(isinstance(v, float) for t in ("a", "b") for v in res[t].values()) and len(res["a"]) == 2
    assert store.queue_counts()["done"] == len(ids) == 6
    assert executed(store, ids)[("pretrain", "ok")] == 2
    store.dispose()
