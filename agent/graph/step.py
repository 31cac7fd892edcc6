"""What every node shares: where its thread is (`phase_of`, `verdict_of`) and how it says where the
thread goes (`Step._to`, which projects the step onto the hypothesis's row in the same write)."""

from __future__ import annotations

from typing import Any

from agent.graph.state import Services, State
from agent.lifecycle import Decision, Status, project
from agent.records import Hypothesis
from pipeline.api import Verdict

KEEP: Any = object()  # `Step._to`: leave the look or the verdict as it is


def phase_of(state: State, h: Hypothesis) -> Status:
    """Where the thread is: its state's phase; for a thread checkpointed by a version before the
    phase was in the state (or a node called alone, as tests do), the row's status."""
    return Status(state.get("phase") or h.status)


def verdict_of(state: State, h: Hypothesis) -> Verdict | None:
    """The gate's verdict at the thread's last look (the state's; else the row's), or None."""
    v = state["verdict"] if "verdict" in state else h.verdict
    return Verdict(v) if v else None


class Step:
    """A node's common part: the services, and the one way to move a thread (`_to`)."""

    def __init__(self, svc: Services):
        self.svc = svc

    def _to(self, h: Hypothesis, phase: Status, *, look: Any = KEEP, verdict: Any = KEEP, **fields: Any) -> State:
        """The state's update for entering `phase` (with a new look or verdict), and its projection
        onto the row with `fields` (`agent.lifecycle.project`, the one writer of `status`)."""
        update: State = {"phase": phase}
        if look is not KEEP:
            update["look"] = look
        if verdict is not KEEP:
            update["verdict"] = Verdict(verdict) if verdict else None
        project(self.svc.records, h.id, dict(update), **fields)
        return update

    def _reject(self, h: Hypothesis, kind: str, reason: str, **fields: Any) -> State:
        """Refused before any run: summarized, with the kind and the reason."""
        return self._to(h, Status.SUMMARIZING, decision=Decision.REJECT, reject_kind=kind, reject_reason=reason,
                        **fields)

    def _measuring(self, h: Hypothesis, branch: str, base: str, commit: str) -> State:
        """Committed and tagged: measured from the first look."""
        return self._to(h, Status.MEASURING, look=self.svc.lab.config.gate.looks[0], branch=branch,
                        base_commit=base, commit=commit)
