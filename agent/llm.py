"""The LLM client: JSON answers from any OpenAI-compatible endpoint, paid for and written down.

Why this much machinery around one HTTP call: the loop runs unattended for days against endpoints
that differ (OpenAI, vLLM, Ollama, proxies) and fail (rate limits, 5xx, stalls). So the client

- asks for structured output (`response_format` json_schema) and, when an endpoint rejects that,
  falls back to a forced tool call, then to JSON in plain text; the first mode an endpoint accepts is
  remembered for the rest of the client's life, so the fallback costs one rejected call, once;
- validates every answer against the schema, whatever the mode, and sends the error back for up to
  `repair_rounds` corrections before giving up with `LLMOutputError` (the caller skips the hypothesis
  with that reason instead of crashing the loop);
- streams every answer (`stream=True`, with `stream_options.include_usage` where the server takes
  it), so a slow server still writing is never cut off: a request ends when no token came for
  `idle_timeout_s` (`[agent] idle_timeout_s`; the first token included) or the whole answer passed
  `timeout_s` (`[agent] request_timeout_s`). A timeout is not asked again here: the same server
  would be as slow, so the error names the key to raise and the loop's back-off asks later;
- learns the server's rate from its answers (`Ledger.rate`) and bounds each answer (`max_tokens`)
  by what it writes within `timeout_s`, saying so once per purpose, and says in a log line when an
  answer was cut at its bound (finish_reason "length");
- retries 429, 5xx and dropped connections with exponential backoff and jitter, honouring
  `Retry-After`; the SDK's own retries are off so that every attempt is counted and recorded;
- prices each answer from its `usage` when the model's price is known (`PRICES`, dated, or the
  lab's `[agent] price_per_mtok`), and refuses to call once today's (UTC) spend reaches the dollar
  cap; a model without a price is counted in tokens, and only a token cap applies to it;
- records every attempt — request body, the response (a streamed one assembled as one completion),
  tokens, dollars, latency, time to the first token, error — in the `Ledger`, once, with what
  arrived; the caps are checked against it, so they hold across restarts.

Configuration is the SDK's: `OPENAI_BASE_URL`, `OPENAI_API_KEY`; the model comes from research.toml's
`[agent] model` unless `AUTORESEARCH_MODEL` overrides it. Words sent to the model come from
`prompts/` templates (`json_only`, `json_repair`); callers render theirs with `agent.prompts`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING, Any, Literal

from agent import prompts
from agent.errors import (  # noqa: F401 (re-exported: the client raises them)
    BudgetExceeded,
    LLMError,
    LLMOutputError,
    LLMUnavailable,
    ModeRejected,
    NotConfigured,
)
from agent.ledger import Ledger, LLMCall, ServerRate, utc_day_start
from agent.llm_answers import Answer, Assembly, extract_json_object, read_whole, validate, whole_answer  # noqa: F401
from agent.llm_prices import PRICES, Price, price_for, resolve_model  # noqa: F401 (Price, price_for: re-exported)

if TYPE_CHECKING:
    from openai import OpenAI

log = logging.getLogger("autoresearch.llm")

Mode = Literal["json_schema", "tool", "text"]
MODES: tuple[Mode, ...] = ("json_schema", "tool", "text")
RETRYABLE_STATUS = frozenset({408, 409, 429})  # and every 5xx


# The answer's bound per purpose (`max_tokens`), overridable in `[agent.max_output_tokens]`: a
# proposal and a decision are a few hundred tokens of JSON, edits carry whole search/replace blocks.
DEFAULT_MAX_OUTPUT_TOKENS: dict[str, int] = {"propose": 2000, "implement": 8000, "decide": 1000, "summarize": 2000,
                                             "default": 4000}
# The defaults of `[agent] request_timeout_s` and `idle_timeout_s`: a server writing 15 tokens/s
# writes the largest default answer (8000 tokens) in 533 s; its first token may wait for a long prompt.
REQUEST_TIMEOUT_S = 600.0
IDLE_TIMEOUT_S = 120.0
# Sized to a slow server, an answer's bound leaves this share of the time cap's room unused (the
# server may slow down), and is never below MIN_ANSWER_TOKENS (less holds no useful answer).
FIT_SHARE = 0.8
MIN_ANSWER_TOKENS = 256


def _retry_after(headers: Mapping[str, str] | None) -> float | None:
    """Seconds the server asked us to wait (`retry-after-ms`, `retry-after` seconds or HTTP date)."""
    if not headers:
        return None
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            return float(ms) / 1000
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        try:
            return parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError):
            return None


class LLMClient:
    """Chat completions with structured answers, retries, accounting and an audit trail.

    One client per process is enough; it is safe to share between threads (what it learned — the
    mode, the bound's name, whether the server takes `stream_options` — is a few plain attributes,
    and the ledger opens a session per call).
    """

    def __init__(
        self,
        model: str,
        ledger: Ledger,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        max_usd_per_day: float | None = None,
        max_tokens_per_day: int | None = None,
        price: Price | None = None,
        prices: Mapping[str, Price] | None = None,
        max_attempts: int = 6,
        backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
        timeout_s: float = REQUEST_TIMEOUT_S,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        repair_rounds: int = 2,
        temperature: float | None = None,
        max_output_tokens: Mapping[str, int] | None = None,
        env: Mapping[str, str] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.time,
    ):
        env = env if env is not None else os.environ
        base_url = base_url or env.get("OPENAI_BASE_URL") or None
        api_key = api_key or env.get("OPENAI_API_KEY") or None
        if not (base_url or api_key):
            raise NotConfigured("no LLM endpoint: set OPENAI_API_KEY (and OPENAI_BASE_URL for other servers)")
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        import openai  # here, not at module level: the CLI must start without it

        # A local server (vLLM, Ollama) may need no key, but the SDK insists on one.
        self._openai: OpenAI = openai.OpenAI(base_url=base_url, api_key=api_key or "not-needed", max_retries=0)
        self.model = model
        self.ledger = ledger
        self.base_url = str(self._openai.base_url)
        self.price: Price | None = price or price_for(model, {**PRICES, **(prices or {})})
        # the dollar cap holds for a model with a price; spend on one without is counted in tokens
        self.max_usd_per_day = max_usd_per_day if self.price is not None else None
        self.max_tokens_per_day = max_tokens_per_day
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.timeout_s = timeout_s
        self.idle_timeout_s = min(idle_timeout_s, timeout_s)
        self.repair_rounds = repair_rounds
        self.temperature = temperature
        self.max_output_tokens = {**DEFAULT_MAX_OUTPUT_TOKENS, **(max_output_tokens or {})}
        self._sleep = sleep
        self._clock = clock
        self._mode_index = 0
        self._tokens_key = "max_tokens"  # the widest-supported name; "max_completion_tokens" once refused
        self._stream_usage = True  # ask for the usage chunk until the server refuses `stream_options`
        self._rate: ServerRate | None = None
        self._rate_stale = True
        self._said_bound: set[str] = set()

    @classmethod
    def from_env(cls, configured_model: str, ledger: Ledger, **kwargs: Any) -> LLMClient:
        """A client for research.toml's model (or `AUTORESEARCH_MODEL`) at the environment's endpoint."""
        return cls(resolve_model(configured_model, kwargs.get("env")), ledger, **kwargs)

    @staticmethod
    def configured(env: Mapping[str, str] | None = None) -> bool:
        """Whether an endpoint is configured; when not, the loop runs its offline policy."""
        env = env if env is not None else os.environ
        return bool(env.get("OPENAI_BASE_URL") or env.get("OPENAI_API_KEY"))

    @property
    def mode(self) -> Mode:
        """How structured output is asked for now: json_schema, tool, or text (learned by fallback)."""
        return MODES[self._mode_index]

    @property
    def priced(self) -> bool:
        """Whether the model's price is known: spend is then in dollars and the dollar cap applies."""
        return self.price is not None

    def spent_today(self) -> float:
        """Dollars spent on LLM calls since UTC midnight, by every client sharing the ledger."""
        return self.ledger.spent_usd(utc_day_start(self._clock()))

    def tokens_today(self) -> int:
        """Prompt and completion tokens since UTC midnight, by every client sharing the ledger."""
        return sum(self.ledger.tokens_since(utc_day_start(self._clock())))

    def budget_reached(self) -> str | None:
        """Why no request may be sent today (the dollar cap of a priced model, or the token cap), in
        one line; None while both allow more."""
        if self.max_usd_per_day is not None:
            spent = self.spent_today()
            if spent >= self.max_usd_per_day:
                return f"LLM budget reached: ${spent:.4f} of ${self.max_usd_per_day:.2f} spent today (UTC)"
        if self.max_tokens_per_day is not None:
            used = self.tokens_today()
            if used >= self.max_tokens_per_day:
                return (f"LLM budget reached: {used} of {self.max_tokens_per_day} tokens used today (UTC) "
                        "([agent] max_tokens_per_day)")
        return None

    def server_rate(self) -> ServerRate | None:
        """How fast the server answers this model, from its last streamed answers (None before one)."""
        if self._rate_stale:
            self._rate, self._rate_stale = self.ledger.rate(self.model), False
        return self._rate

    def max_tokens_for(self, purpose: str) -> int:
        """The bound on an answer for `purpose`: the lab's (or default) bound, lowered to what the
        server writes within `timeout_s` at its learned rate; said once per purpose when lowered."""
        configured = self.max_output_tokens.get(purpose, DEFAULT_MAX_OUTPUT_TOKENS["default"])
        rate = self.server_rate()
        if rate is None:
            return configured
        fits = int(rate.tokens_per_s * max(0.0, self.timeout_s - rate.first_token_s) * FIT_SHARE)
        bound = max(MIN_ANSWER_TOKENS, min(configured, fits))
        if bound < configured and purpose not in self._said_bound:
            self._said_bound.add(purpose)
            log.warning("%s: answers bounded to %d tokens, not %d: the server writes %.1f tokens/s and "
                        "[agent] request_timeout_s is %g s", purpose, bound, configured, rate.tokens_per_s,
                        self.timeout_s)
        return bound

    # --- public calls ---------------------------------------------------------------------------

    def complete_json(
        self,
        purpose: str,
        messages: Sequence[Mapping[str, Any]],
        schema: Mapping[str, Any],
        name: str,
        *,
        hypothesis_id: str | None = None,
    ) -> dict[str, Any]:
        """Ask for one JSON object matching `schema` (named `name`, e.g. "hypothesis") and return it.

        `schema` should suit OpenAI's strict mode: every object lists all its properties in `required`
        and sets `additionalProperties: false`. `purpose` (propose, implement, decide, …) and
        `hypothesis_id` label the ledger rows.

        Raises `LLMOutputError` (no valid answer after repairs), `BudgetExceeded`, `LLMUnavailable`
        (retries exhausted, or a timeout) or `LLMError` itself (the endpoint refuses the request
        in every mode).
        """
        rejections: list[str] = []
        for index in range(self._mode_index, len(MODES)):
            try:
                return self._complete_in_mode(MODES[index], purpose, messages, schema, name, hypothesis_id)
            except ModeRejected as r:
                rejections.append(f"{MODES[index]}: {r}")
                if r.explicit:  # the endpoint named the parameter it lacks: no need to ask again
                    self._mode_index = max(self._mode_index, index + 1)
        raise LLMError(f"{purpose}: LLM request rejected: " + " | ".join(rejections))

    # --- modes ----------------------------------------------------------------------------------

    def _body(self, mode: Mode, purpose: str, messages: list[Mapping[str, Any]],
              schema: Mapping[str, Any] | None = None, name: str = "") -> dict[str, Any]:
        # every request bounds its answer: a small local model left unbounded rambles until the timeout
        body: dict[str, Any] = {"model": self.model, "messages": messages,
                                self._tokens_key: self.max_tokens_for(purpose), "stream": True}
        if self._stream_usage:
            body["stream_options"] = {"include_usage": True}
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if schema is not None and mode == "json_schema":
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": name, "schema": dict(schema), "strict": True},
            }
        elif schema is not None and mode == "tool":
            body["tools"] = [{"type": "function", "function": {"name": name, "parameters": dict(schema)}}]
            body["tool_choice"] = {"type": "function", "function": {"name": name}}
        return body

    def _complete_in_mode(
        self,
        mode: Mode,
        purpose: str,
        messages: Sequence[Mapping[str, Any]],
        schema: Mapping[str, Any],
        name: str,
        hypothesis_id: str | None,
    ) -> dict[str, Any]:
        schema_text = json.dumps(schema, indent=2)
        convo: list[Mapping[str, Any]] = list(messages)
        if mode == "text":
            convo = _append_to_last_user(convo, prompts.render("json_only", name=name, schema=schema_text))
        errors: list[str] = []
        text: str | None = None
        for round_ in range(self.repair_rounds + 1):
            answer = self._send(purpose, hypothesis_id, mode, self._body(mode, purpose, convo, schema, name))
            self._mode_index = max(self._mode_index, MODES.index(mode))  # this endpoint accepts this mode
            if answer.refusal:
                raise LLMOutputError.after_repairs(purpose, name, errors + [f"the model refused: {answer.refusal}"], None)
            text = answer.text
            try:
                obj = extract_json_object(text)
                validate(obj, schema)
                return obj
            except LLMOutputError as e:  # this answer: repaired below
                errors.append(str(e))
                if round_ == self.repair_rounds:
                    break
                repair = prompts.render("json_repair", error=str(e), schema=schema_text)
                convo = [*convo, {"role": "assistant", "content": text}, {"role": "user", "content": repair}]
        raise LLMOutputError.after_repairs(purpose, name, errors, text)

    # --- one request, with retries --------------------------------------------------------------

    def _check_budget(self) -> None:
        if self.max_usd_per_day is not None:
            spent = self.spent_today()
            if spent >= self.max_usd_per_day:
                raise BudgetExceeded(spent, self.max_usd_per_day)
        if self.max_tokens_per_day is not None:
            used = self.tokens_today()
            if used >= self.max_tokens_per_day:
                raise BudgetExceeded(used, self.max_tokens_per_day, unit="tokens")

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None and retry_after >= 0:
            return min(retry_after, self.max_backoff_s)
        ceiling = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
        return ceiling / 2 + random.uniform(0, ceiling / 2)  # jitter: drivers don't retry in lockstep

    def _send(self, purpose: str, hypothesis_id: str | None, mode: Mode, body: dict[str, Any]) -> Answer:
        """POST one chat completion, retrying transient failures; one ledger row per attempt.

        A timeout ends it at once (`LLMUnavailable` naming the key): the row counts what arrived."""
        import openai

        last_error = ""
        for attempt in range(1, self.max_attempts + 1):
            self._check_budget()
            request_json = json.dumps(body, ensure_ascii=False)
            call = LLMCall(ts=self._clock(), purpose=purpose, hypothesis_id=hypothesis_id, model=self.model,
                           mode=mode, attempt=attempt, request_json=request_json)
            retry_after: float | None = None
            started = time.monotonic()
            try:
                answer = self._request(body, call, started)
            except openai.APIConnectionError as e:
                last_error = f"connection error: {e.__cause__ or e}"
            except openai.APIStatusError as e:
                status, text, message = e.status_code, e.response.text, _error_message(e)
                last_error = f"HTTP {status}: {message}"
                call.status_code, call.response_text = status, text
                self._record(call, started, error=last_error)
                said = f"{message} {text}"
                if status in (400, 422) and "max_tokens" in body and "max_completion_tokens" in said:
                    # OpenAI's reasoning models take the bound under its newer name: use it from now on
                    self._tokens_key = "max_completion_tokens"
                    body["max_completion_tokens"] = body.pop("max_tokens")
                    continue
                if status in (400, 422) and "stream_options" in body and "stream_options" in said:
                    # a server that streams but sends no usage chunk: tokens are counted from the text
                    self._stream_usage = False
                    del body["stream_options"]
                    continue
                rejected = _mode_rejection(mode, status, said)
                if rejected is not None:
                    raise ModeRejected(last_error, explicit=rejected) from None
                if status not in RETRYABLE_STATUS and status < 500:
                    raise LLMError(f"{purpose}: LLM request rejected (HTTP {status}): {message}") from None
                retry_after = _retry_after(e.response.headers)
            except openai.APIError as e:  # an error event inside the stream: the server failed mid-answer
                last_error = f"error in the stream: {_error_message(e)}"
            except LLMOutputError as e:  # a 200 whose body is not a chat completion: a broken proxy
                last_error = f"malformed response: {e}"
            else:
                if answer.cut is not None:  # a timeout: what the server wrote before it is spent
                    if answer.pieces:
                        self._account(call, answer, request_json)
                    self._record(call, started, error=answer.cut)
                    raise LLMUnavailable(purpose, attempt, answer.cut)
                self._account(call, answer, request_json)
                self._record(call, started, error=None)
                if answer.first_token_s is not None:
                    self._rate_stale = True
                if answer.finish_reason == "length":
                    log.warning("%s: the answer was cut at %s = %s (finish_reason \"length\"); "
                                "[agent.max_output_tokens] %s raises it", purpose, self._tokens_key,
                                body.get(self._tokens_key), purpose)
                return answer
            if call.id is None:
                self._record(call, started, error=last_error)
            if attempt < self.max_attempts:
                self._sleep(self._delay(attempt, retry_after))
        raise LLMUnavailable(purpose, self.max_attempts, last_error)

    def _request(self, body: dict[str, Any], call: LLMCall, started: float) -> Answer:
        """One HTTP request: its answer, streamed (or whole, from a server that does not stream).

        On a timeout, what arrived, with `cut` saying so; raises the SDK's errors otherwise."""
        import openai

        assembly = Assembly(started)
        read_s = min(self.idle_timeout_s, self.timeout_s)  # the longest wait for any byte
        try:
            raw = self._openai.chat.completions.with_raw_response.create(**body, timeout=openai.Timeout(read_s))
            call.status_code = raw.http_response.status_code
            if "text/event-stream" not in raw.http_response.headers.get("content-type", ""):
                call.response_text = read_whole(raw.http_response)
                return whole_answer(call.response_text)
            stream = raw.parse()
            try:
                for chunk in stream:
                    assembly.add(chunk)
                    if assembly.finish_reason is None and time.monotonic() - started > self.timeout_s:
                        return self._cut(assembly.answer(), "request_timeout_s")
            finally:
                stream.close()
                if assembly.head:
                    call.response_text = json.dumps(assembly.answer().completion, ensure_ascii=False)
        except openai.APITimeoutError:
            key = "request_timeout_s" if time.monotonic() - started >= self.timeout_s else "idle_timeout_s"
            return self._cut(assembly.answer(), key)
        if not assembly.choices:
            raise LLMOutputError("a stream without choices")
        return assembly.answer()

    def _cut(self, answer: Answer, key: str) -> Answer:
        """`answer` given up on a timeout: `cut` is the one line it is (what happened, the key to raise)."""
        answer.cut = self._cut_message(key, answer)
        return answer

    def _cut_message(self, key: str, answer: Answer) -> str:
        """The one line a timeout is: what happened and the key to raise."""
        got = f" after {answer.pieces} token(s)" if answer.pieces else ""
        if key == "idle_timeout_s":
            hint = "" if answer.pieces else ("; a server that does not stream sends nothing until its whole answer "
                                             "is written")
            idle = self.idle_timeout_s
            return f"no token for {idle:g} s{got} ([agent] idle_timeout_s = {idle:g}){hint}"
        return (f"the answer took longer than [agent] request_timeout_s = {self.timeout_s:g} s "
                f"({answer.pieces} token(s) arrived)")

    def _account(self, call: LLMCall, answer: Answer, request_json: str) -> None:
        # a server that sends no usage: ~4 characters a token (or a streamed delta each), so the caps hold
        call.prompt_tokens = answer.prompt_tokens if answer.prompt_tokens is not None else len(request_json) // 4
        call.completion_tokens = (answer.completion_tokens if answer.completion_tokens is not None
                                  else max(answer.pieces, len(answer.text) // 4))
        call.usd = self.price.cost(call.prompt_tokens, call.completion_tokens) if self.price is not None else 0.0
        call.first_token_s = answer.first_token_s
        call.finish_reason = answer.finish_reason

    def _record(self, call: LLMCall, started: float, error: str | None) -> None:
        call.latency_s = time.monotonic() - started
        call.error = error
        self.ledger.record(call)


def _mode_rejection(mode: Mode, status: int, message: str) -> bool | None:
    """Whether an error means "this endpoint can't do this mode": None if not; True if it said so.

    A 400/422 in a structured mode is taken as a rejection of the mode (many servers say no more);
    an error of any status naming the parameter is one, explicitly. A 400 in text mode is the
    request's own fault.
    """
    if mode == "text" or status == 429:
        return None
    words = ("response_format", "json_schema") if mode == "json_schema" else ("tools", "tool_choice", "function call")
    explicit = any(w in message.lower() for w in words)
    if explicit:
        return True
    return False if status in (400, 422) else None


def _error_message(e: Any) -> str:
    """The server's own words from an OpenAI-style error body, else the SDK's summary."""
    body = getattr(e, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return inner["message"]
    return str(getattr(e, "message", e))


def _append_to_last_user(messages: list[Mapping[str, Any]], text: str) -> list[Mapping[str, Any]]:
    """Add an instruction to the final user message (two user turns in a row break some chat
    templates), or as a new user message when the conversation does not end with plain user text."""
    out = list(messages)
    if out and out[-1].get("role") == "user" and isinstance(out[-1].get("content"), str):
        out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n\n{text}"}
        return out
    return [*out, {"role": "user", "content": text}]
