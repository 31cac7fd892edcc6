"""The lifecycle lives in the graph's state (issue 21): a new node is a node and one line of the
builder (`GraphSpec.insert_after`), with no edit of any other node, of the loop or of the records;
the loop takes the graph as a parameter (`Loop(..., graph=)`, issue 35), so the node is added from
outside, in one file (tests/support/toy_node.py).

Real parts: git, SQLite, the sandboxed local executor on the simulated lab, the real `Loop` and its
LangGraph checkpointer, the gate.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from test_in_flight import seed_effects, sim_lab

pytestmark = pytest.mark.system


def test_a_node_added_from_outside_sees_every_decided_hypothesis_once(tmp_path: Path) -> None:
    from support.lab import make_loop
    from support.toy_node import with_toy_node

    from agent.lifecycle import Decision, Status

    root = sim_lab(tmp_path / "lab")  # 2 tasks on 2 slots: one hypothesis at a time
    ids = seed_effects(root, [4.0, -4.0])
    loop = make_loop(root, max_hypotheses=2, offline=True, graph=with_toy_node)
    try:
        out = loop.run()
        loop.note_reverifications()  # the promoted one's thread goes on to `reverify` after `toy`
        snap = loop.graph.get_state({"configurable": {"thread_id": str(ids[0])}})
    finally:
        loop.close()
    assert out["started"] == 2
    hs = {i: loop.records.get(i) for i in ids}
    assert [h.decision for h in hs.values()] == [Decision.PROMOTE, Decision.ABANDON], hs
    # each hypothesis passed `toy` once, right after its summary, in the order decided
    said = [e.message for e in reversed(loop.records.events(100)) if e.kind == "toy"]
    assert said == [f"toy: #{ids[0]} promote", f"toy: #{ids[1]} abandon"], said
    # the thread of the promoted one goes on from `toy` exactly where `summarize` led: `reverify`
    # waits there for the champion's fresh runs, or has recorded them and ended
    assert snap.next in ((), ("reverify",)), snap.next
    assert all(h.status == Status.DONE for h in hs.values())
