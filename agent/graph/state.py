"""What a hypothesis's thread carries (`State`) and what its graph runs with (`Services`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, TypedDict

from agent.lifecycle import Status
from agent.policy import Policy
from agent.records import Records
from agent.workspace import Workspace
from pipeline.api import Experiment, Lab, Verdict

class State(TypedDict, total=False):
    """A thread's state: the hypothesis, and where it is in its lifecycle. The graph routes on
    `phase` alone (the named routers below); `agent.lifecycle.project` writes the same step onto the
    hypothesis's row (`status`, `look`, `verdict`), which is what the rest of the tool reads."""
    hypothesis_id: int
    phase: Status  # a checkpoint keeps the string: read with `phase_of` (agent.graph.step)
    look: int | None  # challenger runs wanted at the current look
    verdict: Verdict | None  # the gate's verdict at the last look judged (read with `verdict_of`)
    champion: str | None  # the baseline tag a promotion made, until its re-verification is recorded


LOOK, HOLD = "look", "hold"  # the kinds of a thread's interrupt: waiting for runs, or for a human


@dataclass
class Services:
    lab: Lab
    store: Any  # pipeline.store.Store
    records: Records
    workspace: Workspace
    policy: Policy
    supervised: bool = False
    smoke: bool = True
    stop: threading.Event | None = None  # set when the loop is asked to stop: long steps give up early
    experiment: Experiment | None = None  # the measurement API; made from lab and store if not given
    # the lab's progress chart: redrawn at every decision (None), or at most this often (and at each
    # promotion): `autoresearch run` sets it, where thousands of decisions an hour may come
    progress_every_s: float | None = None
    progress_drawn_at: float | None = None  # when this loop last drew it (time.monotonic)
    progress_stale: bool = False  # a decision since was left out of it (drawn when the loop stops)
    painter: Any = None  # agent.pictures.Painter: the loop draws its pictures in a process of its own
    effects: dict[int, dict[str, Any]] = field(default_factory=dict)  # `build_context`'s, of done hypotheses

    def __post_init__(self) -> None:
        if self.experiment is None:
            self.experiment = Experiment(self.lab, self.store)
