"""A real HTTP server on 127.0.0.1 speaking OpenAI's chat-completions protocol, scripted by tests.

Why a server and not a mock: the client under test is the real openai SDK, so what is exercised is
what production does — HTTP status codes, error bodies, headers, timeouts, the SDK's parsing. Each
request to `POST /v1/chat/completions` consumes the next scripted `Step` (an answer, a tool call, an
error, a stall, a dropped connection) and is recorded, so tests assert on what the agent sent.

    with FakeOpenAI([rate_limited(retry_after=0), content({"title": "x"})]) as server:
        client = LLMClient("gpt-4.1-mini", ledger, **server.client_kwargs())
        ...
        assert len(server.requests) == 2

A request with `stream: true` is answered as OpenAI streams: server-sent events, one chunk per
"token" (four characters of the answer), then the finish reason, the usage chunk when the request
asked for it (`stream_options.include_usage`), and `[DONE]`. A step's `rate` paces the tokens (so
many a second), `stall_after` stops writing after that many tokens for `stall_s` seconds; without
them the whole stream is written at once.

Endpoints that lack a capability are modelled by flags rather than script steps:
`supports_response_format=False` answers any request carrying `response_format` with OpenAI's 400
error body, `supports_tools=False` likewise for `tools`, `supports_stream_options=False` likewise
for `stream_options`; those requests are recorded but consume no step. `streams=False` is a server
that ignores `stream` and sends every answer whole, as one JSON body.
When the script runs out, the server answers 500 "script exhausted", which a test sees as a failure.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Step:
    """One scripted behaviour of the server for one request."""

    kind: str  # content | tool_call | error | sleep | drop | raw
    text: str | None = None  # content, tool-call arguments, or a raw 200 body
    tool_name: str | None = None
    status: int = 200
    error: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    then: Step | None = None
    usage: tuple[int, int] | None = None  # (prompt_tokens, completion_tokens); None: from lengths
    rate: float | None = None  # streamed tokens per second; None: all at once
    stall_after: int | None = None  # streamed: stop writing after this many tokens ...
    stall_s: float = 0.0  # ... for this long
    finish: str | None = None  # the finish reason; None: "stop" ("tool_calls" for a tool call)


TOKEN_CHARS = 4  # a streamed "token" is this many characters of the answer


def tokens(text: str) -> list[str]:
    """The answer as the server streams it: one piece per token."""
    return [text[i:i + TOKEN_CHARS] for i in range(0, len(text), TOKEN_CHARS)] or [""]


def _as_text(answer: str | dict[str, Any] | list[Any]) -> str:
    return answer if isinstance(answer, str) else json.dumps(answer)


def content(answer: str | dict[str, Any], usage: tuple[int, int] | None = None, *, rate: float | None = None,
            stall_after: int | None = None, stall_s: float = 0.0, finish: str | None = None) -> Step:
    """Answer with `message.content` (a dict is sent as its JSON text); streamed at `rate` tokens a
    second when asked to stream, stalling `stall_s` after `stall_after` tokens."""
    return Step("content", text=_as_text(answer), usage=usage, rate=rate, stall_after=stall_after, stall_s=stall_s,
                finish=finish)


def garbage(text: str = "Sure! Here is my idea: use a bigger model, it will be great.") -> Step:
    """Answer with text that holds no usable JSON."""
    return Step("content", text=text)


def tool_call(arguments: str | dict[str, Any], name: str | None = None, usage: tuple[int, int] | None = None) -> Step:
    """Answer with a tool call (name defaults to the one the request forced)."""
    return Step("tool_call", text=_as_text(arguments), tool_name=name, usage=usage)


def error(status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
          code: str | None = None, headers: dict[str, str] | None = None) -> Step:
    """An HTTP error with OpenAI's error body: {"error": {message, type, param, code}}."""
    body = {"message": message, "type": type, "param": param, "code": code}
    return Step("error", status=status, error=body, headers=headers or {})


def reject_response_format() -> Step:
    return error(400, "Invalid parameter: 'response_format' of type 'json_schema' is not supported with this model.",
                 param="response_format")


def reject_tools() -> Step:
    return error(400, "Invalid parameter: 'tools' is not supported with this model.", param="tools")


def rate_limited(retry_after: float | None = 0) -> Step:
    headers = {} if retry_after is None else {"retry-after": f"{retry_after:g}"}
    return error(429, "Rate limit reached for requests. Please try again later.", type="requests",
                 code="rate_limit_exceeded", headers=headers)


def server_error(status: int = 500) -> Step:
    return error(status, "The server had an error while processing your request. Sorry about that!",
                 type="server_error")


def reject_stream_options() -> Step:
    return error(400, "Unrecognized request argument supplied: stream_options", param="stream_options")


def stall(seconds: float, then: Step | None = None) -> Step:
    """Sleep `seconds` before answering with `then` (past the client's timeout, nobody reads it)."""
    return Step("sleep", seconds=seconds, then=then or server_error())


def drop() -> Step:
    """Close the connection without answering."""
    return Step("drop")


def raw(body: str, status: int = 200) -> Step:
    """Send `body` verbatim: a broken proxy's idea of a chat completion."""
    return Step("raw", text=body, status=status)


class FakeOpenAI:
    """The server. Start with `with FakeOpenAI(script) as server:` or `start()`/`stop()`."""

    def __init__(self, script: Iterable[Step] = (), *, supports_response_format: bool = True,
                 supports_tools: bool = True, supports_stream_options: bool = True, streams: bool = True,
                 api_key: str = "sk-test-fake"):
        self.supports_response_format = supports_response_format
        self.supports_tools = supports_tools
        self.supports_stream_options = supports_stream_options
        self.streams = streams
        self.api_key = api_key
        self.requests: list[dict[str, Any]] = []  # every request body received, in order
        self.request_headers: list[dict[str, str]] = []
        self._script: deque[Step] = deque(script)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._ids = 0

    # --- control ---------------------------------------------------------------------------------

    def script(self, *steps: Step) -> FakeOpenAI:
        """Append steps to the script."""
        with self._lock:
            self._script.extend(steps)
        return self

    @property
    def remaining(self) -> int:
        with self._lock:
            return len(self._script)

    @property
    def url(self) -> str:
        assert self._server is not None, "server not started"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/v1"

    def env(self) -> dict[str, str]:
        """The environment that points an OpenAI client here."""
        return {"OPENAI_BASE_URL": self.url, "OPENAI_API_KEY": self.api_key}

    def client_kwargs(self) -> dict[str, Any]:
        return {"base_url": self.url, "api_key": self.api_key, "env": {}}

    def start(self) -> FakeOpenAI:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        server.daemon_threads = True
        server.fake = self  # type: ignore[attr-defined]
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()  # wakes stalled handlers
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> FakeOpenAI:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    # --- behaviour -------------------------------------------------------------------------------

    def _next_step(self, body: dict[str, Any]) -> Step:
        if "response_format" in body and not self.supports_response_format:
            return reject_response_format()
        if "tools" in body and not self.supports_tools:
            return reject_tools()
        if "stream_options" in body and not self.supports_stream_options:
            return reject_stream_options()
        with self._lock:
            if self._script:
                return self._script.popleft()
        return error(500, "fake_openai: script exhausted", type="server_error")

    def _next_id(self) -> int:
        with self._lock:
            self._ids += 1
            return self._ids

    @staticmethod
    def _tool_name(body: dict[str, Any], step: Step) -> str:
        return step.tool_name or ((body.get("tool_choice") or {}).get("function") or {}).get("name") \
            or (body.get("tools") or [{}])[0].get("function", {}).get("name", "answer")

    @staticmethod
    def _usage(body: dict[str, Any], step: Step) -> dict[str, int]:
        if step.usage is not None:
            prompt_tokens, completion_tokens = step.usage
        else:
            prompt_tokens = max(1, len(json.dumps(body.get("messages", []))) // 4)
            completion_tokens = len(tokens(step.text or ""))
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def _completion(self, body: dict[str, Any], step: Step) -> dict[str, Any]:
        n = self._next_id()
        text = step.text or ""
        if step.kind == "tool_call":
            message: dict[str, Any] = {
                "role": "assistant", "content": None, "refusal": None,
                "tool_calls": [{"id": f"call_{n}", "type": "function",
                                "function": {"name": self._tool_name(body, step), "arguments": text}}],
            }
            finish = step.finish or "tool_calls"
        else:
            message = {"role": "assistant", "content": text, "refusal": None}
            finish = step.finish or "stop"
        return {
            "id": f"chatcmpl-fake{n}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "unknown"),
            "system_fingerprint": "fp_fake",
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": self._usage(body, step),
        }

    def _chunks(self, body: dict[str, Any], step: Step) -> Iterable[dict[str, Any] | float]:
        """The stream of one answer: chunks, and between them the seconds to wait before the next."""
        n = self._next_id()
        head = {"id": f"chatcmpl-fake{n}", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": body.get("model", "unknown"), "system_fingerprint": "fp_fake"}

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

        tool = step.kind == "tool_call"
        if tool:
            yield chunk({"role": "assistant", "content": None, "tool_calls": [
                {"index": 0, "id": f"call_{n}", "type": "function",
                 "function": {"name": self._tool_name(body, step), "arguments": ""}}]})
        else:
            yield chunk({"role": "assistant", "content": ""})
        for i, piece in enumerate(tokens(step.text or "")):
            if step.stall_after is not None and i == step.stall_after:
                yield float(step.stall_s)
            elif step.rate and i:
                yield 1.0 / step.rate
            delta = {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]} if tool else {"content": piece}
            yield chunk(delta)
        yield chunk({}, step.finish or ("tool_calls" if tool else "stop"))
        if (body.get("stream_options") or {}).get("include_usage"):
            yield {**head, "choices": [], "usage": self._usage(body, step)}


class _Handler(BaseHTTPRequestHandler):
    server_version = "fake-openai/1.0"

    def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
        pass

    def do_POST(self) -> None:
        fake: FakeOpenAI = self.server.fake  # type: ignore[attr-defined]
        if not self.path.rstrip("/").endswith("/chat/completions"):
            self._send_json(404, {"error": {"message": f"unknown path {self.path}", "type": "invalid_request_error",
                                            "param": None, "code": "unknown_url"}})
            return
        length = int(self.headers.get("content-length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except json.JSONDecodeError as e:
            self._send_json(400, {"error": {"message": f"bad JSON: {e}", "type": "invalid_request_error",
                                            "param": None, "code": None}})
            return
        with fake._lock:
            fake.requests.append(body)
            fake.request_headers.append({k.lower(): v for k, v in self.headers.items()})
        self._act(fake, body, fake._next_step(body))

    def _act(self, fake: FakeOpenAI, body: dict[str, Any], step: Step) -> None:
        try:
            if step.kind == "sleep":
                if fake._stopping.wait(step.seconds):
                    return
                self._act(fake, body, step.then or server_error())
            elif step.kind == "drop":
                self.close_connection = True
                self.connection.close()
            elif step.kind == "error":
                self._send_json(step.status, {"error": step.error}, step.headers)
            elif step.kind == "raw":
                self._send_bytes(step.status, (step.text or "").encode(), "text/plain")
            elif body.get("stream") and fake.streams:
                self._stream(fake, fake._chunks(body, step))
            else:
                self._send_json(200, fake._completion(body, step))
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass  # the client gave up (timeout) before we answered

    def _stream(self, fake: FakeOpenAI, chunks: Iterable[dict[str, Any] | float]) -> None:
        """Server-sent events, paced by the waits between chunks; the connection's end ends the body."""
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.end_headers()
        self.close_connection = True
        due = time.monotonic()
        for item in chunks:
            if isinstance(item, float):
                due += item
                if fake._stopping.wait(max(0.0, due - time.monotonic())):
                    return
                continue
            self.wfile.write(f"data: {json.dumps(item)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def _send_json(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        self._send_bytes(status, json.dumps(payload).encode(), "application/json", headers)

    def _send_bytes(self, status: int, data: bytes, ctype: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)
