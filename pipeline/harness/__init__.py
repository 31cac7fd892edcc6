"""Harnesses: the sealed part of a benchmark (data, splits, hidden test labels, scorer).

A harness is trusted code that lives here, never in a lab branch. To add a benchmark, add a module
with a `Harness` subclass and one line in `HARNESSES` below (a plugin or a test:
`HARNESSES.register(name, "module:Class")`). A team's own benchmark needs none: `harness =
"command"` (command.py) runs the lab's own prepare and score from its trusted commit.
"""

from __future__ import annotations

from pipeline.harness.base import Harness, MethodFailure, Prepared
from pipeline.registry import Registry

HARNESSES: Registry[type[Harness]] = Registry("harness", {
    "transactions": "pipeline.harness.transactions:TransactionsHarness",
    "command": "pipeline.harness.command:CommandHarness",
    "sim": "pipeline.harness.sim:SimHarness",  # a simulated lab for trying the loop at scale (benchmarks/scale.py)
})


def get_harness(name: str) -> Harness:
    """A new instance of the harness registered as `name` (unknown: a `UserError` naming the choices)."""
    return HARNESSES.get(name)()


__all__ = ["Harness", "Prepared", "MethodFailure", "HARNESSES", "get_harness"]
