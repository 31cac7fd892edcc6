"""The LLM client: JSON answers from any OpenAI-compatible endpoint, paid for and written down.

Why this much machinery around one HTTP call: the loop runs unattended for days against endpoints
that differ (OpenAI, vLLM, Ollama, proxies) and fail (rate limits, 5xx, stalls). So the client

- asks for structured output (`response_format` json_schema) and, when an endpoint rejects that,
  falls back to a forced tool call, then to JSON in plain text; the first mode an endpoint accepts is
  remembered for the rest of the client's life, so the fallback costs one rejected call, once;
- validates every answer against the schema, whatever the mode, and sends the error back for up to
  `repair_rounds` corrections before giving up with `LLMOutputError` (the caller skips the hypothesis
  with that reason instead of crashing the loop);
- retries 429, 5xx, timeouts and dropped connections with exponential backoff and jitter, honouring
  `Retry-After`; the SDK's own retries are off so that every attempt is counted and recorded;
- prices each answer from its `usage` and refuses to call once today's (UTC) spend reaches the cap;
- records every attempt — request body, raw response, tokens, dollars, latency, error — in the
  `Ledger`, which is also what the cap is checked against, so the cap holds across restarts.

Configuration is the SDK's: `OPENAI_BASE_URL`, `OPENAI_API_KEY`; the model comes from research.toml's
`[agent] model` unless `AUTORESEARCH_MODEL` overrides it. Words sent to the model come from
`prompts/` templates (`json_only`, `json_repair`); callers render theirs with `agent.prompts`.
"""

from __future__ import annotations

import json
import os
import random
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING, Any, Literal

from agent import prompts
from agent.errors import (
    BudgetExceeded,
    LLMNotConfigured,
    LLMOutputError,
    LLMRequestRejected,
    LLMUnavailable,
)
from agent.ledger import Ledger, LLMCall, utc_day_start

if TYPE_CHECKING:
    from openai import OpenAI
    from openai.types.chat import ChatCompletion

Mode = Literal["json_schema", "tool", "text"]
MODES: tuple[Mode, ...] = ("json_schema", "tool", "text")
RETRYABLE_STATUS = frozenset({408, 409, 429})  # and every 5xx


@dataclass(frozen=True)
class Price:
    """USD per million tokens, input (prompt) and output (completion)."""

    input_per_mtok: float
    output_per_mtok: float

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (prompt_tokens * self.input_per_mtok + completion_tokens * self.output_per_mtok) / 1e6


# List prices; a dated model name ("gpt-4.1-mini-2025-04-14") matches its longest listed prefix.
PRICES: dict[str, Price] = {
    "gpt-5": Price(1.25, 10.00),
    "gpt-5-mini": Price(0.25, 2.00),
    "gpt-5-nano": Price(0.05, 0.40),
    "gpt-4.1": Price(2.00, 8.00),
    "gpt-4.1-mini": Price(0.40, 1.60),
    "gpt-4.1-nano": Price(0.10, 0.40),
    "gpt-4o": Price(2.50, 10.00),
    "gpt-4o-mini": Price(0.15, 0.60),
    "o3": Price(2.00, 8.00),
    "o3-mini": Price(1.10, 4.40),
    "o4-mini": Price(1.10, 4.40),
}
# An unknown model is priced high on purpose: overestimating spend stops early, underestimating
# would let the daily cap be overrun. Pass `prices` (or `default_price`) for a local, free endpoint.
DEFAULT_PRICE = Price(5.00, 15.00)

# The answer's bound per purpose (`max_tokens`), overridable in `[agent.max_output_tokens]`: a
# proposal and a decision are a few hundred tokens of JSON, edits carry whole search/replace blocks.
DEFAULT_MAX_OUTPUT_TOKENS: dict[str, int] = {"propose": 2000, "implement": 8000, "decide": 1000, "summarize": 2000,
                                             "default": 4000}


def price_for(model: str, prices: Mapping[str, Price] = PRICES, default: Price = DEFAULT_PRICE) -> Price:
    """The price of `model`: exact name, else the longest listed prefix, else `default`.

    A provider prefix ("openai/gpt-4.1-mini", as routers spell it) is ignored.
    """
    name = model.rsplit("/", 1)[-1]
    if name in prices:
        return prices[name]
    prefixes = [p for p in prices if name.startswith(p)]
    return prices[max(prefixes, key=len)] if prefixes else default


class InvalidOutput(ValueError):
    """One answer failed parsing or validation; the message is what the repair prompt sends back."""


class _ModeRejected(Exception):
    """The endpoint refused this way of asking for structure; `explicit` when it named the parameter."""

    def __init__(self, message: str, explicit: bool):
        super().__init__(message)
        self.explicit = explicit


def resolve_model(configured: str, env: Mapping[str, str] | None = None) -> str:
    """The model to use: `AUTORESEARCH_MODEL` when set, else research.toml's `[agent] model`."""
    return (env if env is not None else os.environ).get("AUTORESEARCH_MODEL") or configured


_FENCE = re.compile(r"```[A-Za-z0-9_-]*[ \t]*\n?(.*?)```", re.DOTALL)
_MAX_DECODE_STARTS = 200


def extract_json_object(text: str) -> dict[str, Any]:
    """The first JSON object in a model's answer: inside a code fence if there is one, else anywhere.

    Raises `InvalidOutput` with the parser's message, which is what the model needs to fix it.
    """
    decoder = json.JSONDecoder()
    first_error: str | None = None
    for chunk in [m.group(1) for m in _FENCE.finditer(text)] + [text]:
        starts = [i for i, ch in enumerate(chunk) if ch == "{"][:_MAX_DECODE_STARTS]
        for i in starts:
            try:
                obj, _end = decoder.raw_decode(chunk, i)
            except json.JSONDecodeError as e:
                first_error = first_error or f"invalid JSON: {e.msg} at line {e.lineno} column {e.colno}"
                continue
            if isinstance(obj, dict):
                return obj
    raise InvalidOutput(first_error or "no JSON object found in the answer")


def validate(obj: Any, schema: Mapping[str, Any]) -> None:
    """Raise `InvalidOutput` naming where `obj` breaks `schema` (JSON Schema 2020-12)."""
    from jsonschema import Draft202012Validator

    errors = sorted(Draft202012Validator(schema).iter_errors(obj), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"at {'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in errors[:5]]
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        raise InvalidOutput("the JSON does not match the schema: " + "; ".join(lines) + more)


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

    One client per process is enough; it is safe to share between threads (the mode it learned is a
    single int, and the ledger opens a session per call).
    """

    def __init__(
        self,
        model: str,
        ledger: Ledger,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        max_usd_per_day: float | None = None,
        prices: Mapping[str, Price] | None = None,
        default_price: Price = DEFAULT_PRICE,
        max_attempts: int = 6,
        backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
        timeout_s: float = 120.0,
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
            raise LLMNotConfigured("no LLM endpoint: set OPENAI_API_KEY (and OPENAI_BASE_URL for other servers)")
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        import openai  # here, not at module level: the CLI must start without it

        # A local server (vLLM, Ollama) may need no key, but the SDK insists on one.
        self._openai: OpenAI = openai.OpenAI(
            base_url=base_url, api_key=api_key or "not-needed", max_retries=0, timeout=timeout_s
        )
        self.model = model
        self.ledger = ledger
        self.base_url = str(self._openai.base_url)
        self.max_usd_per_day = max_usd_per_day
        self.prices: dict[str, Price] = {**PRICES, **(prices or {})}
        self.price = price_for(model, self.prices, default_price)
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.timeout_s = timeout_s
        self.repair_rounds = repair_rounds
        self.temperature = temperature
        self.max_output_tokens = {**DEFAULT_MAX_OUTPUT_TOKENS, **(max_output_tokens or {})}
        self._sleep = sleep
        self._clock = clock
        self._mode_index = 0
        self._tokens_key = "max_tokens"  # the widest-supported name; "max_completion_tokens" once refused

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

    def spent_today(self) -> float:
        """Dollars spent on LLM calls since UTC midnight, by every client sharing the ledger."""
        return self.ledger.spent_usd(utc_day_start(self._clock()))

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
        (retries exhausted) or `LLMRequestRejected` (the endpoint refuses the request in every mode).
        """
        rejections: list[str] = []
        for index in range(self._mode_index, len(MODES)):
            try:
                return self._complete_in_mode(MODES[index], purpose, messages, schema, name, hypothesis_id)
            except _ModeRejected as r:
                rejections.append(f"{MODES[index]}: {r}")
                if r.explicit:  # the endpoint named the parameter it lacks: no need to ask again
                    self._mode_index = max(self._mode_index, index + 1)
        raise LLMRequestRejected(purpose, None, " | ".join(rejections))

    # --- modes ----------------------------------------------------------------------------------

    def _body(self, mode: Mode, purpose: str, messages: list[Mapping[str, Any]],
              schema: Mapping[str, Any] | None = None, name: str = "") -> dict[str, Any]:
        # every request bounds its answer: a small local model left unbounded rambles until the timeout
        body: dict[str, Any] = {"model": self.model, "messages": messages, self._tokens_key:
                                self.max_output_tokens.get(purpose, DEFAULT_MAX_OUTPUT_TOKENS["default"])}
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
        answer: str | None = None
        for round_ in range(self.repair_rounds + 1):
            completion = self._send(purpose, hypothesis_id, mode, self._body(mode, purpose, convo, schema, name))
            self._mode_index = max(self._mode_index, MODES.index(mode))  # this endpoint accepts this mode
            message = completion.choices[0].message
            if getattr(message, "refusal", None):
                raise LLMOutputError(purpose, name, errors + [f"the model refused: {message.refusal}"], None)
            answer = _answer_text(message)
            try:
                obj = extract_json_object(answer)
                validate(obj, schema)
                return obj
            except InvalidOutput as e:
                errors.append(str(e))
                if round_ == self.repair_rounds:
                    break
                repair = prompts.render("json_repair", error=str(e), schema=schema_text)
                convo = [*convo, {"role": "assistant", "content": answer}, {"role": "user", "content": repair}]
        raise LLMOutputError(purpose, name, errors, answer)

    # --- one request, with retries --------------------------------------------------------------

    def _check_budget(self) -> None:
        if self.max_usd_per_day is None:
            return
        spent = self.spent_today()
        if spent >= self.max_usd_per_day:
            raise BudgetExceeded(spent, self.max_usd_per_day)

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None and retry_after >= 0:
            return min(retry_after, self.max_backoff_s)
        ceiling = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
        return ceiling / 2 + random.uniform(0, ceiling / 2)  # jitter: drivers don't retry in lockstep

    def _send(self, purpose: str, hypothesis_id: str | None, mode: Mode, body: dict[str, Any]) -> ChatCompletion:
        """POST one chat completion, retrying transient failures; one ledger row per attempt."""
        import openai

        request_json = json.dumps(body, ensure_ascii=False)
        last_error = ""
        for attempt in range(1, self.max_attempts + 1):
            self._check_budget()
            call = LLMCall(ts=self._clock(), purpose=purpose, hypothesis_id=hypothesis_id, model=self.model,
                           mode=mode, attempt=attempt, request_json=request_json)
            retry_after: float | None = None
            started = time.monotonic()
            try:
                raw = self._openai.chat.completions.with_raw_response.create(**body, timeout=self.timeout_s)
            except openai.APITimeoutError:
                last_error = f"timeout after {self.timeout_s:g}s"
            except openai.APIConnectionError as e:
                last_error = f"connection error: {e.__cause__ or e}"
            except openai.APIStatusError as e:
                status, text, message = e.status_code, e.response.text, _error_message(e)
                last_error = f"HTTP {status}: {message}"
                call.status_code, call.response_text = status, text
                self._record(call, started, error=last_error)
                if status in (400, 422) and "max_tokens" in body and "max_completion_tokens" in f"{message} {text}":
                    # OpenAI's reasoning models take the bound under its newer name: use it from now on
                    self._tokens_key = "max_completion_tokens"
                    body["max_completion_tokens"] = body.pop("max_tokens")
                    request_json = json.dumps(body, ensure_ascii=False)
                    continue
                rejected = _mode_rejection(mode, status, f"{message} {text}")
                if rejected is not None:
                    raise _ModeRejected(last_error, explicit=rejected) from None
                if status not in RETRYABLE_STATUS and status < 500:
                    raise LLMRequestRejected(purpose, status, message) from None
                retry_after = _retry_after(e.response.headers)
            else:
                call.status_code, call.response_text = raw.http_response.status_code, raw.http_response.text
                try:
                    completion = raw.parse()
                    if not completion.choices:
                        raise ValueError("no choices")
                except Exception as e:  # a 200 whose body is not a chat completion: a broken proxy
                    last_error = f"malformed response: {e}"
                else:
                    self._account(call, completion, request_json)
                    self._record(call, started, error=None)
                    return completion
            if call.id is None:
                self._record(call, started, error=last_error)
            if attempt < self.max_attempts:
                self._sleep(self._delay(attempt, retry_after))
        raise LLMUnavailable(purpose, self.max_attempts, last_error)

    def _account(self, call: LLMCall, completion: ChatCompletion, request_json: str) -> None:
        usage = completion.usage
        if usage is not None:
            call.prompt_tokens, call.completion_tokens = usage.prompt_tokens or 0, usage.completion_tokens or 0
        else:  # some servers omit usage; ~4 characters a token keeps the cap meaningful
            call.prompt_tokens = len(request_json) // 4
            call.completion_tokens = len(call.response_text or "") // 4
        call.usd = self.price.cost(call.prompt_tokens, call.completion_tokens)

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


def _answer_text(message: Any) -> str:
    """The text holding the JSON: the forced tool call's arguments, else the message content."""
    for call in getattr(message, "tool_calls", None) or []:
        function = getattr(call, "function", None)
        if function is not None and function.arguments:
            return str(function.arguments)
    return message.content or ""


def _append_to_last_user(messages: list[Mapping[str, Any]], text: str) -> list[Mapping[str, Any]]:
    """Add an instruction to the final user message (two user turns in a row break some chat
    templates), or as a new user message when the conversation does not end with plain user text."""
    out = list(messages)
    if out and out[-1].get("role") == "user" and isinstance(out[-1].get("content"), str):
        out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n\n{text}"}
        return out
    return [*out, {"role": "user", "content": text}]
