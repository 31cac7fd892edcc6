"""The LLM ledger: one row per HTTP attempt to the model endpoint, kept for audit and for the budget.

Why a table and not a log file: the daily dollar cap must hold across restarts and across drivers
sharing one store, `status` reports the day's spend, and a reviewer asking "why did the agent do
that?" wants the exact prompt and answer of a hypothesis. So every attempt — answered, rejected,
timed out — is a row with what was sent, what came back, what it cost and how long it took.

The rows also say how fast the server writes (`first_token_s`, `latency_s` and the tokens of each
streamed answer): `rate` learns its tokens per second from the last answers, which the client sizes
`max_tokens` by and `status` shows. A model without a known price costs $0 a row; its use is counted
in tokens (`tokens_since`).

The ledger takes any SQLAlchemy engine; the agent passes the store's (`pipeline.store.Store.engine`,
SQLite in WAL mode or PostgreSQL), so spend and prompts live next to the runs they explain.
Times are UNIX seconds (floats), as in the store.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from sqlalchemy import Column, Text, func
from sqlalchemy.engine import Engine
from sqlmodel import Field, Session, SQLModel, select

from pipeline.api import create_schema


class LLMCall(SQLModel, table=True):
    """One request to the model endpoint and what came of it.

    `request_json` is the exact body sent (model, messages, response_format or tools); `response_text`
    the raw HTTP body received (an error body too), or None when nothing came back (timeout, dropped
    connection). `mode` is how structured output was asked for (json_schema, tool, text) and `attempt`
    counts retries of the same request from 1, so the audit shows rate limits and fallbacks as they
    happened. Tokens come from the response's `usage`, estimated from lengths when a server omits it;
    an answer cut by a timeout counts what arrived. `first_token_s` is how long the first token of a
    streamed answer took (None when nothing streamed), `finish_reason` why the server stopped
    ("length": cut at `max_tokens`).
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
    first_token_s: float | None = None
    finish_reason: str | None = None


# The server's rate is the median of its last few streamed answers long enough to time.
RATE_ANSWERS = 5
RATE_MIN_TOKENS = 32


@dataclass(frozen=True)
class ServerRate:
    """How fast the server answers a model: tokens per second once writing, seconds to the first token."""

    tokens_per_s: float
    first_token_s: float
    answers: int

    def as_dict(self) -> dict[str, float | int]:
        return {"tokens_per_s": round(self.tokens_per_s, 2), "first_token_s": round(self.first_token_s, 2),
                "answers": self.answers}


def utc_day_start(ts: float | None = None) -> float:
    """UNIX time of the UTC midnight that starts the day of `ts` (now by default): the cap's day."""
    day = datetime.fromtimestamp(time.time() if ts is None else ts, tz=timezone.utc).date()
    return datetime(day.year, day.month, day.day, tzinfo=timezone.utc).timestamp()


class Ledger:
    """Records LLM calls in a database and answers what they cost. Safe to share between threads."""

    def __init__(self, engine: Engine):
        self.engine = engine
        # Only our table: the ledger must not depend on which other models happen to be imported.
        create_schema(engine, [LLMCall.__table__])  # adds the columns an older version's table lacks

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

    def tokens_since(self, since: float) -> tuple[int, int]:
        """Prompt and completion tokens of calls made at or after `since`: what a token cap counts."""
        with Session(self.engine) as s:
            prompt, completion = s.exec(select(func.coalesce(func.sum(LLMCall.prompt_tokens), 0),
                                               func.coalesce(func.sum(LLMCall.completion_tokens), 0))
                                        .where(LLMCall.ts >= since)).one()
        return int(prompt), int(completion)

    def cut_short(self, since: float) -> int:
        """Answers since `since` that the server stopped at `max_tokens` (finish_reason "length")."""
        with Session(self.engine) as s:
            n = s.exec(select(func.count()).select_from(LLMCall)
                       .where(LLMCall.ts >= since, LLMCall.finish_reason == "length")).one()
        return int(n)

    def rate(self, model: str, answers: int = RATE_ANSWERS) -> ServerRate | None:
        """The server's rate for `model`, from its last `answers` streamed answers of at least
        RATE_MIN_TOKENS tokens that came whole (the medians); None before there is one."""
        q = (select(LLMCall.completion_tokens, LLMCall.latency_s, LLMCall.first_token_s)
             .where(LLMCall.model == model, LLMCall.first_token_s.is_not(None),  # type: ignore[union-attr]
                    LLMCall.error.is_(None), LLMCall.completion_tokens >= RATE_MIN_TOKENS)  # type: ignore[union-attr]
             .order_by(LLMCall.id.desc()).limit(answers))  # type: ignore[union-attr]
        with Session(self.engine) as s:
            rows = [(tokens, latency, first) for tokens, latency, first in s.exec(q).all()
                    if first is not None and latency > first]
        if not rows:
            return None
        return ServerRate(statistics.median(tokens / (latency - first) for tokens, latency, first in rows),
                          statistics.median(first for _, _, first in rows), len(rows))

    def calls(self, hypothesis_id: str | None = None, purpose: str | None = None) -> list[LLMCall]:
        """Calls in the order they were made; all of them, or those of one hypothesis and/or purpose."""
        q = select(LLMCall)
        if hypothesis_id is not None:
            q = q.where(LLMCall.hypothesis_id == hypothesis_id)
        if purpose is not None:
            q = q.where(LLMCall.purpose == purpose)
        with Session(self.engine) as s:
            return list(s.exec(q.order_by(LLMCall.id)).all())  # type: ignore[arg-type]
