"""The LLM ledger: one row per HTTP attempt to the model endpoint, kept for audit and for the budget.

Why a table and not a log file: the daily dollar cap must hold across restarts and across drivers
sharing one store, `status` reports the day's spend, and a reviewer asking "why did the agent do
that?" wants the exact prompt and answer of a hypothesis. So every attempt — answered, rejected,
timed out — is a row with what was sent, what came back, what it cost and how long it took.

The ledger takes any SQLAlchemy engine; the agent passes the store's (`pipeline.store.Store.engine`,
SQLite in WAL mode or PostgreSQL), so spend and prompts live next to the runs they explain.
Times are UNIX seconds (floats), as in the store.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone

from sqlalchemy import Column, Text, func
from sqlalchemy.engine import Engine
from sqlmodel import Field, Session, SQLModel, select

from pipeline.store import create_schema


class LLMCall(SQLModel, table=True):
    """One request to the model endpoint and what came of it.

    `request_json` is the exact body sent (model, messages, response_format or tools); `response_text`
    the raw HTTP body received (an error body too), or None when nothing came back (timeout, dropped
    connection). `mode` is how structured output was asked for (json_schema, tool, text) and `attempt`
    counts retries of the same request from 1, so the audit shows rate limits and fallbacks as they
    happened. Tokens come from the response's `usage`, estimated from lengths when a server omits it.
    """

    __tablename__ = "llm_call"
    id: int | None = Field(default=None, primary_key=True)
    ts: float = Field(default_factory=time.time, index=True)
    purpose: str = Field(index=True)
    hypothesis_id: str | None = Field(default=None, index=True)
    model: str
    mode: str = "json_schema"
    attempt: int = 1
    request_json: str = Field(sa_column=Column(Text, nullable=False))
    response_text: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    status_code: int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    usd: float = 0.0
    latency_s: float = 0.0
    error: str | None = Field(default=None, sa_column=Column(Text, nullable=True))


def utc_day_start(ts: float | None = None) -> float:
    """UNIX time of the UTC midnight that starts the day of `ts` (now by default): the cap's day."""
    day = datetime.fromtimestamp(time.time() if ts is None else ts, tz=timezone.utc).date()
    return datetime(day.year, day.month, day.day, tzinfo=timezone.utc).timestamp()


class Ledger:
    """Records LLM calls in a database and answers what they cost. Safe to share between threads."""

    def __init__(self, engine: Engine):
        self.engine = engine
        # Only our table: the ledger must not depend on which other models happen to be imported.
        create_schema(engine, [LLMCall.__table__])

    def record(self, call: LLMCall) -> LLMCall:
        """Insert one call and return it with its id."""
        with Session(self.engine, expire_on_commit=False) as s:
            s.add(call)
            s.commit()
            s.refresh(call)
        return call

    def spent_usd(self, since: float) -> float:
        """Dollars spent by calls made at or after `since` (UNIX seconds)."""
        with Session(self.engine) as s:
            total = s.exec(select(func.coalesce(func.sum(LLMCall.usd), 0.0)).where(LLMCall.ts >= since)).one()
        return float(total)

    def spent_today(self, now: float | None = None) -> float:
        """Dollars spent since the current UTC midnight: what the daily cap is checked against."""
        return self.spent_usd(utc_day_start(now))

    def calls(self, hypothesis_id: str | None = None, purpose: str | None = None) -> list[LLMCall]:
        """Calls in the order they were made; all of them, or those of one hypothesis and/or purpose."""
        q = select(LLMCall)
        if hypothesis_id is not None:
            q = q.where(LLMCall.hypothesis_id == hypothesis_id)
        if purpose is not None:
            q = q.where(LLMCall.purpose == purpose)
        with Session(self.engine) as s:
            return list(s.exec(q.order_by(LLMCall.id)).all())  # type: ignore[arg-type]
