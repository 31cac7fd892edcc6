"""Who has the ideas: the policy interface, what it is given and returns, and the registry.

A policy proposes, implements, decides within the choices the gate allows, and (optionally)
words the summary. It never computes a number that reaches a human: those come from the gate.
Each policy is a module of its own: `agent.policy_llm` (an LLM over `prompts/`) and
`agent.policy_offline` (the `[search_space]`, no network); a new one is a module and a line in
`POLICIES`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from agent.errors import NotConfigured
from agent.workspace import FileEdit
from pipeline.api import Registry, UserError

CONFIG_FILE = "config.toml"


@dataclass
class Proposal:
    title: str
    rationale: str
    expected_effect: str
    expected_tasks: list[str]
    change: dict[str, Any] | None = None  # search-space values (offline policy)
    plan: list[dict[str, Any]] | None = None  # ready edits (offline policy)
    notes: str = ""


@dataclass
class Choice:
    decision: str
    rationale: str
    follow_up: str = ""


@dataclass
class Context:
    """What a policy may read: filled by the graph from the store and the baseline commit."""

    lab_name: str
    program: str
    metric: str
    tasks: list[str]
    editable: list[str]
    baseline: str  # tag, commit, score line
    files: dict[str, str]  # the baseline's editable files
    history: list[dict[str, Any]] = field(default_factory=list)  # the latest decided (graph.context.HISTORY_ROWS)
    history_left_out: dict[str, int] = field(default_factory=dict)  # the earlier ones not listed: decision -> count
    comments: list[str] = field(default_factory=list)
    search_space: dict[str, list[Any]] = field(default_factory=dict)
    tried_states: list[dict[str, Any]] = field(default_factory=list)  # the hypotheses' search values
    key_costs: dict[str, int] = field(default_factory=dict)  # search key -> stages its change re-runs
    baseline_states: list[dict[str, Any]] = field(default_factory=list)  # earlier baselines' search values
    plateau: int | None = None  # measured hypotheses in a row without a promotion, once past [agent] plateau_after
    directions: list[str] = field(default_factory=list)  # one line per direction tried (agent.directions), when proposing


@dataclass
class Feedback:
    """Why the previous implementation was rejected, for a repair round."""

    stage: str  # paths | apply | compile | smoke
    error: str
    round: int  # this repair round, from 1
    max_rounds: int
    previous: list[FileEdit] = field(default_factory=list)  # the rejected edits


class Policy(Protocol):
    name: str
    can_repair: bool  # whether `implement` can answer a rejection with other edits

    def propose(self, ctx: Context) -> Proposal | None: ...

    def implement(self, ctx: Context, hyp: Any, feedback: Feedback | None) -> list[FileEdit]: ...

    def decide(self, ctx: Context, hyp: Any, verdict: str, evidence: str, allowed: list[str], look: str) -> Choice: ...


# ----------------------------------------------------------------------------- registry

PolicyFactory = Callable[[Any, Any], Policy]
"""(lab, store) → a policy; raises `NotConfigured` where it cannot work here (no endpoint)."""


# name → factory, in order of preference when none is named: the first that is configured wins.
# A new policy is one module and one line here (a plugin or a test: `POLICIES.register(name, factory)`).
POLICIES: Registry[PolicyFactory] = Registry("policy", {"llm": "agent.policy_llm:make",
                                                        "offline": "agent.policy_offline:make"})


def make_policy(lab: Any, store: Any, name: str | None = None) -> Policy:
    """The policy `name`, or the first configured one (the LLM with an endpoint, else offline)."""
    if name is not None:
        factory = POLICIES.get(name)
        try:
            return factory(lab, store)
        except NotConfigured as e:
            raise UserError(f"policy {name!r}: {e}") from None
    for each in POLICIES:
        try:
            return POLICIES.get(each)(lab, store)
        except NotConfigured:
            continue
    return POLICIES.get("offline")(lab, store)  # always configured


def llm_client(policy: Any) -> Any:
    """The `agent.llm.LLMClient` a policy talks through, or None (the offline policy, a toy): the
    loop guards its spend and outages, and summaries are LLM-written where there is one. Not part
    of the interface: a policy backed by an LLM exposes it as `client`."""
    return getattr(policy, "client", None)
