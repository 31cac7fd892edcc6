"""Every error of `agent/`, in one place (the pipeline's are in `pipeline.errors`, whose `UserError`
is the agent's too: a prompt template, a review action or a notification target that does not fit
is one, exit code 2).

    AgentError                       the root: every error the agent raises on purpose (exit code 1);
    │                                raised as itself where nothing reacts by kind (a tracking server
    │                                that refuses one hypothesis's run: said, the others exported)
    ├── EditRejected                 an implementation the loop refuses; `kind` is recorded
    ├── NotConfigured                a policy that cannot work here (no LLM endpoint): exit code 2;
    │                                choosing a policy skips to the next one
    └── LLMError                     the LLM client's: the endpoint refuses the request (no retry);
        │                            `retryable`: asking again later may answer
        ├── BudgetExceeded           today's spend or tokens reached the cap; nothing was sent
        ├── LLMUnavailable           429/5xx/timeouts/connection errors through every attempt (retryable)
        ├── LLMOutputError           no usable answer: one answer (the client repairs or retries it),
        │                            or none after every repair round (the caller records it)
        └── ModeRejected             the endpoint refused this way of asking for structure (the
                                     client tries the next; never seen outside agent/llm.py)

Each class says its exit code (`exit_code`): the CLI exits with the code of what it caught.

Each module re-exports the errors it raises, so `from agent.llm import LLMUnavailable` works too.
"""

from __future__ import annotations

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
    """The client's errors; raised as itself when the endpoint refuses the request (auth, unknown
    model, bad request): retrying won't help. `retryable`: the same request may succeed later (the
    loop backs off and asks again); otherwise the answer is recorded as it is."""

    retryable = False


class BudgetExceeded(LLMError):
    """Today's (UTC) LLM spend reached `max_usd_per_day`, or its tokens `max_tokens_per_day` (a model
    without a price); no request was sent."""

    def __init__(self, used: float, cap: float, unit: str = "usd"):
        self.used, self.cap, self.unit = used, cap, unit
        if unit == "usd":
            super().__init__(f"LLM budget reached: ${used:.4f} spent today (UTC), cap ${cap:.2f}/day")
        else:
            super().__init__(f"LLM budget reached: {int(used)} tokens used today (UTC), cap {int(cap)}/day "
                             "([agent] max_tokens_per_day)")


class LLMUnavailable(LLMError):
    """The endpoint kept failing (429, 5xx, timeouts, connection errors) through every attempt."""

    retryable = True

    def __init__(self, purpose: str, attempts: int, last_error: str):
        self.purpose, self.attempts, self.last_error = purpose, attempts, last_error
        super().__init__(f"{purpose}: LLM endpoint failed {attempts} attempt(s); last error: {last_error}")


class LLMOutputError(LLMError):
    """No usable answer. Inside the client, one answer: JSON that does not parse or fit the schema (the
    message is what the repair prompt sends back) or a 200 whose body is no chat completion (a broken
    proxy: retried). To the caller, none after every repair round (`after_repairs`): `errors` holds
    what was wrong with each answer, `last_answer` the final raw text; the caller skips the
    hypothesis and records `str(exc)` as the reason."""

    def __init__(self, message: str, errors: list[str] | None = None, last_answer: str | None = None):
        self.errors, self.last_answer = list(errors or []), last_answer
        super().__init__(message)

    @classmethod
    def after_repairs(cls, purpose: str, name: str, errors: list[str], last_answer: str | None) -> LLMOutputError:
        detail = errors[-1] if errors else "no answer"
        return cls(f"{purpose}: no valid {name} after {len(errors)} answer(s): {detail}", errors, last_answer)


class ModeRejected(LLMError):
    """The endpoint refused this way of asking for structure; `explicit` when it named the parameter."""

    def __init__(self, message: str, explicit: bool):
        super().__init__(message)
        self.explicit = explicit
