"""The lifecycle lives in the graph's state (issue 21): a new node is a node and one line of the
builder (`GraphSpec.insert_after`), with no edit of any other node, of the loop or of the records.

Real parts: git, SQLite, the sandboxed local executor on the simulated lab, the real `Loop` and its
LangGraph checkpointer, the gate.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from test_in_flight import seed_effects, sim_lab

pytestmark = pytest.mark.system


def test_a_notify_node_after_summarize_sees_every_decided_hypothesis_once(tmp_path: Path) -> None:
    from support.lab import make_loop

    from agent.graph import Status, graph_spec

    root = sim_lab(tmp_path / "lab")  # 2 tasks on 2 slots: one hypothesis at a time
    ids = seed_effects(root, [4.0, -4.0])
    loop = make_loop(root, max_hypotheses=2, offline=True)
    seen: list[tuple[int, str, str | None]] = []

    def notify(state):  # the new node: reads its thread's state, changes nothing of the lifecycle
        h = loop.records.get(state["hypothesis_id"])
        seen.append((h.id, state["phase"], h.decision))
        return {}

    spec = graph_spec(loop.svc)
    spec.insert_after("summarize", "notify", notify)  # the only change to the graph
    loop.graph = spec.compile(loop.checkpointer, projection=loop.records)
    try:
        out = loop.run()
        loop.note_reverifications()  # the promoted one's thread goes on to `reverify` after `notify`
        snap = loop.graph.get_state({"configurable": {"thread_id": str(ids[0])}})
    finally:
        loop.close()
    assert out["started"] == 2
    hs = {i: loop.records.get(i) for i in ids}
    assert [h.decision for h in hs.values()] == ["promote", "abandon"], hs
    # each hypothesis passed `notify` once, right after its summary (phase done), in the order decided
    assert seen == [(ids[0], Status.DONE, "promote"), (ids[1], Status.DONE, "abandon")]
    # the thread of the promoted one goes on from `notify` exactly where `summarize` led: `reverify`
    # waits there for the champion's fresh runs, or has recorded them and ended
    assert snap.next in ((), ("reverify",)), snap.next
    assert all(h.status == Status.DONE for h in hs.values())
