"""What the loop says: a hypothesis's step in one line, and where each look in flight stands."""

from __future__ import annotations

from typing import Any

from agent.lifecycle import Decision, Review, Status
from agent.records import Hypothesis
from agent.verdicts import replicate_record
from pipeline.api import RunStatus, Verdict


class Reporting:
    """`Loop`'s messages."""

    def report(self, h: Hypothesis) -> None:
        if h.status == Status.MEASURING:
            why = f"verdict escalate{self._evidence(h)}; " if h.verdict == Verdict.escalate else ""
            if h.verdict is None and (h.rationale_decision or "").startswith("Re-based"):  # graph.rebase
                why = f"{h.rationale_decision.removesuffix('.')}; "
            self.say(f"#{h.id} {h.title!r}: {why}measuring, look of {h.look} challenger runs on "
                     f"{len(self.lab.tasks())} tasks")
            if (self.waits_for(h) or {}).get("noise_study"):
                self.say(f"#{h.id}: the lab's first comparison waits for its noise study, "
                         f"{self.lab.config.gate.noise_runs} baseline runs per task ([gate] noise_runs)")
        elif h.status == Status.DONE and h.decision == Decision.REJECT:
            self.say(f"#{h.id} {h.title!r}: rejected ({h.reject_kind}): {h.reject_reason}")
        elif h.status in (Status.PROMOTING, Status.HELD) and (self.waits_for(h) or {}).get("replication"):
            held = " (held for review: the reviewer is asked once it replicates)" if h.status == Status.HELD else ""
            self.say(f"#{h.id} {h.title!r}: verdict {h.verdict}{self._evidence(h)}; its promotion{held} waits for its "
                     f"replication, {self.lab.config.gate.replicate_runs} fresh seeds per task of both arms "
                     "([gate] replicate_runs)")
        elif h.status in (Status.DONE, Status.HELD):
            extra = f" → {h.promoted_tag}" if h.promoted_tag else ""
            rep = replicate_record(self.store, h.id)
            extra += f"; {rep['reason']}" if rep else ""
            if h.status == Status.HELD and h.review == Review.PENDING:
                extra += f"; awaits review (autoresearch review {h.id} --approve / --reject)"
            self.say(f"#{h.id} {h.title!r}: verdict {h.verdict}{self._evidence(h)}, decision {h.decision}{extra}")

    def _evidence(self, h: Hypothesis) -> str:
        """` at look N (horizontal Δ +0.42σ, t 1.3 vs boundary 2.9)` from the gate's last record."""
        g = self.records.latest_verdict(h.id)
        if g is None:
            return ""
        hz = g.horizontal
        if hz.delta is None or hz.t is None:
            return f" at look {g.look}"
        bound = f" vs boundary {hz.boundary:.2f}" if hz.boundary is not None else ""
        sep = ", " if g.higher_is_better else ", + = better; "  # the horizontal Δ is oriented
        return f" at look {g.look} (horizontal Δ {hz.delta:+.2f}σ{sep}t {hz.t:.2f}{bound})"

    @staticmethod
    def _row(h: Hypothesis) -> dict[str, Any]:
        return {"id": h.id, "title": h.title, "status": h.status, "look": h.look, "verdict": h.verdict,
                "decision": h.decision, "promoted_tag": h.promoted_tag}

    def _look_state(self, runs: dict[int, list[Any]], slots: int) -> dict[int, dict[str, Any]]:
        """Per hypothesis waiting for a look: runs done, running and planned, and an ETA from the
        wall time of the look's finished runs (the slots working in parallel)."""
        out = {}
        for hid, rs in runs.items():
            done = [r for r in rs if RunStatus(r.status).is_finished()]
            walls = [r.finished_at - r.started_at for r in done if r.finished_at and r.started_at]
            left = len(rs) - len(done)
            eta = left * (sum(walls) / len(walls)) / max(1, slots) if walls else None
            h = self.records.get(hid)
            out[hid] = {"title": h.title, "look": h.look, "done": len(done), "total": len(rs),
                        "running": sum(r.status == RunStatus.RUNNING for r in rs), "eta_s": eta}
        return out
