"""A supervised hold is an interrupt in the hypothesis's LangGraph thread: kill -9 of the loop while
it is held, a human's approval, a restart, and the thread resumes from its checkpoint at the hold
and promotes exactly once."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from agent.labinit import init_lab
from support.lab import RunProcess, cli, git

pytestmark = pytest.mark.system


def _status(root: Path) -> dict:
    out = cli(root, "status", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _held(root: Path) -> bool:
    db = root / "runs" / "autoresearch.db"
    if not db.is_file():
        return False
    try:
        row = sqlite3.connect(db).execute("SELECT status FROM hypothesis WHERE id = 1").fetchone()
    except sqlite3.OperationalError:
        return False
    return bool(row) and row[0] == "held"


def _graph(root: Path):
    from agent.graph import Services, build_graph, open_checkpointer
    from agent.policy_offline import OfflinePolicy
    from agent.records import Records
    from agent.workspace import Workspace
    from pipeline import experiment
    from pipeline.lab import load_lab

    lab = load_lab(root)
    store = experiment.open_store(lab)
    svc = Services(lab, store, Records(store), Workspace(lab), OfflinePolicy())
    saver = open_checkpointer(svc)
    return build_graph(svc, saver), saver, store


CONFIG = {"configurable": {"thread_id": "1"}}


def _paused(root: Path) -> bool:
    """Whether hypothesis 1's thread waits at the hold node's interrupt, in its checkpoint."""
    if not (root / "runs" / "checkpoints.sqlite").is_file():
        return False
    graph, saver, _ = _graph(root)
    try:
        snap = graph.get_state(CONFIG)
        return snap.next == ("hold",) and bool(snap.interrupts)
    finally:
        saver.conn.close()


def test_kill_9_during_a_supervised_hold_then_approve_resumes_the_thread_and_promotes_once(tmp_path: Path) -> None:
    root = init_lab(tmp_path / "lab", harness="command")  # the offline policy's first idea is a real gain
    first = RunProcess(root, "--offline", "--supervised", "--max-hypotheses", "2", tag="first")
    try:
        first.wait_until("hypothesis 1 held", lambda: _held(root), timeout=240)
        first.kill9()  # perhaps before its summary and the interrupt in its thread's checkpoint
    finally:
        first.cleanup()
    if not _paused(root):  # a restart takes it to the hold
        again = RunProcess(root, "--offline", "--supervised", "--max-hypotheses", "1", tag="again")
        try:
            again.wait_until("the hold's interrupt", lambda: _paused(root), timeout=240)
            again.kill9()
        finally:
            again.cleanup()
    h = _status(root)["hypotheses"][0]
    assert (h["status"], h["decision"], h["review"], h["promoted_tag"]) == ("held", "hold", "pending", None)
    assert git(root, "tag", "-l", "baseline/*") == ""
    summary = (root / "runs" / "summaries" / "1.md").read_text()
    assert "held for a human's approval" in summary
    assert _paused(root)  # the interrupt survived the kill

    review = cli(root, "review", "1", "--approve", "--comment", "looks real")
    assert review.returncode == 0, review.stderr
    second = RunProcess(root, "--offline", "--supervised", "--max-hypotheses", "1", tag="second")
    try:
        assert second.wait(timeout=300) == 0, second.stderr()[-3000:]
    finally:
        second.cleanup()
    h = _status(root)["hypotheses"][0]
    assert (h["status"], h["decision"], h["promoted_tag"]) == ("done", "promote", "baseline/v1"), h
    assert git(root, "tag", "-l", "baseline/*").split() == ["baseline/v1"]  # promoted once
    commit = git(root, "rev-parse", "exp/1^{commit}")
    assert git(root, "rev-parse", "baseline/v1^{commit}") == commit == git(root, "rev-parse", "autoresearch/baseline")

    graph, saver, store = _graph(root)
    done = graph.get_state(CONFIG)
    # decided: the thread goes on to re-verify the champion: it waits there for the fresh runs, or
    # (they were in before the loop stopped) has recorded how the champion held up and ended
    assert done.values["phase"] == "done"
    if done.next:
        assert done.next == ("reverify",) and done.interrupts[0].value["champion"] == "baseline/v1"
    else:
        assert not done.interrupts and store.gate_records("1", kind="reverify")
    history = [st.next for st in graph.get_state_history(CONFIG)]
    assert ("hold",) in history and ("promote",) in history  # resumed at the hold, then the promote node
    saver.conn.close()
    # the decision at the look was taken once, before the hold; the resume did not ask again
    from agent.records import Records

    made = [d.decision for d in Records(store).decisions(1)]  # escalations at the paired gate's earlier looks, then one hold
    assert made[-1] == "hold" and made.count("hold") == 1 and set(made[:-1]) <= {"escalate"}, made
    assert "promote" in (root / "runs" / "summaries" / "1.md").read_text()
