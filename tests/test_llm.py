"""The LLM client through the real openai SDK against a real HTTP server (tests/support/fake_openai.py).

Each test scripts the server, calls the client, and asserts on what came back, what the server
received, and what the ledger (a real SQLite file) holds.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from support.fake_openai import (
    FakeOpenAI,
    content,
    drop,
    error,
    garbage,
    rate_limited,
    raw,
    server_error,
    stall,
    tool_call,
)

from agent import prompts
from agent.ledger import Ledger, LLMCall, utc_day_start
from agent.llm import (
    BudgetExceeded,
    LLMClient,
    LLMError,
    LLMOutputError,
    LLMUnavailable,
    NotConfigured,
    Price,
    extract_json_object,
    price_for,
    resolve_model,
)
from pipeline.store import Store

pytestmark = pytest.mark.integration

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 1},
        "tasks_expected": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["title", "tasks_expected"],
    "additionalProperties": False,
}
GOOD = {"title": "Read the PIX source", "tasks_expected": ["churn", "default"]}
COMMENT = "Reviewer: the PIX source looks promising, try it before tuning LoRA."
MESSAGES = [
    {"role": "system", "content": "You are the research agent."},
    {"role": "user", "content": f"Propose one hypothesis.\n\n{COMMENT}"},
]


@pytest.fixture
def ledger(tmp_path: Path) -> Ledger:
    return Ledger(Store(f"sqlite:///{tmp_path / 'store.db'}").engine)


@pytest.fixture
def delays() -> list[float]:
    return []


def make_client(server: FakeOpenAI, ledger: Ledger, delays: list[float] | None = None, **kw: Any) -> LLMClient:
    kw.setdefault("backoff_s", 0.001)
    kw.setdefault("timeout_s", 5.0)
    sleep = delays.append if delays is not None else (lambda _s: None)
    return LLMClient(kw.pop("model", "gpt-4.1-mini"), ledger, **server.client_kwargs(), sleep=sleep, **kw)


def ask(client: LLMClient, **kw: Any) -> dict[str, Any]:
    return client.complete_json("propose", MESSAGES, SCHEMA, "hypothesis", **kw)


# --- the three ways of asking for structure ---------------------------------------------------


def test_structured_output_path(fake_openai: FakeOpenAI, ledger: Ledger) -> None:
    fake_openai.script(content(GOOD))
    client = make_client(fake_openai, ledger)

    assert ask(client) == GOOD
    (req,) = fake_openai.requests
    assert req["model"] == "gpt-4.1-mini"
    assert req["messages"] == MESSAGES
    assert req["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "hypothesis", "schema": SCHEMA, "strict": True},
    }
    assert "tools" not in req
    assert fake_openai.request_headers[0]["authorization"] == f"Bearer {fake_openai.api_key}"
    assert client.mode == "json_schema"


def test_falls_back_to_forced_tool_call_and_remembers(ledger: Ledger) -> None:
    with FakeOpenAI([tool_call(GOOD), tool_call(GOOD)], supports_response_format=False) as server:
        client = make_client(server, ledger)
        assert ask(client) == GOOD
        assert ask(client) == GOOD  # straight to the tool call: the rejection is not paid twice

    first, second, third = server.requests
    assert "response_format" in first
    for req in (second, third):
        assert "response_format" not in req
        assert req["tools"] == [{"type": "function", "function": {"name": "hypothesis", "parameters": SCHEMA}}]
        assert req["tool_choice"] == {"type": "function", "function": {"name": "hypothesis"}}
    assert client.mode == "tool"
    rows = ledger.calls()
    assert [(r.mode, r.status_code) for r in rows] == [("json_schema", 400), ("tool", 200), ("tool", 200)]
    assert "response_format" in (rows[0].error or "") and "response_format" in (rows[0].response_text or "")


def test_falls_back_to_json_in_text(ledger: Ledger) -> None:
    fenced = "Here is the hypothesis:\n```json\n" + json.dumps(GOOD, indent=2) + "\n```\nGood luck!"
    with FakeOpenAI([content(fenced), content(GOOD)], supports_response_format=False, supports_tools=False) as server:
        client = make_client(server, ledger)
        assert ask(client) == GOOD
        assert ask(client) == GOOD

    assert len(server.requests) == 4  # rejected json_schema, rejected tools, text; then text directly
    text_req = server.requests[2]
    assert "response_format" not in text_req and "tools" not in text_req
    last = text_req["messages"][-1]
    assert last["role"] == "user" and COMMENT in last["content"]  # instruction appended, not a 2nd user turn
    assert "JSON" in last["content"] and '"tasks_expected"' in last["content"]  # the schema is in the prompt
    assert len(text_req["messages"]) == len(MESSAGES)
    assert client.mode == "text"
    assert [r.mode for r in ledger.calls()] == ["json_schema", "tool", "text", "text"]


def test_a_plain_400_in_every_mode_is_the_requests_fault_not_a_capability(ledger: Ledger) -> None:
    too_long = error(400, "This model's maximum context length is 8192 tokens.", code="context_length_exceeded")
    with FakeOpenAI([too_long, too_long, too_long]) as server:
        client = make_client(server, ledger)
        with pytest.raises(LLMError, match="maximum context length"):
            ask(client)
    assert len(server.requests) == 3
    assert client.mode == "json_schema"  # nothing was learned from a request that was simply too long


# --- validation and repair --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "complaint"),
    [
        (garbage(), "no JSON object"),
        (content({"title": ""}), "tasks_expected"),
        (content('{"title": "x", "tasks_expected": [1,'), "invalid JSON"),
    ],
    ids=["prose", "schema-violation", "truncated-json"],
)
def test_bad_answer_then_repair_succeeds(fake_openai: FakeOpenAI, ledger: Ledger, bad: Any, complaint: str) -> None:
    fake_openai.script(bad, content(GOOD))
    client = make_client(fake_openai, ledger)

    assert ask(client) == GOOD
    first, second = fake_openai.requests
    assert second["messages"][: len(MESSAGES)] == MESSAGES
    assistant, repair = second["messages"][len(MESSAGES):]
    assert assistant == {"role": "assistant", "content": json.loads(ledger.calls()[0].response_text or "")["choices"][0]["message"]["content"]}
    assert repair["role"] == "user" and complaint in repair["content"]
    assert second["response_format"] == first["response_format"]


def test_garbage_three_times_raises_output_error(fake_openai: FakeOpenAI, ledger: Ledger) -> None:
    fake_openai.script(garbage(), garbage("still no json"), content({"title": "only a title"}), content(GOOD))
    client = make_client(fake_openai, ledger)

    with pytest.raises(LLMOutputError) as exc:
        ask(client, hypothesis_id="h7")
    assert len(exc.value.errors) == 3  # the answer and two repair rounds
    assert "no valid hypothesis after 3 answer(s)" in str(exc.value) and "tasks_expected" in str(exc.value)
    assert len(fake_openai.requests) == 3 and fake_openai.remaining == 1  # gave up; no 4th request
    assert len(ledger.calls(hypothesis_id="h7")) == 3


def test_tool_call_answer_is_validated_and_repaired(ledger: Ledger) -> None:
    with FakeOpenAI([tool_call({"title": 3}), tool_call(GOOD)], supports_response_format=False) as server:
        client = make_client(server, ledger)
        assert ask(client) == GOOD
    repair = server.requests[-1]["messages"][-1]
    assert "title" in repair["content"] and "is not of type 'string'" in repair["content"]


# --- retries ----------------------------------------------------------------------------------


def test_rate_limit_then_success_honours_retry_after(fake_openai: FakeOpenAI, ledger: Ledger, delays: list[float]) -> None:
    fake_openai.script(rate_limited(retry_after=7), rate_limited(retry_after=None), content(GOOD))
    client = make_client(fake_openai, ledger, delays)

    assert ask(client) == GOOD
    assert len(fake_openai.requests) == 3
    assert delays[0] == 7  # the server's Retry-After, not our backoff
    assert 0 < delays[1] <= 0.002  # no header: exponential backoff (attempt 2 → ≤ 2 × backoff_s)
    rows = ledger.calls()
    assert [(r.attempt, r.status_code) for r in rows] == [(1, 429), (2, 429), (3, 200)]
    assert rows[0].usd == 0 and rows[2].usd > 0


def test_backoff_grows_exponentially_with_jitter_and_is_capped(ledger: Ledger) -> None:
    with FakeOpenAI([server_error()] * 6 + [content(GOOD)]) as server:
        delays: list[float] = []
        client = make_client(server, ledger, delays, max_attempts=7, backoff_s=1.0, max_backoff_s=8.0)
        assert ask(client) == GOOD
    ceilings = [1, 2, 4, 8, 8, 8]
    assert all(c / 2 <= d <= c for d, c in zip(delays, ceilings, strict=True)), delays


def test_server_errors_beyond_max_attempts_is_a_clear_error(fake_openai: FakeOpenAI, ledger: Ledger) -> None:
    fake_openai.script(*[server_error(502)] * 5)
    client = make_client(fake_openai, ledger, max_attempts=3)

    with pytest.raises(LLMUnavailable) as exc:
        ask(client)
    assert exc.value.attempts == 3
    assert str(exc.value).startswith("propose: LLM endpoint failed 3 attempt(s); last error: HTTP 502")
    assert len(fake_openai.requests) == 3 and fake_openai.remaining == 2
    assert [r.status_code for r in ledger.calls()] == [502, 502, 502]


def test_a_server_silent_past_the_idle_timeout_is_one_clear_error_not_retried(fake_openai: FakeOpenAI,
                                                                              ledger: Ledger) -> None:
    """The same server would be as slow again: no retry within the call, one line naming the key
    (the loop's back-off asks later)."""
    fake_openai.script(stall(30.0, then=content({"title": "late", "tasks_expected": []})), content(GOOD))
    client = make_client(fake_openai, ledger, idle_timeout_s=1)

    with pytest.raises(LLMUnavailable) as exc:
        ask(client)
    assert "[agent] idle_timeout_s = 1" in str(exc.value) and "\n" not in str(exc.value)
    assert len(fake_openai.requests) == 1
    (row,) = ledger.calls()
    assert row.error and "no token for 1 s" in row.error and row.response_text is None and row.latency_s >= 1
    assert (row.prompt_tokens, row.completion_tokens, row.usd) == (0, 0, 0)  # nothing arrived, nothing spent
    assert ask(client) == GOOD  # the next call is a new request


def test_dropped_connection_and_malformed_body_are_retried(fake_openai: FakeOpenAI, ledger: Ledger) -> None:
    fake_openai.script(drop(), raw("<html>502 Bad Gateway</html>"), content(GOOD))
    client = make_client(fake_openai, ledger)

    assert ask(client) == GOOD
    errors = [r.error or "" for r in ledger.calls()]
    assert errors[0].startswith("connection error") and errors[1].startswith("malformed response")
    assert errors[2] == ""


def test_auth_error_is_not_retried(fake_openai: FakeOpenAI, ledger: Ledger) -> None:
    fake_openai.script(error(401, "Incorrect API key provided.", code="invalid_api_key"), content(GOOD))
    client = make_client(fake_openai, ledger)

    with pytest.raises(LLMError, match="HTTP 401"):
        ask(client)
    assert len(fake_openai.requests) == 1


# --- accounting, cap, audit -------------------------------------------------------------------


def test_tokens_and_cost_are_stored_and_survive_a_restart(fake_openai: FakeOpenAI, ledger: Ledger, tmp_path: Path) -> None:
    fake_openai.script(content(GOOD, usage=(1000, 500)), content(GOOD, usage=(2000, 0)))
    client = make_client(fake_openai, ledger)
    ask(client)
    ask(client)

    a, b = ledger.calls()
    assert (a.prompt_tokens, a.completion_tokens, b.prompt_tokens) == (1000, 500, 2000)
    assert a.usd == pytest.approx((1000 * 0.40 + 500 * 1.60) / 1e6)  # gpt-4.1-mini list price
    assert b.usd == pytest.approx(2000 * 0.40 / 1e6)
    reopened = Ledger(Store(f"sqlite:///{tmp_path / 'store.db'}").engine)  # another process, later
    assert reopened.spent_today() == pytest.approx(a.usd + b.usd)
    assert reopened.spent_usd(since=time.time() + 60) == 0


def test_an_unknown_model_has_no_price_and_no_dollar_cap_but_a_token_cap(fake_openai: FakeOpenAI,
                                                                        ledger: Ledger) -> None:
    assert price_for("gpt-4.1-mini-2025-04-14") == Price(0.40, 1.60)
    assert price_for("openai/gpt-4o-mini") == Price(0.15, 0.60)
    assert price_for("my-local-llama") is None

    fake_openai.script(*[content(GOOD, usage=(1_000_000, 1000))] * 2)
    local = make_client(fake_openai, ledger, model="my-local-llama", max_usd_per_day=0.01, max_tokens_per_day=1_500_000)
    assert not local.priced and local.max_usd_per_day is None  # a guessed price would stop a free model
    ask(local)  # $0.01 would be spent many times over at any listed price
    assert local.budget_reached() is None
    ask(local)  # crosses the token cap
    with pytest.raises(BudgetExceeded, match=r"2002000 tokens used today .*max_tokens_per_day"):
        ask(local)
    assert local.budget_reached() == ("LLM budget reached: 2002000 of 1500000 tokens used today (UTC) "
                                      "([agent] max_tokens_per_day)")
    assert len(fake_openai.requests) == 2 and fake_openai.remaining == 0 and [r.usd for r in ledger.calls()] == [0, 0]

    # the lab's [agent] price_per_mtok prices it: then it is dollars, and the dollar cap holds
    fake_openai.script(content(GOOD, usage=(1_000_000, 1_000_000)))
    priced = make_client(fake_openai, ledger, model="my-local-llama", price=Price(0.0, 1.0), max_usd_per_day=5)
    assert priced.priced and priced.max_usd_per_day == 5
    ask(priced)
    assert ledger.calls()[-1].usd == pytest.approx(1.0)


def test_daily_cap_stops_calls_before_they_are_sent(fake_openai: FakeOpenAI, ledger: Ledger) -> None:
    now = time.time()
    ledger.record(LLMCall(ts=utc_day_start(now) - 3600, purpose="old", model="gpt-4.1", request_json="{}", usd=50.0))
    fake_openai.script(*[content(GOOD, usage=(1000, 500))] * 3)  # $0.0012 each
    client = make_client(fake_openai, ledger, max_usd_per_day=0.002)

    ask(client)  # yesterday's $50 does not count
    ask(client)  # $0.0012 < cap: allowed, and crosses it
    with pytest.raises(BudgetExceeded) as exc:
        ask(client)
    assert exc.value.used == pytest.approx(0.0024) and exc.value.cap == 0.002 and exc.value.unit == "usd"
    assert len(fake_openai.requests) == 2 and fake_openai.remaining == 1  # the server saw nothing more
    assert len(ledger.calls(purpose="propose")) == 2

    tomorrow = make_client(fake_openai, ledger, max_usd_per_day=0.002, clock=lambda: now + 86400)
    assert ask(tomorrow) == GOOD  # a new UTC day, a new budget


def test_zero_cap_sends_nothing(fake_openai: FakeOpenAI, ledger: Ledger) -> None:
    fake_openai.script(content(GOOD))
    with pytest.raises(BudgetExceeded):
        ask(make_client(fake_openai, ledger, max_usd_per_day=0))
    assert fake_openai.requests == []


def test_every_request_and_response_is_in_the_ledger(ledger: Ledger) -> None:
    script = [rate_limited(), tool_call("I think: {oops"), tool_call(GOOD), tool_call(GOOD)]
    with FakeOpenAI(script, supports_response_format=False) as server:
        client = make_client(server, ledger, max_output_tokens={"summarize": 300})
        assert client.complete_json("propose", MESSAGES, SCHEMA, "hypothesis", hypothesis_id="h1") == GOOD
        assert client.complete_json("summarize", [{"role": "user", "content": "Summarize."}], SCHEMA, "hypothesis",
                                    hypothesis_id="h1") == GOOD
    # every request bounds its answer, by purpose (a default, or the lab's [agent.max_output_tokens])
    assert [b["max_tokens"] for b in server.requests] == [2000] * 4 + [300]

    rows = ledger.calls(hypothesis_id="h1")
    assert len(rows) == len(server.requests) == 5  # rejected json_schema, 429, garbage, repaired, summary
    for row, sent in zip(rows, server.requests, strict=True):
        assert json.loads(row.request_json) == sent
        assert row.model == "gpt-4.1-mini" and row.latency_s > 0
    assert COMMENT in rows[0].request_json  # the reviewer's comment reached the model, and the audit
    assert [r.purpose for r in rows] == ["propose"] * 4 + ["summarize"]
    assert [r.status_code for r in rows] == [400, 429, 200, 200, 200]
    assert "{oops" in (rows[2].response_text or "")
    assert json.loads(rows[3].response_text or "")["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "hypothesis"
    assert rows[0].error and rows[1].error and not rows[3].error
    assert ledger.calls(hypothesis_id="other") == []


# --- configuration ----------------------------------------------------------------------------


def test_configuration_from_environment(fake_openai: FakeOpenAI, ledger: Ledger) -> None:
    assert not LLMClient.configured({})
    assert LLMClient.configured({"OPENAI_API_KEY": "sk-x"})
    assert LLMClient.configured({"OPENAI_BASE_URL": "http://127.0.0.1:8000/v1"})  # a local server needs no key
    with pytest.raises(NotConfigured):
        LLMClient("gpt-4.1-mini", ledger, env={})
    assert resolve_model("gpt-4.1-mini", {}) == "gpt-4.1-mini"
    assert resolve_model("gpt-4.1-mini", {"AUTORESEARCH_MODEL": "gpt-4o"}) == "gpt-4o"

    env = {**fake_openai.env(), "AUTORESEARCH_MODEL": "qwen-7b"}
    fake_openai.script(content(GOOD))
    client = LLMClient.from_env("gpt-4.1-mini", ledger, env=env, sleep=lambda _s: None)
    assert ask(client) == GOOD and fake_openai.requests[0]["model"] == "qwen-7b"


def test_extract_json_object() -> None:
    assert extract_json_object('```json\n{"a": 1}\n```') == {"a": 1}
    assert extract_json_object('Sure. {"a": {"b": [1, 2]}} and {"c": 3}') == {"a": {"b": [1, 2]}}
    assert extract_json_object('[1, 2] then {"a": 1}') == {"a": 1}
    assert extract_json_object('```\n{"a": "}{"}\n```') == {"a": "}{"}


# --- prompt templates -------------------------------------------------------------------------


def test_every_template_documents_exactly_the_placeholders_it_uses() -> None:
    names = prompts.names()
    for required in ("system", "propose", "implement", "decide", "summarize", "repair", "json_only", "json_repair"):
        assert required in names
    for name in names:
        t = prompts.load(name)
        assert t.placeholders, name
        assert t.documented == t.placeholders, f"{name}: documented {sorted(t.documented)} vs used {sorted(t.placeholders)}"
        assert "<!--" not in t.body


def test_templates_are_filled_strictly(tmp_path: Path) -> None:
    values = {p: f"<{p}>" for p in prompts.load("repair").placeholders}
    text = prompts.render("repair", **values)
    assert "<error>" in text and "{" not in text.replace("{{", "")

    with pytest.raises(prompts.UserError, match="error"):
        prompts.render("repair", **{k: v for k, v in values.items() if k != "error"})
    with pytest.raises(prompts.UserError, match="colour"):
        prompts.render("repair", **values, colour="red")
    with pytest.raises(prompts.UserError):
        prompts.load("no-such-prompt")

    (tmp_path / "t.md").write_text("<!-- {x} -->\nA literal {{brace}} and {x}.\n")
    assert prompts.render("t", tmp_path, x="value with {braces}") == "A literal {brace} and value with {braces}.\n"
    (tmp_path / "bad.md").write_text("attribute access {x.y}\n")
    with pytest.raises(prompts.UserError, match="plain name"):
        prompts.load("bad", tmp_path)


def test_every_phrase_is_used_and_every_placeholder_filled() -> None:
    """prompts/phrases.toml holds the short prompt text code used to build: none is dead, and a
    phrase is filled as strictly as a template (a missing value is an error naming it)."""
    import re
    import tomllib

    from agent import prompts
    from agent.errors import UserError

    keys = tomllib.loads((prompts.PROMPTS_DIR / "phrases.toml").read_text())
    code = "\n".join(p.read_text() for p in (prompts.PROMPTS_DIR.parent).glob("*.py"))
    used = set(re.findall(r'phrase\(\s*"([a-z_]+)"', code)) | {f"choice_{d}" for d in
                                                              ("promote", "hold", "escalate", "abandon", "refine")}
    used |= {k for k in keys if f'"{k}"' in code}  # chosen by a conditional expression
    assert set(keys) <= used, sorted(set(keys) - used)
    with pytest.raises(UserError, match="look"):
        prompts.phrase("look", index=1, count=3)


def test_an_endpoint_that_wants_max_completion_tokens_gets_it(fake_openai: FakeOpenAI, ledger: Ledger) -> None:
    """OpenAI's reasoning models refuse `max_tokens` (400, naming `max_completion_tokens`): the client
    sends the bound under that name from then on, without falling back to another output mode."""
    refuse = error(400, "Unsupported parameter: 'max_tokens' is not supported with this model. "
                        "Use 'max_completion_tokens' instead.", param="max_tokens", code="unsupported_parameter")
    fake_openai.script(refuse, content(GOOD), content(GOOD))
    client = make_client(fake_openai, ledger)
    assert ask(client) == GOOD and ask(client) == GOOD
    first, second, third = fake_openai.requests
    assert first["max_tokens"] == 2000 and "max_completion_tokens" not in first
    assert second["max_completion_tokens"] == 2000 and "max_tokens" not in second
    assert third["max_completion_tokens"] == 2000 and "response_format" in third  # still json_schema mode
