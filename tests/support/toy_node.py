"""A graph node added from outside, in one file: after each summary it records one loop event
(`toy: #<id> <decision>`) and changes nothing of the lifecycle. `Loop(..., graph=with_toy_node)`."""

from __future__ import annotations

from agent.graph import GraphSpec, Services, State, graph_spec


def with_toy_node(svc: Services) -> GraphSpec:
    """The product's graph with `toy` right after `summarize` (it takes over summarize's router)."""

    def toy(state: State) -> State:
        h = svc.records.get(state["hypothesis_id"])
        svc.records.event("toy", f"toy: #{h.id} {h.decision}")
        return {}

    spec = graph_spec(svc)
    spec.insert_after("summarize", "toy", toy)
    return spec
