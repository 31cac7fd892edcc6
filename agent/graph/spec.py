"""The graph as data: the routers (where a thread goes after each node, from its state alone), the
one phase → node table, `GraphSpec` (nodes and routers; a node is added from outside with
`insert_after`), and a thread's start and end (`claim`, `open_proposal`, `give_up`, `thread_input`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from agent.graph.nodes import Nodes
from agent.graph.state import Services, State
from agent.lifecycle import Decision, Status, project
from agent.records import Hypothesis, Records

END = "__end__"  # langgraph.graph.END, without importing langgraph where only the routers are needed


# the routers: where a thread goes after each node, from its state alone (named, so that a node can be
# put between two others by moving a router: `GraphSpec.insert_after`)

def from_start(s: State) -> str:
    """A new thread (the loop gives it the row's status as its phase), or one an earlier version
    ended while its hypothesis was still active: to the node that works in its phase. A hold goes
    through `summarize` first (it writes the summary the reviewer reads; written again, it is the
    same), so no path reaches `hold` without one."""
    return NODE_OF_PHASE.get(s.get("phase") or "", "reverify" if s.get("champion") else END)


NODE_OF_PHASE = {Status.QUEUED: "propose", Status.PROPOSING: "propose", Status.IMPLEMENTING: "implement",
                  Status.MEASURING: "evaluate", Status.DECIDING: "decide", Status.PROMOTING: "promote",
                  Status.HELD: "summarize", Status.SUMMARIZING: "summarize"}


def _routed(step: dict[str, str]) -> Callable[[State], str]:
    """A router: the node after this one for the phases it leaves the thread in (`step`), and for any
    other phase the node that works in it (`from_start`). A node re-run after a crash takes the row's
    update (`_replayed`), and the row may be any number of steps ahead of the checkpoint (a kill -9
    lands between a projection and the checkpoint; LangGraph writes checkpoints asynchronously by
    default, so one may be lost besides): the thread goes on from where the row is."""
    def route(s: State) -> str:
        return step.get(s.get("phase") or "") or from_start(s)

    return route


# the phases a node leaves its thread in, and the next node for each; any other phase: `from_start`
after_propose = _routed({Status.IMPLEMENTING: "implement", Status.SUMMARIZING: "summarize"})
after_implement = _routed({Status.MEASURING: "evaluate", Status.SUMMARIZING: "summarize"})
after_evaluate = _routed({Status.DECIDING: "decide", Status.MEASURING: "evaluate"})  # resumed early: waits again
after_decide = _routed({Status.MEASURING: "evaluate", Status.PROMOTING: "promote", Status.HELD: "summarize",
                        Status.SUMMARIZING: "summarize"})  # a hold is summarized first, then waits in `hold`
after_promote = _routed({Status.MEASURING: "evaluate", Status.SUMMARIZING: "summarize"})  # re-based: measured again
after_summarize = _routed({Status.HELD: "hold"})  # done: to `reverify` (a champion) or the end
after_hold = _routed({Status.PROMOTING: "promote", Status.SUMMARIZING: "summarize", Status.HELD: "hold"})
after_reverify = _routed({})  # a champion's thread waits again (resumed early), then ends


@dataclass
class GraphSpec:
    """The graph as data: its nodes and, for each, its router (`graph_spec` fills both). `build_graph` compiles it;
    a new step is a node and one `insert_after`, and no other node changes."""

    nodes: dict[str, Callable[[State], State]]
    routes: dict[str, Callable[[State], str]]

    def insert_after(self, after: str, name: str, node: Callable[[State], State]) -> None:
        """Put `node` right after `after`: it takes over `after`'s router, and `after` leads to it."""
        self.nodes[name] = node
        self.routes[name] = self.routes[after]
        self.routes[after] = lambda _s: name

    def compile(self, checkpointer: Any, projection: Records | None = None):
        from langgraph.graph import START, StateGraph

        g = StateGraph(State)
        for name, node in self.nodes.items():
            g.add_node(name, node if projection is None else _replayed(name, node, projection))
        g.add_conditional_edges(START, from_start, [*self.nodes, END])
        for name, router in self.routes.items():
            g.add_conditional_edges(name, router, [*self.nodes, END])
        return g.compile(checkpointer=checkpointer)


def graph_spec(svc: Services) -> GraphSpec:
    nodes = Nodes(svc)
    return GraphSpec(
        nodes={"propose": nodes.propose, "implement": nodes.implement, "evaluate": nodes.evaluate,
               "decide": nodes.decide, "promote": nodes.promote, "summarize": nodes.summarize, "hold": nodes.hold,
               "reverify": nodes.reverify},
        routes={"propose": after_propose, "implement": after_implement, "evaluate": after_evaluate,
                "decide": after_decide, "promote": after_promote, "summarize": after_summarize, "hold": after_hold,
                "reverify": after_reverify})


# the phases in which each node does its step: a row in any other phase had it done already
ENTRY_PHASES: dict[str, tuple[Status, ...]] = {
    "propose": (Status.QUEUED, Status.PROPOSING), "implement": (Status.IMPLEMENTING,),
    "evaluate": (Status.MEASURING,), "decide": (Status.DECIDING,), "promote": (Status.PROMOTING,),
    "summarize": (Status.SUMMARIZING, Status.HELD), "hold": (Status.HELD,), "reverify": (Status.DONE,)}


def _replayed(name: str, node: Callable[[State], State], records: Records) -> Callable[[State], State]:
    """A node run again after a crash between its projection and its checkpoint finds the row a step
    ahead (the row is written first, in a phase this node does not work in): the step is done, and
    its update is the row's. Every node's side effects come before its projection, so nothing of
    the step is lost, and nothing is done twice (a promotion, a re-base). A thread checkpointed by
    an earlier version, with no phase in its state, is judged by its row the same way. A node
    added from outside (`GraphSpec.insert_after`) has no entry phases and always runs."""
    entry = ENTRY_PHASES.get(name)

    def run(state: State) -> State:
        if entry is not None:
            h = records.get(state["hypothesis_id"])
            if h.status not in entry:
                return thread_input(h)
        out = node(state)
        if not state.get("phase") and "phase" not in out:  # a thread with no phase yet: the row's, for the routers
            out = {**out, "phase": records.get(state["hypothesis_id"]).status}
        return out

    run.__name__ = getattr(node, "__name__", name)
    return run


def build_graph(svc: Services, checkpointer: Any):
    """One hypothesis's graph, checkpointed by `checkpointer`:
    propose → implement → evaluate ⇄ decide → [promote] → summarize → [reverify]; decide → summarize
    → hold → promote (a held promotion); promote → evaluate (a re-based hypothesis)."""
    return graph_spec(svc).compile(checkpointer, projection=svc.records)


def claim(records: Records, h: Hypothesis) -> Hypothesis:
    """A queued hypothesis taken off the queue by the loop: its thread starts at its first node
    (`implement` for one with a title: a seed or a refinement; else `propose`)."""
    return project(records, h.id, {"phase": Status.IMPLEMENTING if h.title else Status.PROPOSING})


def open_proposal(records: Records, origin: str) -> Hypothesis:
    """An empty hypothesis whose thread proposes (the loop asks for one when it has room)."""
    h = records.add(Hypothesis(origin=origin))
    return project(records, h.id, {"phase": Status.PROPOSING})


def give_up(records: Records, hid: int, reason: str) -> Hypothesis:
    """A hypothesis whose graph failed too often (the loop counts): ended, rejected with the reason."""
    return project(records, hid, {"phase": Status.DONE}, decision=Decision.REJECT, reject_kind="internal_error",
                   reject_reason=reason, finished_at=time.time())


def thread_input(h: Hypothesis) -> State:
    """What a thread starts from (a new one, or one an earlier version ended): the row's lifecycle."""
    state: State = {"hypothesis_id": h.id, "phase": h.status, "look": h.look, "verdict": h.verdict}
    if h.promoted_tag:
        state["champion"] = h.promoted_tag
    return state

