"""Typed reads of gate records (agent/verdicts.py, `Records`) on a real SQLite store: a `GateResult`
put comes back equal; the agent's decisions in its own table (an older store's moved there once); a
decision string this version does not know is kept raw, never raised; the `Decision` and `Status`
enums are their stored strings."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sqlalchemy import text

from agent import verdicts
from agent.graph import allowed_decisions
from agent.records import ACTIVE, Decision, Hypothesis, Records, Review, Status
from agent.verdicts import DecisionRecord
from pipeline.gate import GateResult, evaluate
from pipeline.store import Store

pytestmark = pytest.mark.integration


def _result(m: int, effect: float = 0.03) -> GateResult:
    rng = np.random.default_rng(9)
    tasks = []
    for j in range(3):
        b = list(0.8 + 0.01 * rng.standard_normal(5))
        tasks.append({"task": f"t{j}", "baseline": b, "challenger": list(0.8 + effect + 0.01 * rng.standard_normal(m)),
                      "history": b})
    return evaluate({"tasks": tasks})


@pytest.fixture
def rec(tmp_path) -> Records:
    return Records(Store(f"sqlite:///{tmp_path / 'store.db'}"))


def test_verdicts_round_trip_typed(rec: Records, tmp_path):
    h = rec.add(Hypothesis(title="x"))
    assert rec.latest_verdict(h.id) is None and rec.verdicts(h.id) == [] and rec.verdict_at(h.id, 2) is None
    at2, at5 = _result(2), _result(5)
    rec.store.put_gate_record(str(h.id), 2, at2)
    rec.store.put_gate_record(str(h.id), 5, at5)
    # a second Store on the same file: what a later process reads
    again = Records(Store(f"sqlite:///{tmp_path / 'store.db'}"))
    assert again.latest_verdict(h.id) == at5
    assert again.verdict_at(h.id, 2) == at2 and again.verdict_at(h.id, 3) is None
    assert again.verdicts(h.id) == [at2, at5]
    assert verdicts.verdicts_by_look(again.store, h.id) == {2: at2, 5: at5}
    # the JSON the store keeps is the gate's own, unchanged
    assert again.store.gate_records(str(h.id), kind="verdict")[-1].payload == at5.to_json()
    assert GateResult.from_dict(json.loads(json.dumps(at5.to_json()))) == at5


def test_decisions_round_trip_and_stored_as_plain_strings(rec: Records):
    h = rec.add(Hypothesis(title="x"))
    allowed = allowed_decisions("improvement", 5, [2, 5, 10], supervised=False)
    assert allowed == [Decision.PROMOTE, Decision.ABANDON] and allowed == ["promote", "abandon"]
    d = DecisionRecord(5, Decision.PROMOTE, "it won", "", allowed, "improvement", "offline")
    rec.put_decision(h.id, d)
    with rec.store.engine.connect() as c:  # the agent's own table, plain strings
        row = c.execute(text("select hypothesis, look, decision, rationale, allowed, verdict, policy from agent_decision")).one()
    assert tuple(row) == (str(h.id), 5, "promote", "it won", '["promote", "abandon"]', "improvement", "offline")
    rec.put_decision(h.id, d)  # a decide run again: replaced, not doubled
    assert rec.decisions(h.id) == [d] and not rec.store.gate_records(str(h.id), kind="decision")
    back = rec.decision_at(h.id, 5)
    assert back == d and back.decision is Decision.PROMOTE and back.known
    assert rec.decision_at(h.id, 2) is None
    # a column written with an enum holds its string, and reads back as the enum
    rec.update(h.id, status=Status.DONE, decision=Decision.ABANDON)
    with rec.store.engine.connect() as c:
        row = c.execute(text("select status, decision, review from hypothesis where id = :i"), {"i": h.id}).one()
    assert tuple(row) == ("done", "abandon", "none") and type(row[0]) is str
    back = rec.get(h.id)
    assert back.status is Status.DONE and back.decision is Decision.ABANDON and back.review is Review.NONE
    # a string this version does not know (a newer database's) reads as it is
    with rec.store.engine.begin() as c:
        c.execute(text("update hypothesis set decision = 'graft' where id = :i"), {"i": h.id})
    assert rec.get(h.id).decision == "graft"


def test_an_unknown_decision_from_an_old_database_is_kept_raw(rec: Records):
    """A decision string this version does not know is read as that string (not raised): it is in no
    allowed list, so `Nodes._choice` asks the policy again instead of carrying it out."""
    h = rec.add(Hypothesis(title="x"))
    rec.put_decision(h.id, DecisionRecord.from_dict(2, {"decision": "postpone", "rationale": "old"}))
    d = rec.decision_at(h.id, 2)
    assert d is not None and d.decision == "postpone" and not d.known and not isinstance(d.decision, Decision)
    assert d.decision not in allowed_decisions("escalate", 2, [2, 5], supervised=False)
    assert Decision.parse("refine") is Decision.REFINE


def test_an_older_stores_decisions_move_to_the_agent_table_once_and_lose_nothing(tmp_path):
    """A store written before the agent had its own decision table kept them as `gate_record` rows of
    kind `decision` (also under a re-base's archived key): opening it moves every one, once."""
    store = Store(f"sqlite:///{tmp_path / 'old.db'}")
    store.put_gate_record("1", 2, {"decision": "escalate", "rationale": "more runs", "allowed": ["escalate", "abandon"],
                                   "verdict": "escalate", "policy": "llm"}, kind="decision")
    store.put_gate_record("1", 5, {"decision": "hold", "rationale": "held"}, kind="decision")
    store.put_gate_record("1@0123456789ab", 2, {"decision": "promote", "rationale": "old base"}, kind="decision")
    store.put_gate_record("1", 2, {"tasks": []}, kind="rebase")  # other kinds stay where they are
    first = Records(store)
    assert [(d.look, d.decision, d.rationale) for d in first.decisions(1)] == [(2, "escalate", "more runs"),
                                                                              (5, "hold", "held")]
    assert first.decision_at(1, 2).allowed == ["escalate", "abandon"] and first.decision_at(1, 2).policy == "llm"
    assert [d.decision for d in first.decisions("1@0123456789ab")] == ["promote"]
    assert not store.gate_records("1", kind="decision") and store.gate_records("1", kind="rebase")
    again = Records(Store(f"sqlite:///{tmp_path / 'old.db'}"))  # a second open: nothing moved twice
    assert len(again.decisions(1)) == 2
    # a re-base moves the comparison's decisions aside, beside its verdicts
    assert again.archive_decisions(1, "1@fedcba987654") == 2 and again.decisions(1) == []
    assert [d.look for d in again.decisions("1@fedcba987654")] == [2, 5]
    assert again.archive_decisions(1, "1@fedcba987654") == 0  # idempotent


def test_status_enum():
    assert Status("done").is_finished() and not Status.HELD.is_finished()
    assert ACTIVE == ("proposing", "implementing", "measuring", "deciding", "promoting", "summarizing")
    assert f"{Status.MEASURING}" == "measuring" and json.dumps(Decision.HOLD) == '"hold"'
