"""Streamed answers from a slow server: the real openai SDK against a real HTTP server that writes
server-sent events at a set rate (tests/support/fake_openai.py), and the ledger in a real SQLite file.

The scale is a hundredth of the case that motivated it (a local server writing 2000 tokens at 10
tokens/s, 200 s, against a 120 s per-request timeout): 200 tokens at 100 tokens/s, 2 s, against 1.2 s.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from support.fake_openai import FakeOpenAI, content, stall

from agent.ledger import Ledger, LLMCall
from agent.llm import LLMClient, LLMUnavailable
from pipeline.store import Store

pytestmark = pytest.mark.integration

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"title": {"type": "string", "minLength": 1},
                   "tasks_expected": {"type": "array", "items": {"type": "string"}}},
    "required": ["title", "tasks_expected"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Propose one hypothesis."}]
OLD_TIMEOUT_S = 1.2  # the old per-request timeout, at this scale (120 s)
RATE = 100.0  # tokens per second (10)
TOKENS = 200  # the answer's length (2000)


def long_answer(n_tokens: int = TOKENS) -> dict[str, Any]:
    """A valid answer of exactly `n_tokens` streamed tokens (four characters each)."""
    skeleton = json.dumps({"title": "", "tasks_expected": []})
    return {"title": "t" * (4 * n_tokens - len(skeleton)), "tasks_expected": []}


@pytest.fixture
def ledger(tmp_path: Path) -> Ledger:
    return Ledger(Store(f"sqlite:///{tmp_path / 'store.db'}").engine)


def client_for(server: FakeOpenAI, ledger: Ledger, **kw: Any) -> LLMClient:
    kw.setdefault("backoff_s", 0.001)
    return LLMClient(kw.pop("model", "gpt-4.1-mini"), ledger, **server.client_kwargs(), sleep=lambda _s: None, **kw)


def ask(client: LLMClient, purpose: str = "propose") -> dict[str, Any]:
    return client.complete_json(purpose, MESSAGES, SCHEMA, "hypothesis")


def test_a_slow_server_still_writing_is_not_cut_off_and_answers_once(fake_openai: FakeOpenAI, ledger: Ledger,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    answer = long_answer()
    fake_openai.script(content(answer, rate=RATE), content(long_answer(40)))
    client = client_for(fake_openai, ledger, idle_timeout_s=OLD_TIMEOUT_S, timeout_s=10)

    assert ask(client) == answer
    (req,) = fake_openai.requests  # one request: nothing asked twice
    assert req["stream"] is True and req["stream_options"] == {"include_usage": True}
    (row,) = ledger.calls()
    assert row.latency_s > (TOKENS - 1) / RATE > OLD_TIMEOUT_S  # longer than the old timeout allowed
    assert row.completion_tokens == TOKENS and row.finish_reason == "stop" and row.error is None
    assert json.loads(row.response_text or "")["choices"][0]["message"]["content"] == json.dumps(answer)
    assert row.first_token_s is not None and row.first_token_s < OLD_TIMEOUT_S

    # the server's rate is learned from that answer, and the next answers are bounded to fit the cap
    rate = client.server_rate()
    # about the server's pace (slower where this machine is loaded: no timed bound but the pace's)
    assert rate is not None and 0.3 * RATE < rate.tokens_per_s < 1.1 * RATE
    with caplog.at_level(logging.WARNING, logger="autoresearch.llm"):
        assert ask(client, "decide") == long_answer(40)  # the loop goes on
    bound = fake_openai.requests[-1]["max_tokens"]
    assert bound == int(0.8 * rate.tokens_per_s * (10 - rate.first_token_s))  # FIT_SHARE of what 10 s hold, not 1000
    assert [r.message for r in caplog.records] == [
        f"decide: answers bounded to {bound} tokens, not 1000: the server writes {rate.tokens_per_s:.1f} tokens/s "
        "and [agent] request_timeout_s is 10 s"]


def test_a_server_that_does_not_stream_and_is_slow_is_one_clear_error(ledger: Ledger) -> None:
    with FakeOpenAI([stall(3 * OLD_TIMEOUT_S, then=content(long_answer())), content(long_answer(10))],
                    streams=False) as server:
        client = client_for(server, ledger, idle_timeout_s=OLD_TIMEOUT_S, timeout_s=10, max_attempts=6)
        with pytest.raises(LLMUnavailable) as exc:
            ask(client)
        assert len(server.requests) == 1  # not six silent retries
        assert str(exc.value) == ("propose: LLM endpoint failed 1 attempt(s); last error: no token for 1.2 s "
                                  "([agent] idle_timeout_s = 1.2); a server that does not stream sends nothing "
                                  "until its whole answer is written")
        assert ask(client) == long_answer(10)  # answered whole, in time: read as one completion
    assert ledger.calls()[-1].first_token_s is None and ledger.calls()[-1].completion_tokens == 10


def test_a_stream_stalling_midway_is_cut_by_the_idle_timeout_and_counted_once(fake_openai: FakeOpenAI,
                                                                             ledger: Ledger) -> None:
    fake_openai.script(content(long_answer(), rate=1000, stall_after=50, stall_s=5), content(long_answer(30)))
    client = client_for(fake_openai, ledger, idle_timeout_s=0.5, timeout_s=10)

    cut_off = r"no token for 0.5 s after 50 token\(s\) \(\[agent\] idle_timeout_s = 0.5\)$"
    with pytest.raises(LLMUnavailable, match=cut_off):
        ask(client)
    assert ask(client) == long_answer(30)  # asked again (as the loop does after its back-off): a new request
    assert len(fake_openai.requests) == 2
    cut, whole = ledger.calls()
    assert (cut.completion_tokens, cut.finish_reason) == (50, None) and cut.prompt_tokens > 0
    assert cut.usd == pytest.approx((cut.prompt_tokens * 0.40 + 50 * 1.60) / 1e6)  # what arrived, once
    assert whole.completion_tokens == 30
    assert ledger.tokens_since(0) == (cut.prompt_tokens + whole.prompt_tokens, 80)
    assert client.server_rate() is None  # a cut answer says nothing of the rate; 30 tokens are too few


def test_an_answer_past_the_total_cap_is_cut_naming_request_timeout_s(fake_openai: FakeOpenAI, ledger: Ledger) -> None:
    fake_openai.script(content(long_answer(), rate=RATE))
    client = client_for(fake_openai, ledger, idle_timeout_s=0.5, timeout_s=1)

    with pytest.raises(LLMUnavailable, match=r"the answer took longer than \[agent\] request_timeout_s = 1 s"):
        ask(client)
    (row,) = ledger.calls()
    assert len(fake_openai.requests) == 1 and 0 < row.completion_tokens < TOKENS


def test_a_server_refusing_stream_options_is_asked_without_them_and_tokens_are_counted(ledger: Ledger) -> None:
    with FakeOpenAI([content(long_answer(60)), content(long_answer(60))], supports_stream_options=False) as server:
        client = client_for(server, ledger)
        assert ask(client) == long_answer(60)
        assert ask(client) == long_answer(60)
    refused, first, second = server.requests
    assert "stream_options" in refused and "stream_options" not in first and "stream_options" not in second
    rows = ledger.calls()
    assert [r.status_code for r in rows] == [400, 200, 200]
    assert [r.completion_tokens for r in rows[1:]] == [60, 60]  # no usage chunk: one streamed token each
    assert all(r.prompt_tokens > 0 for r in rows[1:])


def test_an_answer_cut_at_its_bound_is_said_in_one_line(fake_openai: FakeOpenAI, ledger: Ledger,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    fake_openai.script(content('{"title": "cut sho', finish="length"), content(long_answer(10)))
    client = client_for(fake_openai, ledger, max_output_tokens={"propose": 300})
    with caplog.at_level(logging.WARNING, logger="autoresearch.llm"):
        assert ask(client) == long_answer(10)  # the repair round's answer
    assert [r.message for r in caplog.records] == [
        'propose: the answer was cut at max_tokens = 300 (finish_reason "length"); '
        "[agent.max_output_tokens] propose raises it"]
    assert [r.finish_reason for r in ledger.calls()] == ["length", "stop"] and ledger.cut_short(0) == 1


def test_a_ledger_written_before_the_rate_columns_gets_them(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'old.db'}")
    with engine.begin() as conn:  # the llm_call table as it was
        conn.execute(text(
            "CREATE TABLE llm_call (id INTEGER PRIMARY KEY, ts FLOAT NOT NULL, purpose VARCHAR NOT NULL, "
            "hypothesis_id VARCHAR, model VARCHAR NOT NULL, mode VARCHAR NOT NULL, attempt INTEGER NOT NULL, "
            "request_json TEXT NOT NULL, response_text TEXT, status_code INTEGER, prompt_tokens INTEGER NOT NULL, "
            "completion_tokens INTEGER NOT NULL, usd FLOAT NOT NULL, latency_s FLOAT NOT NULL, error TEXT)"))
        conn.execute(text("INSERT INTO llm_call VALUES (1, 1.0, 'propose', NULL, 'm', 'text', 1, '{}', NULL, 200, "
                          "10, 100, 0.5, 2.0, NULL)"))
    ledger = Ledger(engine)
    Ledger(engine)  # a second opener finds the columns there
    ledger.record(LLMCall(purpose="decide", model="m", request_json="{}", completion_tokens=100, latency_s=2.0,
                          first_token_s=1.0, finish_reason="stop"))
    old, new = ledger.calls()
    assert (old.first_token_s, old.finish_reason, new.first_token_s) == (None, None, 1.0)
    assert ledger.spent_usd(0) == 0.5 and ledger.rate("m") is not None and ledger.rate("m").tokens_per_s == 100.0
