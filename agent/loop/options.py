"""What a loop is asked to do (`LoopOptions`), how many hypotheses it keeps in flight, and its policy."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from agent.policy import make_policy
from pipeline.api import ExecutorOptions, Lab

IN_FLIGHT_PER_FILL = 3  # the derived max_in_flight: at most this many times the hypotheses whose first looks fill the slots
QUEUE_DEPTH = 2  # ... started while fewer runs than this many times the slots (plus a first look) are outstanding


@dataclass
class LoopOptions:
    max_hypotheses: int | None = 3
    hours: float | None = None
    forever: bool = False
    executor: ExecutorOptions = field(default_factory=ExecutorOptions)  # where runs execute (--executor, --workers, ...)
    offline: bool = False
    policy: str | None = None  # a name in agent.policy.POLICIES; None: the first configured one
    supervised: bool = False
    smoke: bool = True
    pause_on_plateau: bool = False
    mlflow: str | None = None  # a tracking URI: each hypothesis is exported as it is decided
    notify: tuple[str, ...] = ()  # `--notify URL`s, beside research.toml's [notify] targets (agent.notify)
    db: str | None = None
    idle_poll_s: float = 10.0


def in_flight_room(slots: int, first_look_runs: int, in_flight: int, outstanding: int) -> bool:
    """The derived `max_in_flight`: whether another hypothesis should start.

    Where one first look (tasks × its runs) already has as many runs as there are slots, one
    hypothesis at a time: the slots are full but for the tail of each look, and no decision waits
    on a re-base. Beyond that (a cluster), hypotheses start while the runs outstanding (queued,
    claimed, and a first look for each one not queued yet) are fewer than QUEUE_DEPTH × the slots
    plus one first look: the queue stays a round of stages deeper than the slots, so a slot freed
    at a look's tail finds a run while the loop's thread is busy deciding; at most
    IN_FLIGHT_PER_FILL × slots / first look of them (each re-base a promotion causes costs a
    hypothesis in flight its looks so far: more in flight buys utilisation with re-measurements)."""
    if in_flight == 0:
        return True
    if slots <= first_look_runs:
        return False
    if in_flight >= IN_FLIGHT_PER_FILL * math.ceil(slots / first_look_runs):
        return False
    return outstanding < QUEUE_DEPTH * slots + first_look_runs


def choose_policy(lab: Lab, store: Any, offline: bool, name: str | None = None):
    """`--policy NAME`, `--offline` (= offline), or the first configured policy of the registry."""
    return make_policy(lab, store, "offline" if offline else name)
