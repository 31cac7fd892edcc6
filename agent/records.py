"""The agent's durable facts, in the same store as the runs: hypotheses, reviews, loop events.

The graph's state carries a hypothesis's lifecycle (agent.graph); its row here is that lifecycle's
projection (`status`, `look`, `verdict`, written by `agent.lifecycle.project` only) beside every
fact a node produced.
The tables are also what `status --json` and `report --json` print.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from enum import Enum
from typing import TYPE_CHECKING, Any, Literal

from sqlalchemy import JSON, Column, Index, String, Text, UniqueConstraint, and_, func, or_
from sqlalchemy.types import TypeDecorator
from sqlmodel import Field, SQLModel, select

from agent import verdicts
from agent.lifecycle import Decision, Review, ReviewAction, Status  # noqa: F401 (re-exported: the column vocabularies)
from agent.verdicts import DECISION, DecisionRecord
from pipeline.api import Store, Verdict, create_schema

if TYPE_CHECKING:
    from agent.verdicts import DecisionRecord
    from pipeline.api import GateResult

Origin = Literal["human", "llm", "offline"]
ACTIVE = tuple(s for s in Status if s.is_active())


def now() -> float:
    return time.time()


class EnumText(TypeDecorator):  # type: ignore[type-arg]
    """A column of plain strings read back as members of a `StrEnum` (`Status`, `Decision`, `Review`, `Verdict`):
    the database keeps the strings it always had (no schema change, no native enum type), and a row
    reads typed. A string this version does not know (a newer database's) is read as it is."""

    impl = String
    cache_ok = True

    def __init__(self, enum: type[Enum], *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.enum = enum

    def process_bind_param(self, value: Any, dialect: Any) -> Any:
        return value.value if isinstance(value, Enum) else value

    def process_result_value(self, value: Any, dialect: Any) -> Any:
        if value is None:
            return None
        try:
            return self.enum(value)
        except ValueError:
            return value


class Hypothesis(SQLModel, table=True):
    """One idea, pre-registered before any run: what it changes and what it expects to move."""

    # `status` counts the rejections by kind and finds the champions from this index alone, without
    # reading a year's rows and their texts (90 MB)
    __table_args__ = (Index("ix_hypothesis_decision_kind", "decision", "reject_kind"),)

    id: int | None = Field(default=None, primary_key=True)
    title: str = ""
    rationale: str = Field(default="", sa_column=Column(Text))
    expected_effect: str = Field(default="", sa_column=Column(Text))
    expected_tasks: list[str] = Field(default_factory=list, sa_column=Column(JSON))
    origin: str = "offline"
    priority: int = 0
    seed_text: str | None = Field(default=None, sa_column=Column(Text))
    seed_branch: str | None = None
    parent_id: int | None = Field(default=None, index=True)
    # what to apply: a list of edit dicts (offline policy, --file seeds) or None (the LLM implements)
    plan: list[dict[str, Any]] | None = Field(default=None, sa_column=Column(JSON))
    change: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))  # search-space values
    direction: list[str] | None = Field(default=None, sa_column=Column(JSON))  # agent.directions, kept once done
    status: Status = Field(default=Status.QUEUED, sa_type=EnumText(Status), index=True)
    branch: str | None = None
    base_commit: str | None = None
    commit: str | None = None
    look: int | None = None  # challenger runs wanted at the current look
    verdict: Verdict | None = Field(default=None, sa_type=EnumText(Verdict))
    decision: Decision | None = Field(default=None, sa_type=EnumText(Decision))
    rationale_decision: str | None = Field(default=None, sa_column=Column(Text))
    follow_up: str | None = Field(default=None, sa_column=Column(Text))
    reject_kind: str | None = None
    reject_reason: str | None = Field(default=None, sa_column=Column(Text))
    promoted_tag: str | None = None
    review: Review = Field(default=Review.NONE, sa_type=EnumText(Review))
    summary_md: str | None = Field(default=None, sa_column=Column(Text))
    summary_author: str | None = None
    created_at: float = Field(default_factory=now)
    updated_at: float = Field(default_factory=now)
    finished_at: float | None = Field(default=None, index=True)


class DecisionRow(SQLModel, table=True):
    """The agent's decision at one look (`agent.verdicts.DecisionRecord` is its typed form), written by
    `decide` before any side effect, so a decide run again after a crash carries out the same one.
    `hypothesis` is the id as text, or `<id>@<old base>` for a comparison a re-base moved aside (the
    gate records' key). Stores written before this table kept these as `gate_record` rows of kind
    `decision`; `Records` moves them here when it opens the store (`_migrate_decisions`)."""

    __tablename__ = "agent_decision"
    __table_args__ = (UniqueConstraint("hypothesis", "look", name="uq_agent_decision_hypothesis_look"),)
    id: int | None = Field(default=None, primary_key=True)
    hypothesis: str = Field(index=True, max_length=80)
    look: int
    decision: Decision = Field(sa_type=EnumText(Decision))
    rationale: str = Field(default="", sa_column=Column(Text))
    follow_up: str = Field(default="", sa_column=Column(Text))
    allowed: list[str] = Field(default_factory=list, sa_column=Column(JSON))
    verdict: Verdict | None = Field(default=None, sa_type=EnumText(Verdict))
    policy: str | None = None
    created_at: float = Field(default_factory=now)


class ReviewComment(SQLModel, table=True):
    """A human's review action on a hypothesis's summary; comments steer the next proposals."""

    __tablename__ = "review_comment"
    id: int | None = Field(default=None, primary_key=True)
    hypothesis_id: int = Field(index=True)
    action: ReviewAction = Field(sa_type=EnumText(ReviewAction))
    text: str = Field(default="", sa_column=Column(Text))
    created_at: float = Field(default_factory=now)


class LoopEvent(SQLModel, table=True):
    """Things the loop wants a human to see in `status`: guards, budget stops, crashes survived."""

    __tablename__ = "loop_event"
    id: int | None = Field(default=None, primary_key=True)
    kind: str = Field(index=True)
    message: str = Field(default="", sa_column=Column(Text))
    created_at: float = Field(default_factory=now)


class Notification(SQLModel, table=True):
    """The notification outbox (`agent.notify`): one row per (event, target), written in the same
    transaction as the event it tells of; a sender claims it (pending → sending), delivers it and marks
    it sent, or puts it back with a back-off until `max_attempts` (→ failed)."""

    __tablename__ = "notify_outbox"
    __table_args__ = (UniqueConstraint("key", "target", name="uq_notify_key_target"),)
    id: int | None = Field(default=None, primary_key=True)
    key: str = Field(index=True)  # the event: "event:<loop_event id>", "hold:<hypothesis>", "digest:<date>", …
    target: str = Field(index=True)
    kind: str
    subject: str = ""
    body: str = Field(default="", sa_column=Column(Text))
    link: str | None = None
    state: str = Field(default="pending", index=True)  # pending | sending | sent | failed
    attempts: int = 0
    next_at: float = Field(default_factory=now)
    claimed_at: float | None = None
    sent_at: float | None = None
    last_error: str | None = Field(default=None, sa_column=Column(Text))
    created_at: float = Field(default_factory=now)


class NotifyTargetState(SQLModel, table=True):
    """How each notification target fares, for `status` (no secret: the URL's host only)."""

    __tablename__ = "notify_target"
    target: str = Field(primary_key=True)
    kind: str = ""
    where: str = ""
    fails_in_row: int = 0
    failing_since: float | None = None
    last_error: str | None = Field(default=None, sa_column=Column(Text))
    last_ok_at: float | None = None
    dead: bool = False


AGENT_TABLES = [Hypothesis.__table__, DecisionRow.__table__, ReviewComment.__table__, LoopEvent.__table__, Notification.__table__,
                NotifyTargetState.__table__]


class Records:
    """Typed access to the agent's tables on a `Store`.

    `outbox` (an `agent.notify.Outbox`, set by the loop when notifications are configured) sees each
    loop event and each hypothesis update inside its transaction and adds the notifications it
    calls for there, so an event and its notifications are committed together or not at all."""

    def __init__(self, store: Store):
        self.store = store
        self.outbox: Any = None
        create_schema(store.engine, AGENT_TABLES)
        self._migrate_decisions()

    def get(self, hid: int) -> Hypothesis:
        with self.store.session() as s:
            h = s.get(Hypothesis, hid)
        if h is None:
            from pipeline.api import UserError

            raise UserError(f"no hypothesis {hid}")
        return h

    def add(self, h: Hypothesis) -> Hypothesis:
        with self.store.session() as s:
            s.add(h)
            s.commit()
            s.refresh(h)
            return h

    def update(self, hid: int, **fields: Any) -> Hypothesis:
        with self.store.session() as s:
            h = s.get(Hypothesis, hid)
            before = {k: getattr(h, k) for k in ("status", "decision", "promoted_tag", "review")}
            for k, v in fields.items():  # a `Status` or `Decision` is stored as its plain string
                setattr(h, k, v.value if isinstance(v, Enum) else v)
            h.updated_at = now()
            s.add(h)
            staged = self.outbox is not None and self.outbox.on_update(s, before, h)
            s.commit()
            s.refresh(h)
        if staged:
            self.outbox.wake()
        return h

    # the gate records of a hypothesis, typed (agent/verdicts.py) ----------------------------
    def verdicts(self, hid: int) -> list[GateResult]:

        return verdicts.verdicts(self.store, hid)

    def latest_verdict(self, hid: int) -> GateResult | None:

        return verdicts.latest_verdict(self.store, hid)

    def verdict_at(self, hid: int, look: int) -> GateResult | None:

        return verdicts.verdict_at(self.store, hid, look)

    # the agent's decisions (its own table) ------------------------------------------------
    def decisions(self, hid: int | str) -> list[DecisionRecord]:
        """The hypothesis's decisions in look order (`hid` may be an archived key, `<id>@<base>`)."""

        with self.store.session() as s:
            rows = s.exec(select(DecisionRow).where(DecisionRow.hypothesis == str(hid)).order_by(DecisionRow.look))
            return [DecisionRecord.from_row(r) for r in rows]

    def decision_at(self, hid: int | str, look: int | None) -> DecisionRecord | None:
        return next((d for d in self.decisions(hid) if d.look == look), None)

    def put_decision(self, hid: int | str, rec: DecisionRecord) -> None:
        """Store (or replace) the decision at `rec.look`: idempotent for a decide that runs again."""
        from sqlalchemy.exc import IntegrityError

        with self.store.session() as s:
            row = s.exec(select(DecisionRow).where(DecisionRow.hypothesis == str(hid),
                                                   DecisionRow.look == rec.look)).first()
            row = row or DecisionRow(hypothesis=str(hid), look=rec.look, decision="")
            for k, v in rec.to_dict().items():
                setattr(row, k, v)
            row.created_at = now()
            s.add(row)
            try:
                s.commit()
            except IntegrityError:  # a concurrent writer inserted it first: replace theirs
                s.rollback()
                return self.put_decision(hid, rec)

    def archive_decisions(self, hid: int, to: str) -> int:
        """Move the hypothesis's decisions to the key `to` (a re-based comparison kept aside, beside
        its verdicts: `Store.move_gate_records`), replacing any there; idempotent. How many moved."""
        from pipeline.api import rekey

        with self.store.session() as s:
            rows = list(s.exec(select(DecisionRow).where(DecisionRow.hypothesis == str(hid))))
            return rekey(s, DecisionRow, rows, to, ("look",))

    def _migrate_decisions(self) -> None:
        """A store written before the agent had its own decision table kept its decisions as gate
        records of kind `decision`: moved here in one transaction (copied, then deleted), so nothing
        is lost and nothing is read from two places. Idempotent; one query when there is nothing to
        move; two processes opening the store at once: the second finds the rows gone or the
        constraint taken, and leaves it to the first."""
        from sqlalchemy.exc import IntegrityError

        from pipeline.api import GateRecord

        with self.store.session() as s:
            old = list(s.exec(select(GateRecord).where(GateRecord.kind == DECISION)))
            if not old:
                return
            for g in old:
                d = DecisionRecord.from_dict(g.look, g.payload or {})
                have = s.exec(select(DecisionRow).where(DecisionRow.hypothesis == g.hypothesis,
                                                        DecisionRow.look == g.look)).first()
                if have is None:
                    s.add(DecisionRow(hypothesis=g.hypothesis, look=g.look, created_at=g.created_at, **d.to_dict()))
                s.delete(g)
            try:
                s.commit()
            except IntegrityError:
                s.rollback()

    def decide_review(self, hid: int, review: Review) -> bool:
        """Set the review to `review` only if none was given yet (an approve from the page and a
        reject from the CLI at the same moment: exactly one wins). False if another answer was first."""
        from sqlalchemy import update

        with self.store.session() as s:
            res = s.exec(update(Hypothesis).where(  # type: ignore[call-overload]
                Hypothesis.id == hid, Hypothesis.review.in_((Review.PENDING, Review.NONE))).values(  # type: ignore[attr-defined]
                review=review, updated_at=now()))
            s.commit()
            return res.rowcount == 1

    def ask_review(self, hid: int) -> Hypothesis:
        """A held hypothesis's reviewer is asked now (its review turns pending, the hold notification
        is staged), unless a human answered first: a conditional UPDATE, as `decide_review`, so an
        approval or a reject given meanwhile is never overwritten."""
        from sqlalchemy import update

        staged = False
        with self.store.session() as s:
            res = s.exec(update(Hypothesis).where(  # type: ignore[call-overload]
                Hypothesis.id == hid, Hypothesis.review == Review.NONE).values(  # type: ignore[arg-type]
                review=Review.PENDING, updated_at=now()))
            if res.rowcount == 1 and self.outbox is not None:
                h = s.get(Hypothesis, hid)
                s.refresh(h)
                before = {"status": h.status, "decision": h.decision, "promoted_tag": h.promoted_tag,
                          "review": Review.NONE}
                staged = self.outbox.on_update(s, before, h)
            s.commit()
        if staged:
            self.outbox.wake()
        return self.get(hid)

    def delete(self, hid: int) -> None:
        """Withdraw a hypothesis that never was one (a proposal the LLM could not give)."""
        with self.store.session() as s:
            h = s.get(Hypothesis, hid)
            if h is not None:
                s.delete(h)
                s.commit()

    def all(self, statuses: tuple[Status, ...] | None = None, since: float | None = None) -> list[Hypothesis]:
        with self.store.session() as s:
            q = select(Hypothesis).order_by(Hypothesis.id)
            if statuses:
                q = q.where(Hypothesis.status.in_(statuses))
            if since is not None:
                q = q.where(Hypothesis.updated_at >= since)
            return list(s.exec(q))

    BRIEF = ("id", "title", "origin", "status", "look", "verdict", "decision", "reject_kind", "change",
             "base_commit", "commit", "promoted_tag", "review", "direction", "finished_at", "updated_at", "parent_id")

    def briefs(self) -> list[Any]:
        """Every hypothesis's id, title, origin, status, look, verdict, decision, reject kind, change,
        commits, tag, review, direction, finish and update times and parent, in id order, without its
        texts (a context reads this at every decision, the chart at every call: a year is 20,000 rows)."""
        with self.store.session() as s:
            return list(s.exec(self._brief_query().order_by(Hypothesis.id)).all())

    def _brief_query(self) -> Any:
        return select(*(getattr(Hypothesis, c) for c in self.BRIEF))

    def latest_briefs(self, n: int) -> list[Any]:
        """The briefs (`briefs`) of the latest `n` hypotheses, in id order."""
        with self.store.session() as s:
            return list(s.exec(self._brief_query().order_by(Hypothesis.id.desc()).limit(n)).all())[::-1]

    def briefs_of(self, ids: list[int]) -> list[Any]:
        """The briefs of the hypotheses `ids` (those that exist), in id order."""
        if not ids:
            return []
        with self.store.session() as s:
            return list(s.exec(self._brief_query().where(Hypothesis.id.in_(ids)).order_by(Hypothesis.id)).all())

    def page_briefs(self, status: str | None = None, decision: str | None = None, review: str | None = None,
                    offset: int = 0, limit: int = 200) -> tuple[list[Any], int]:
        """One page of the briefs matching the filters, newest first, and how many match in all (the
        review page's list: a year's 20,000 rows were one page of several MB)."""
        conds = [c for c in (Hypothesis.status == status if status else None,
                             Hypothesis.decision == decision if decision else None,
                             Hypothesis.review == review if review else None) if c is not None]
        with self.store.session() as s:
            total = int(s.exec(select(func.count()).select_from(Hypothesis).where(*conds)).one())
            rows = list(s.exec(self._brief_query().where(*conds).order_by(Hypothesis.id.desc())
                               .offset(max(offset, 0)).limit(limit)).all())
        return rows, total

    def champion_briefs(self) -> list[Any]:
        """The briefs `agent.progress.champions` reads: the first hypothesis with a base commit (the
        first baseline) and every promoted one, in id order; from an index, not a year's rows."""
        with self.store.session() as s:
            first = s.exec(self._brief_query().where(Hypothesis.base_commit.is_not(None))
                           .order_by(Hypothesis.id).limit(1)).all()
            promoted = s.exec(self._brief_query().where(Hypothesis.decision == Decision.PROMOTE)
                              .order_by(Hypothesis.id)).all()
        return sorted({h.id: h for h in [*first, *promoted]}.values(), key=lambda h: h.id)

    def tally(self) -> dict[str, Any]:
        """How many hypotheses there are, by status; the rejected ones by kind; the ids in flight
        (`status` at a year: from the indexes on status and decision, not 20,000 rows)."""
        with self.store.session() as s:
            by_status = {str(st): int(n) for st, n in s.exec(
                select(Hypothesis.status, func.count()).group_by(Hypothesis.status)).all()}
            rejected: dict[str, int] = {}
            for k, n in s.exec(select(Hypothesis.reject_kind, func.count())
                               .where(Hypothesis.decision == Decision.REJECT).group_by(Hypothesis.reject_kind)).all():
                rejected[k or "?"] = rejected.get(k or "?", 0) + int(n)
            flying = list(s.exec(select(Hypothesis.id).where(Hypothesis.status.in_(ACTIVE)).order_by(Hypothesis.id)))
        return {"total": sum(by_status.values()), "by_status": by_status,
                "rejected": dict(sorted(rejected.items())), "in_flight": flying}

    def keep_directions(self, found: dict[int, list[str]]) -> None:
        """Record the directions of finished hypotheses (`agent.directions`: found once, not per call)."""
        if not found:
            return
        with self.store.session() as s:
            for hid, parts in found.items():
                h = s.get(Hypothesis, hid)
                if h is not None:
                    h.direction = parts
                    s.add(h)
            s.commit()

    def done_newest_first(self, page: int = 200) -> Iterator[Any]:
        """The finished hypotheses (done, with a finish time), newest first, without their texts
        (id, finished_at, decision, reject_kind, verdict, promoted_tag), read a page at a time: the
        loop's streak counts read back only as far as their streak goes, not months of history."""
        cols = (Hypothesis.id, Hypothesis.finished_at, Hypothesis.decision, Hypothesis.reject_kind,
                Hypothesis.verdict, Hypothesis.promoted_tag)
        after: tuple[float, int] | None = None  # the last row read: the next page starts below it
        while True:  # by key, not OFFSET: one finishing between two pages must not shift them
            q = select(*cols).where(Hypothesis.status == Status.DONE, Hypothesis.finished_at.is_not(None))  # type: ignore[union-attr]
            if after is not None:
                q = q.where(or_(Hypothesis.finished_at < after[0],
                                and_(Hypothesis.finished_at == after[0], Hypothesis.id < after[1])))  # type: ignore[arg-type,operator]
            with self.store.session() as s:
                rows = s.exec(q.order_by(Hypothesis.finished_at.desc(), Hypothesis.id.desc())  # type: ignore[union-attr]
                              .limit(page)).all()
            yield from rows
            if len(rows) < page:
                return
            after = (rows[-1].finished_at, rows[-1].id)

    def children(self, hid: int) -> list[Hypothesis]:
        """The hypotheses that refine `hid` (its `refine` decision's follow-ups), oldest first."""
        with self.store.session() as s:
            return list(s.exec(select(Hypothesis).where(Hypothesis.parent_id == hid).order_by(Hypothesis.id)))

    def exhausted(self, origin: str, base: str) -> bool:
        """Whether `origin`'s policy said it had nothing untried around the baseline `base` (a done
        hypothesis rejected as `exhausted`): one indexed question, not a read of every hypothesis."""
        with self.store.session() as s:
            q = select(Hypothesis.id).where(Hypothesis.status == Status.DONE, Hypothesis.reject_kind == "exhausted",
                                            Hypothesis.origin == origin, Hypothesis.base_commit == base).limit(1)
            return s.exec(q).first() is not None

    def since_promotion(self) -> int:
        """Measured hypotheses decided in a row since the last promotion (rejections before any run
        do not count: they measured nothing)."""
        n = 0
        for h in self.done_newest_first():
            if h.promoted_tag:
                break
            if h.verdict is not None:
                n += 1
        return n

    def next_queued(self) -> Hypothesis | None:
        """Human seeds first, by priority, then oldest."""
        with self.store.session() as s:
            q = (select(Hypothesis).where(Hypothesis.status == Status.QUEUED)
                 .order_by(Hypothesis.priority.desc(), Hypothesis.id))
            return s.exec(q).first()

    def comment(self, hid: int, action: ReviewAction, text: str = "") -> ReviewComment:
        with self.store.session() as s:
            c = ReviewComment(hypothesis_id=hid, action=action, text=text)
            s.add(c)
            s.commit()
            s.refresh(c)
            return c

    def comments(self, hid: int | None = None, limit: int = 20) -> list[ReviewComment]:
        with self.store.session() as s:
            q = select(ReviewComment).order_by(ReviewComment.id.desc()).limit(limit)
            if hid is not None:
                q = q.where(ReviewComment.hypothesis_id == hid)
            return list(s.exec(q))

    def event(self, kind: str, message: str) -> None:
        with self.store.session() as s:
            ev = LoopEvent(kind=kind, message=message)
            s.add(ev)
            staged = False
            if self.outbox is not None:
                s.flush()  # its id keys the notifications
                staged = self.outbox.on_event(s, ev)
            s.commit()
        if staged:
            self.outbox.wake()

    def last_event(self, kinds: tuple[str, ...]) -> LoopEvent | None:
        with self.store.session() as s:
            q = select(LoopEvent).where(LoopEvent.kind.in_(kinds)).order_by(LoopEvent.id.desc()).limit(1)
            return s.exec(q).first()

    def events(self, limit: int = 10, since: float | None = None) -> list[LoopEvent]:
        with self.store.session() as s:
            q = select(LoopEvent).order_by(LoopEvent.id.desc()).limit(limit)
            if since is not None:
                q = q.where(LoopEvent.created_at >= since)
            return list(s.exec(q))
