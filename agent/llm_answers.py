"""An LLM's answer as the client reads it: streamed chunks put back together (`Assembly`), a whole
chat completion read leniently, and the first JSON object in its text, checked against a schema.
A body that is no chat completion, or JSON that does not parse or fit, is `LLMOutputError`; for the
JSON, its message is what the repair prompt sends back."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent.errors import LLMOutputError


@dataclass
class Answer:
    """One answer as the client uses it, streamed or sent whole.

    `text` holds the JSON (the forced tool call's arguments, else the content); tokens are the
    server's `usage`, None where it gave none; `pieces` counts the streamed deltas that carried text
    (about one token each); `first_token_s` is None when nothing streamed. `completion` is the answer
    as one chat completion (a stream assembled), what the ledger keeps."""

    text: str = ""
    refusal: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    pieces: int = 0
    first_token_s: float | None = None
    completion: dict[str, Any] | None = None
    cut: str | None = None  # a timeout: the one line it is (the rest is what arrived before it)


_FENCE = re.compile(r"```[A-Za-z0-9_-]*[ \t]*\n?(.*?)```", re.DOTALL)
_MAX_DECODE_STARTS = 200


def extract_json_object(text: str) -> dict[str, Any]:
    """The first JSON object in a model's answer: inside a code fence if there is one, else anywhere.

    Raises `LLMOutputError` with the parser's message, which is what the model needs to fix it.
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
    raise LLMOutputError(first_error or "no JSON object found in the answer")


def validate(obj: Any, schema: Mapping[str, Any]) -> None:
    """Raise `LLMOutputError` naming where `obj` breaks `schema` (JSON Schema 2020-12)."""
    from jsonschema import Draft202012Validator

    errors = sorted(Draft202012Validator(schema).iter_errors(obj), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"at {'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in errors[:5]]
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        raise LLMOutputError("the JSON does not match the schema: " + "; ".join(lines) + more)


def read_whole(response: Any) -> str:
    """The body of an answer sent whole; a read that fails is a dropped connection."""
    import openai

    try:
        return response.read().decode("utf-8", "replace")
    except Exception as e:  # the transport's own error types differ between SDK versions
        raise openai.APIConnectionError(message=f"reading the answer: {e}", request=response.request) from e


def whole_answer(text: str) -> Answer:
    """An answer sent as one chat completion (a server that ignores `stream`), read as leniently as
    the SDK reads one."""
    from openai.types.chat import ChatCompletion

    try:
        data = json.loads(text)
        completion = ChatCompletion.construct(**data)
        choice = completion.choices[0]
        usage = completion.usage
        return Answer(text=answer_text(choice.message), refusal=getattr(choice.message, "refusal", None),
                      finish_reason=choice.finish_reason, prompt_tokens=usage.prompt_tokens if usage else None,
                      completion_tokens=usage.completion_tokens if usage else None, completion=data)
    except Exception as e:
        raise LLMOutputError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None


class Assembly:
    """A streamed answer put back together, chunk by chunk: content, refusal, tool-call arguments,
    the finish reason, the usage chunk, and when the first token came."""

    def __init__(self, started: float):
        self.started = started
        self.first_token_s: float | None = None
        self.content: list[str] = []
        self.refusal: list[str] = []
        self.tools: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.usage: Any = None
        self.pieces = 0
        self.choices = 0  # chunks that carried the first choice
        self.head: dict[str, Any] = {}

    def add(self, chunk: Any) -> None:
        if not hasattr(chunk, "choices"):
            raise LLMOutputError(f"a stream event that is no chat completion chunk: {str(chunk)[:100]}")
        self.head = self.head or {"id": chunk.id, "model": chunk.model, "created": chunk.created}
        if chunk.usage is not None:
            self.usage = chunk.usage
        choice = next((c for c in chunk.choices or [] if c.index == 0), None)
        if choice is None:
            return
        self.choices += 1
        delta = choice.delta
        wrote = False
        if delta.content:
            self.content.append(delta.content)
            wrote = True
        if getattr(delta, "refusal", None):
            self.refusal.append(delta.refusal)
            wrote = True
        for t in delta.tool_calls or []:
            slot = self.tools.setdefault(t.index, {"id": None, "name": "", "arguments": []})
            slot["id"] = slot["id"] or t.id
            if t.function is not None:
                slot["name"] += t.function.name or ""
                if t.function.arguments:
                    slot["arguments"].append(t.function.arguments)
                    wrote = True
        if wrote:
            self.pieces += 1
            if self.first_token_s is None:
                self.first_token_s = time.monotonic() - self.started
        self.finish_reason = choice.finish_reason or self.finish_reason

    def answer(self) -> Answer:
        content = "".join(self.content)
        calls = [{"id": t["id"], "type": "function",
                  "function": {"name": t["name"], "arguments": "".join(t["arguments"])}}
                 for _, t in sorted(self.tools.items())]
        message: dict[str, Any] = {"role": "assistant", "content": content if self.content or not calls else None,
                                   "refusal": "".join(self.refusal) or None}
        if calls:
            message["tool_calls"] = calls
        usage = self.usage
        completion = {**self.head, "object": "chat.completion",
                      "choices": [{"index": 0, "message": message, "finish_reason": self.finish_reason}]
                      if self.choices else [],
                      "usage": usage.model_dump(mode="json", exclude_unset=True) if usage is not None else None}
        text = next((c["function"]["arguments"] for c in calls if c["function"]["arguments"]), content)
        return Answer(text=text, refusal=message["refusal"], finish_reason=self.finish_reason,
                      prompt_tokens=usage.prompt_tokens if usage is not None else None,
                      completion_tokens=usage.completion_tokens if usage is not None else None,
                      pieces=self.pieces, first_token_s=self.first_token_s, completion=completion)


def answer_text(message: Any) -> str:
    """The text holding the JSON: the forced tool call's arguments, else the message content."""
    for call in getattr(message, "tool_calls", None) or []:
        function = getattr(call, "function", None)
        if function is not None and function.arguments:
            return str(function.arguments)
    return message.content or ""
