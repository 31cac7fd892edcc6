"""The one vocabulary of what happened to a run and to each of its stages, and what each word means.

Three grains, one module, each a `StrEnum` whose members are the strings the store has always kept
(an old database reads the same, a member compares equal to its string):

- `RunStatus`, a run's place in the queue (`Run.status`): queued → running → done | failed.
- `StageOutcome`, what one stage of one run came to (`StageExec.outcome`), from the executor's
  report of the process (`pipeline.executors.classify`) or the driver's own knowledge (served from
  the cache, shared with another run, never started because a stage it needs failed, lost when a
  driver died).
- `Verdict`, what the gate said of a hypothesis at a look (`pipeline.gate.verdict` decides it).
- `ResultOutcome`, what a run's result says (`Result.outcome`): a metric, the method's failure (a
  result the gate sees), or the machinery's (left out of every comparison, retried first).

The predicates and the tuples below are the meanings the driver, the goodput and the pages share,
so no module keeps its own list of strings. Standard library only. What each stage outcome means,
and what the driver records a run whose stage came to it as:

    StageOutcome        finished  method failure  infra  served  executed  → ResultOutcome
    running                 no
    ok                      yes                                     yes       ok
    cache_hit, shared       yes                            yes                ok
    method, timeout         yes        yes                          yes       method_failure
    upstream_failed         yes        yes (upstream)                         method_failure
    infra, lost, cancelled  yes                        yes          yes       infra_failure
"""

from __future__ import annotations

from enum import StrEnum


class RunStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"  # a result is recorded: a metric or a method failure
    FAILED = "failed"  # infrastructure failed it past its retries: an infra_failure result

    def is_finished(self) -> bool:
        return self in (RunStatus.DONE, RunStatus.FAILED)


class StageOutcome(StrEnum):
    RUNNING = "running"  # launched, not finished
    OK = "ok"  # executed and published
    CACHE_HIT = "cache_hit"  # its output existed already
    SHARED = "shared"  # waited on the same key computed for another run in this batch
    METHOD = "method"  # the branch's code failed: a result the gate sees
    TIMEOUT = "timeout"  # the branch's code ran past its limit: a method failure
    INFRA = "infra"  # the machinery failed (retried)
    LOST = "lost"  # the driver died while it ran
    CANCELLED = "cancelled"  # a graceful stop
    UPSTREAM_FAILED = "upstream_failed"  # a stage it needs failed: never started

    def is_method_failure(self) -> bool:
        """The branch's own failure (this stage's, not an upstream one's): its key fails again."""
        return self in METHOD_OUTCOMES

    def is_failure(self) -> bool:
        """This stage's own process failed (the method's or the machinery's): its log tells why."""
        return self.is_method_failure() or self in (StageOutcome.INFRA, StageOutcome.LOST)

    def is_served(self) -> bool:
        """No compute of its own: the cache or another run's execution served it."""
        return self in SERVED_OUTCOMES


class ResultOutcome(StrEnum):
    OK = "ok"  # a metric
    METHOD_FAILURE = "method_failure"  # the method's failure: a result the gate sees
    INFRA_FAILURE = "infra_failure"  # the machinery's: says nothing about the method

    def counts(self) -> bool:
        """Whether the result says something about the method (the gate, the datasets, the pairing)."""
        return self is not ResultOutcome.INFRA_FAILURE

    def run_status(self) -> RunStatus:
        return RunStatus.FAILED if self is ResultOutcome.INFRA_FAILURE else RunStatus.DONE


METHOD_OUTCOMES = (StageOutcome.METHOD, StageOutcome.TIMEOUT)
INFRA_OUTCOMES = (StageOutcome.INFRA, StageOutcome.LOST, StageOutcome.CANCELLED)
SERVED_OUTCOMES = (StageOutcome.CACHE_HIT, StageOutcome.SHARED)
EXECUTED_OUTCOMES = (StageOutcome.OK, *METHOD_OUTCOMES, *INFRA_OUTCOMES)


class Verdict(StrEnum):
    """The gate's verdict at a look (`pipeline.gate.verdict.decide`, whose module says the order of its
    rules): the agent may promote on `improvement` only and run the next look on `escalate` only."""

    improvement = "improvement"
    single_task = "single_task"
    harm = "harm"
    escalate = "escalate"
    futile = "futile"
    inconclusive = "inconclusive"
