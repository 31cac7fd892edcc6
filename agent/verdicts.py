"""Typed reads of a hypothesis's gate records (the store's `gate_record` rows), the one way the
agent reads them, and the typed form of the agent's own decisions.

- kind `verdict`: the gate's `GateResult` at a look, parsed by `GateResult.from_dict`; a record that
  does not fit the model is a pydantic `ValidationError` (as `report` and the pictures always had);
- `DecisionRecord`: the agent's decision at a look, kept in the agent's own table
  (`agent.records.DecisionRow`, read and written by `Records.decisions/decision_at/put_decision`);
  a decision string this version does not know (an older or newer database's) is kept as the raw
  string (`Decision.parse`), never raised, so it matches no allowed decision and the policy is asked
  again. `DECISION` is the gate-record kind older stores kept them under (moved on open).

`rebase`, `reverify` and `replicate` records stay plain dicts (`rebases`, `reverify_record`,
`replicate_record`). `Records`
(agent/records.py) has the verdict reads as methods; the functions here take a `Store` for readers
that hold no `Records`. The gate's models import numpy, so they are imported inside the functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agent.lifecycle import Decision

if TYPE_CHECKING:
    from pipeline.api import GateResult, Store

VERDICT, DECISION, REBASE, REVERIFY, REPLICATE = "verdict", "decision", "rebase", "reverify", "replicate"


@dataclass(frozen=True)
class DecisionRecord:
    """The agent's decision at one look, as `Nodes._choice` stores it before any side effect."""

    look: int
    decision: Decision | str  # a raw str only for a decision this version does not know
    rationale: str = ""
    follow_up: str = ""
    allowed: list[str] = field(default_factory=list)
    verdict: str | None = None
    policy: str | None = None

    @classmethod
    def from_dict(cls, look: int, d: dict[str, Any]) -> DecisionRecord:
        return cls(look=look, decision=Decision.parse(str(d.get("decision") or "")),
                   rationale=d.get("rationale") or "", follow_up=d.get("follow_up") or "",
                   allowed=list(d.get("allowed") or []), verdict=d.get("verdict"), policy=d.get("policy"))

    @classmethod
    def from_row(cls, row: Any) -> DecisionRecord:
        """From its `agent.records.DecisionRow`."""
        return cls.from_dict(row.look, {"decision": row.decision, "rationale": row.rationale,
                                        "follow_up": row.follow_up, "allowed": row.allowed,
                                        "verdict": row.verdict, "policy": row.policy})

    def to_dict(self) -> dict[str, Any]:
        """The JSON the store keeps (the same keys `Nodes._choice` always wrote)."""
        return {"decision": str(self.decision), "rationale": self.rationale, "follow_up": self.follow_up,
                "allowed": [str(a) for a in self.allowed], "verdict": self.verdict, "policy": self.policy}

    @property
    def known(self) -> bool:
        return isinstance(self.decision, Decision)


def _key(hid: int | str) -> str:
    return str(hid)


def verdicts_by_look(store: Store, hid: int | str) -> dict[int, GateResult]:
    """Every verdict record of the hypothesis, by the look it is stored at, in look order."""
    from pipeline.api import GateResult

    return {r.look: GateResult.from_dict(r.payload) for r in store.gate_records(_key(hid), kind=VERDICT)}


def verdicts(store: Store, hid: int | str) -> list[GateResult]:
    return list(verdicts_by_look(store, hid).values())


def latest_verdict(store: Store, hid: int | str) -> GateResult | None:
    """The gate's record of the hypothesis's last look, or None before any."""
    recs = store.gate_records(_key(hid), kind=VERDICT)
    if not recs:
        return None
    from pipeline.api import GateResult

    return GateResult.from_dict(recs[-1].payload)


def verdict_at(store: Store, hid: int | str, look: int) -> GateResult | None:
    for r in store.gate_records(_key(hid), kind=VERDICT):
        if r.look == look:
            from pipeline.api import GateResult

            return GateResult.from_dict(r.payload)
    return None


def rebases(store: Store, hid: int | str) -> list[dict[str, Any]]:
    """The hypothesis's rebase records (plain dicts: see `agent.graph.rebase`), oldest first."""
    return [r.payload for r in store.gate_records(_key(hid), kind=REBASE)]


def reverify_record(store: Store, hid: int | str) -> dict[str, Any] | None:
    """How a promoted champion held up on fresh seeds (`agent.graph.reverification`), once recorded."""
    recs = store.gate_records(_key(hid), kind=REVERIFY)
    return recs[-1].payload if recs else None


def replicate_record(store: Store, hid: int | str) -> dict[str, Any] | None:
    """The replication of the hypothesis's promotion (`pipeline.gate.replication`), once recorded
    against its current base (a re-based hypothesis's earlier one is moved aside with its verdicts)."""
    recs = store.gate_records(_key(hid), kind=REPLICATE)
    return recs[-1].payload if recs else None
