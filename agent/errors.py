"""Every error of `agent/`, in one place (the pipeline's are in `pipeline.errors`, whose `UserError`
is the agent's too: a review action or a notification target that does not fit is one).

    AgentError                       the root: every error the agent raises on purpose (exit code 1)
    ├── EditRejected                 an implementation the loop refuses; `kind` is recorded
    ├── NotConfigured                a policy that cannot work here (no LLM endpoint): exit code 2
    ├── LLMError                     the LLM client's; `retryable`: asking again later may answer
    │   ├── BudgetExceeded           today's spend reached the cap; nothing was sent
    │   │   └── TokenBudgetExceeded  today's tokens reached `max_tokens_per_day` (a model without a price)
    │   ├── LLMUnavailable           429/5xx/timeouts/connection errors through every attempt (retryable)
    │   ├── LLMRequestRejected       the endpoint refused the request itself
    │   └── LLMOutputError           no usable answer after every repair round
    ├── PromptError                  a template missing, malformed, or filled with a value missing or
    │                                unused: exit code 2
    └── the client's own, never seen outside agent/llm.py:
        ├── InvalidOutput            one answer failed parsing or validation (the repair prompt's text)
        ├── RequestCut               a request given up on a timeout, with what arrived
        ├── ModeRejected             the endpoint refused this way of asking for structure
        └── MalformedAnswer          a 200 whose body is not a chat completion

Each class says its exit code (`exit_code`): the CLI exits with the code of what it caught.

Each module re-exports the errors it raises, so `from agent.llm import LLMUnavailable` works too.
"""

from __future__ import annotations

from typing import Any

from pipeline.api import PromotionConflict, UserError  # noqa: F401 (re-exported: the agent's are the pipeline's)


class AgentError(Exception):
    """The root of every error the agent raises on purpose (the pipeline's: `PipelineError`)."""

    exit_code = 1


class EditRejected(AgentError):
    """An edit the loop refuses; `kind` is recorded so `status` can count rejections by cause."""

    def __init__(self, kind: str, message: str):
        self.kind = kind
        super().__init__(message)


class NotConfigured(AgentError):
    """A policy that needs something this machine does not have (an LLM endpoint)."""

    exit_code = 2


class LLMError(AgentError):
    """Base of the client's errors. `retryable`: the same request may succeed later (the loop
    backs off and asks again); otherwise the answer is recorded as it is."""

    retryable = False


class BudgetExceeded(LLMError):
    """Today's (UTC) LLM spend reached `max_usd_per_day`; no request was sent."""

    def __init__(self, spent_usd: float, cap_usd: float):
        self.spent_usd, self.cap_usd = spent_usd, cap_usd
        super().__init__(f"LLM budget reached: ${spent_usd:.4f} spent today (UTC), cap ${cap_usd:.2f}/day")


class TokenBudgetExceeded(BudgetExceeded):
    """Today's (UTC) LLM tokens reached `[agent] max_tokens_per_day`; no request was sent."""

    def __init__(self, tokens: int, cap_tokens: int):
        self.tokens, self.cap_tokens = tokens, cap_tokens
        self.spent_usd, self.cap_usd = 0.0, 0.0
        LLMError.__init__(self, f"LLM budget reached: {tokens} tokens used today (UTC), cap {cap_tokens}/day "
                                "([agent] max_tokens_per_day)")


class LLMUnavailable(LLMError):
    """The endpoint kept failing (429, 5xx, timeouts, connection errors) through every attempt."""

    retryable = True

    def __init__(self, purpose: str, attempts: int, last_error: str):
        self.purpose, self.attempts, self.last_error = purpose, attempts, last_error
        super().__init__(f"{purpose}: LLM endpoint failed {attempts} attempt(s); last error: {last_error}")


class LLMRequestRejected(LLMError):
    """The endpoint refused the request itself (auth, unknown model, bad request): retrying won't help."""

    def __init__(self, purpose: str, status: int | None, message: str):
        self.purpose, self.status, self.message = purpose, status, message
        super().__init__(f"{purpose}: LLM request rejected (HTTP {status}): {message}")


class LLMOutputError(LLMError):
    """No usable answer: not JSON, or not matching the schema, after every repair round.

    `errors` holds what was wrong with each answer, `last_answer` the final raw text. The caller
    skips the hypothesis and records `str(exc)` as the reason.
    """

    def __init__(self, purpose: str, name: str, errors: list[str], last_answer: str | None):
        self.purpose, self.name, self.errors, self.last_answer = purpose, name, errors, last_answer
        detail = errors[-1] if errors else "no answer"
        super().__init__(f"{purpose}: no valid {name} after {len(errors)} answer(s): {detail}")


class PromptError(AgentError):
    """A prompt template is missing, malformed, or was filled with the wrong values."""

    exit_code = 2


class InvalidOutput(AgentError, ValueError):
    """One answer failed parsing or validation; the message is what the repair prompt sends back."""


class RequestCut(AgentError):
    """A request given up on a timeout; `answer` (an `agent.llm_answers.Answer`) holds what arrived, `key` the
    `[agent]` key that cut it."""

    def __init__(self, answer: Any, key: str, message: str):
        super().__init__(message)
        self.answer, self.key = answer, key


class ModeRejected(AgentError):
    """The endpoint refused this way of asking for structure; `explicit` when it named the parameter."""

    def __init__(self, message: str, explicit: bool):
        super().__init__(message)
        self.explicit = explicit


class MalformedAnswer(AgentError, ValueError):
    """A 200 whose body is not a chat completion (a broken proxy)."""


