"""The vocabularies of a hypothesis's lifecycle: its `Status`, the `Decision` made about it, and its
human `Review`.

`StrEnum`s, so a member is its stored string: the `hypothesis` columns and the `agent_decision`
rows keep the strings they always had, and an old database reads the same. Standard library only
(cheap to import from the CLI and the policies); `agent.records` re-exports both.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class Status(StrEnum):
    """`Hypothesis.status`. The column keeps these strings (a `StrEnum` member is its string).

    queued → proposing → implementing → measuring → deciding → (promoting →) summarizing → done;
    held: a promotion waits for a human approval. A rejected hypothesis ends `done` too."""

    QUEUED = "queued"
    PROPOSING = "proposing"
    IMPLEMENTING = "implementing"
    MEASURING = "measuring"
    DECIDING = "deciding"
    PROMOTING = "promoting"
    SUMMARIZING = "summarizing"
    HELD = "held"
    DONE = "done"

    def is_finished(self) -> bool:
        """Nothing more happens to it (`held` is not: an approval may still promote it)."""
        return self is Status.DONE

    def is_active(self) -> bool:
        """A thread is working on it (not waiting in the queue, for a human, or finished)."""
        return self not in (Status.QUEUED, Status.HELD, Status.DONE)


class Review(StrEnum):
    """`Hypothesis.review`: whether a human has read its summary, and what they answered."""

    NONE = "none"  # not asked yet (a hypothesis in flight)
    PENDING = "pending"  # its summary (or a held promotion) waits for a human
    APPROVED = "approved"
    REJECTED = "rejected"

    def is_open(self) -> bool:
        """A human may still answer (`review --approve/--reject`, the page's buttons)."""
        return self in (Review.NONE, Review.PENDING)


class ReviewAction(StrEnum):
    """What a human did on a summary (`review_comment.action`)."""

    APPROVE = "approve"
    REJECT = "reject"
    COMMENT = "comment"


class Decision(StrEnum):
    """What was decided about a hypothesis (`Hypothesis.decision`, `agent_decision` rows).

    The gate bounds the first four (`agent.graph.allowed_decisions`); `hold` is a promotion waiting
    for a human; `reject` is an implementation refused before any run. Stored as these strings."""

    PROMOTE = "promote"
    HOLD = "hold"
    ESCALATE = "escalate"
    ABANDON = "abandon"
    REFINE = "refine"
    REJECT = "reject"

    @classmethod
    def parse(cls, value: str) -> "Decision | str":
        """The member for a stored string; a string this version does not know (an old or newer
        database's) is returned as it is, never raised: it matches no allowed decision."""
        try:
            return cls(value)
        except ValueError:
            return value


# what a thread carries through its graph (agent.graph.State): where it is, and the look and verdict
LIFECYCLE_KEYS = ("phase", "look", "verdict")


def project(records: Any, hid: int, update: dict[str, Any], **fields: Any) -> Any:
    """The one writer of a hypothesis's `status`: the graph's state update (`phase`, and `look` or
    `verdict` where it changes them) projected onto its row, with the facts the step produced
    (`fields`), in one write. The row is what `status`, `report`, the web page and the loop read;
    the graph's state is what the graph routes on. `records` is an `agent.records.Records`."""
    cols = {k: update[k] for k in ("look", "verdict") if k in update}
    return records.update(hid, status=Status(update["phase"]), **cols, **fields)
