"""Harnesses: the sealed part of a benchmark (data, splits, hidden test labels, scorer).

A harness is trusted code that lives here, never in a lab branch. To add a benchmark, add a module
with a `Harness` subclass and register it in `HARNESSES`. A team's own benchmark needs none:
`harness = "command"` (command.py) runs the lab's own prepare and score from its trusted commit.
"""

from __future__ import annotations

from pipeline.harness.base import Harness, Prepared, PredictionsError

HARNESSES = {
    "transactions": "pipeline.harness.transactions:TransactionsHarness",
    "command": "pipeline.harness.command:CommandHarness",
}


def get_harness(name: str) -> Harness:
    import importlib

    from pipeline.errors import UserError

    if name not in HARNESSES:
        raise UserError(f"unknown harness {name!r}; expected one of {sorted(HARNESSES)}")
    module, _, cls = HARNESSES[name].partition(":")
    return getattr(importlib.import_module(module), cls)()


__all__ = ["Harness", "Prepared", "PredictionsError", "HARNESSES", "get_harness"]
