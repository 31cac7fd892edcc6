"""`autoresearch run` killed with SIGKILL at each step of a hypothesis, or stopped with SIGTERM, then restarted.

Real processes all the way: the CLI, its warm worker and stages, smoke runs, SQLite, git, and the
openai SDK talking to a fake server in this test process (which is how a call is made to hang).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import psutil
import pytest

from support.lab import (
    LR_EDIT,
    TASKS,
    RoutedOpenAI,
    RunProcess,
    assert_runs_exactly_once,
    cli_env,
    decision,
    descendants,
    edits,
    git,
    llm_env,
    open_lab,
    proposal,
    records,
    smoke_running,
)
from support.fake_openai import content, stall
from pipeline import experiment

pytestmark = pytest.mark.system


_stores: dict[Path, object] = {}


def queue(root: Path) -> dict[str, int]:
    if root not in _stores:
        _stores[root] = experiment.open_store(open_lab(root))
    return _stores[root].queue_counts()  # type: ignore[attr-defined]


def kill9(run: RunProcess) -> None:
    """SIGKILL the loop alone, as the OOM killer would; what it started must die with it."""
    children = descendants(run.pid)
    run.kill9()
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, f"left running after kill -9: {[p.cmdline() for p in alive]}"


def test_kill_9_during_propose_smoke_runs_and_decide_then_restart_finishes_the_hypothesis_once(
        lab: Path, llm: RoutedOpenAI) -> None:
    env = cli_env(**llm_env(llm))
    args = ("--max-hypotheses", "1", "--workers", "1")
    rec = records(lab)
    try:
        # 1. during propose: the model never answers
        llm.on("hypothesis", stall(600))
        run = RunProcess(lab, *args, env=env, tag="run1")
        run.wait_until("the proposal request", lambda: llm.asked("hypothesis"))
        kill9(run)
        (h,) = rec.all()
        assert (h.status, h.title) == ("proposing", "")

        # 2. during implement, in the smoke run of the edits
        llm.on("hypothesis", content(proposal()))
        llm.on("edits", content(edits(LR_EDIT)))
        run = RunProcess(lab, *args, env=env, tag="run2")
        run.wait_until("the smoke run", lambda: smoke_running(run.pid))
        kill9(run)
        h = rec.get(h.id)
        assert (h.status, h.commit) == ("implementing", None) and h.title == proposal()["title"]
        assert git(lab, "branch", "--list", "hyp/*") == ""

        # 3. during the runs of the first look
        llm.on("edits", content(edits(LR_EDIT)))
        run = RunProcess(lab, *args, env=env, tag="run3")
        run.wait_until("runs in flight", lambda: (q := queue(lab))["running"] >= 1 and q["done"] >= 1, timeout=180)
        kill9(run)
        orphaned = [r.id for r in experiment.open_store(open_lab(lab)).runs() if r.status == "running"]
        assert orphaned
        h = rec.get(h.id)
        assert h.status == "measuring" and h.commit

        # 4. during decide: the model never answers
        llm.on("decision", stall(600))
        run = RunProcess(lab, *args, env=env, tag="run4")
        run.wait_until("the decision request", lambda: llm.asked("decision"), timeout=180)
        kill9(run)
        h = rec.get(h.id)
        assert h.status == "deciding" and h.verdict

        # 5. the last restart finishes it
        llm.on("decision", content(decision("abandon", "Not convincing.")))
        run = RunProcess(lab, *args, env=env, tag="run5")
        assert run.wait(240) == 0, run.stderr()[-4000:]
        assert f"#{h.id} {h.title!r}: resuming (deciding)" in run.stderr()
    finally:
        run.cleanup()

    # one hypothesis, finished once, with one branch and one experiment tag
    (h,) = rec.all()
    assert (h.status, h.decision, h.rationale_decision) == ("done", "abandon", "Not convincing.")
    assert git(lab, "branch", "--list", "hyp/*").split() == [h.branch]
    assert git(lab, "tag", "--list", "exp/*").split() == ["exp/1"]
    assert git(lab, "rev-parse", "exp/1^{commit}") == h.commit
    # no run lost or duplicated: every queued run finished, once, the orphaned ones after a re-queue
    counts = assert_runs_exactly_once(lab)
    assert counts["queued"] == counts["running"] == 0
    store = experiment.open_store(open_lab(lab))
    runs = store.runs()
    wanted = [(h.base_commit, t, s) for t in TASKS for s in range(3)]  # the baseline's own seeds (its block)
    wanted += [(h.commit, t, s) for t in TASKS for s in range(h.look)]
    assert sorted((r.commit, r.task, r.seed) for r in runs) == sorted(wanted)
    assert all(r.requeues >= 1 for r in runs if r.id in orphaned)
    assert len(store.gate_records(str(h.id), kind="verdict")) == 1
    assert [d.decision for d in rec.decisions(h.id)] == ["abandon"]
    assert len(llm.asked("decision")) == 2 and len(llm.asked("hypothesis")) == 2
    assert not llm.unscripted


def test_sigterm_mid_batch_exits_0_quickly_and_a_restart_finishes_every_run_once(lab: Path) -> None:
    run = RunProcess(lab, "--offline", "--max-hypotheses", "1", "--workers", "1", tag="term")
    try:
        run.wait_until("runs in flight", lambda: (q := queue(lab))["running"] >= 1 and q["done"] >= 1, timeout=180)
        t0 = time.monotonic()
        run.proc.send_signal(signal.SIGTERM)
        code = run.wait(30)
        assert time.monotonic() - t0 < 30
        assert code == 0, run.stderr()[-4000:]
        assert "received SIGTERM" in run.stderr() and "loop stopped (signal)" in run.stderr()
        q = queue(lab)
        assert q["running"] == 0  # each run in flight finished or was handed back to the queue
        (h,) = records(lab).all()
        assert h.status == "measuring"

        run = RunProcess(lab, "--offline", "--max-hypotheses", "1", "--workers", "1", tag="term2")
        assert run.wait(240) == 0, run.stderr()[-4000:]
    finally:
        run.cleanup()
    (h,) = records(lab).all()
    assert h.status == "done" and h.verdict
    counts = assert_runs_exactly_once(lab)
    assert counts["queued"] == counts["running"] == 0 and counts["done"] == 2 * 3 + 2 * h.look
