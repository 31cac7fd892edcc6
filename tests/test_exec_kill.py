"""kill -9 of the process driving a batch, then a restart: every run completes exactly once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from support.tiny import TINY_RUNNER, TASKS, TinyHarness, git, make_lab, open_tiny_lab
from pipeline import runner
from pipeline import experiment, labrepo

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
BASE = "autoresearch/baseline"
SEEDS = [0, 1, 2]


def start_driver(lab_root: Path, ledger: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]), EXEC_LEDGER=str(ledger))
    return subprocess.Popen(
        [sys.executable, "-c", TINY_RUNNER, str(lab_root), "--preload", "numpy",
         "--workers", "2", "--heartbeat-s", "0.5"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )


def test_kill_9_mid_batch_then_restart_completes_every_run_exactly_once(tmp_path: Path) -> None:
    lab = make_lab(tmp_path / "lab", pretrain_sleep=0.4, finetune_sleep=0.6)
    store = experiment.open_store(lab)
    ids = experiment.ensure_runs(store, lab, BASE, TASKS, SEEDS, harness=TinyHarness())
    ledger = tmp_path / "ledger.txt"

    first = start_driver(lab.root, ledger)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # kill once some runs are done and others are mid-stage
        counts = store.queue_counts()
        if counts["done"] >= 2 and counts["running"] >= 1:
            break
        assert first.poll() is None, first.stdout.read().decode()  # type: ignore[union-attr]
        time.sleep(0.05)
    else:
        raise AssertionError(f"batch never got going: {store.queue_counts()}")
    workers = psutil.Process(first.pid).children(recursive=True)
    assert workers, "the driver has a warm worker"
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    assert first.returncode == -signal.SIGKILL
    # the warm worker and its stages die with the driver: nothing keeps writing after the kill
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive
    orphaned = [r for r in store.runs(ids) if r.status == "running"]
    assert orphaned and all(r.owner_pid == first.pid for r in orphaned)
    done_before = {r.id for r in store.runs(ids) if r.status == "done"}

    second = start_driver(lab.root, ledger)
    out, _ = second.communicate(timeout=120)
    assert second.returncode == 0, out.decode()
    assert "re-queued" in out.decode()

    runs = store.runs(ids)
    assert all(r.status == "done" for r in runs)
    assert {r.id for r in runs if r.requeues == 1} == {r.id for r in orphaned}
    assert {r.id for r in runs if r.requeues == 0} >= done_before
    results = store.results_for(labrepo.resolve_commit(lab, BASE))
    keys = [(r.task, r.seed) for r in results]
    assert sorted(keys) == sorted((t, s) for t in TASKS for s in SEEDS)  # each run once, none twice
    assert all(r.outcome == "ok" for r in results), [(r.task, r.seed, r.outcome, r.detail) for r in results]
    lost = [e for e in store.stage_execs(ids) if e.outcome == "lost"]
    assert lost and {e.run_id for e in lost} <= {r.id for r in orphaned}
    assert store.goodput().requeues == len(orphaned)
    # honest goodput: the work the dead driver's stages had done counts as lost, from each one's start
    # to the heartbeat the driver missed (never 0 s for a stage that was running)
    assert all(e.cpu_s > 0 and e.finished_at > e.started_at for e in lost), [(e.cpu_s, e.detail) for e in lost]
    assert all("of work lost" in (e.detail or "") for e in lost)
    g = store.goodput()
    assert g.infra_lost_cpu_s == sum(e.cpu_s for e in lost) > 0 and g.goodput < 1.0

    # the same batch, never interrupted, in a clone of the lab: identical metrics
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", "-b", BASE, str(lab.root), str(clone))
    ref_lab = open_tiny_lab(clone)
    ref_store = experiment.open_store(ref_lab)
    ref_ids = experiment.ensure_runs(ref_store, ref_lab, BASE, TASKS, SEEDS, harness=TinyHarness())
    with runner.Driver(ref_lab, ref_store, runner.make_executor("local", ref_lab, preload=("numpy",)),
                       harness=TinyHarness()) as d:
        d.drive(until=ref_ids, timeout_s=120)
    assert experiment.results(ref_store, ref_lab, BASE, TASKS) == experiment.results(store, lab, BASE, TASKS)
