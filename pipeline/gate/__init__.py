"""The statistical gate: challenger runs vs baseline runs → a verdict per look.

Pure functions over numpy/scipy; no I/O, no torch. The execution layer calls `evaluate` and stores
the `GateResult` (`result.model_dump(mode="json")` is JSON-safe).

Input (`GateInput`, a pydantic model; a plain dict of the same shape is accepted)::

    {
      "config": {"protocol": "sequential", "baseline_runs": 10, "looks": [2, 5, 10],
                 "alpha": 0.025, "futility_p": 0.30, "harm_q": 0.10, "higher_is_better": true},
      "tasks": [
        {"task": "default_90d",
         "baseline":   [0.781, 0.779, 0.802, 0.790, 0.785],   # by seed: position k = seed k
         "challenger": [0.801, null],                         # null/NaN = method failure
         "history":    [0.781, 0.779, 0.802, 0.790, 0.785, 0.77, 0.80]},  # baseline runs (the prior)
        ...
      ],
      "looks_done": null,   # challenger counts of earlier looks (default: planned looks below now)
      "at_look": null       # force (True) or suppress (False) a look; default: a look iff every task
                            # has the same count and it is a planned look (or past the plan)
    }

Seeds pair up across tasks (seed k of an arm is one run on every task): the horizontal test uses
that pairing. A run still pending is absent (a shorter list): the record is then "between looks".
`history` may include the comparison's baseline runs; they are matched by value and not counted
twice. research.toml's `[gate]` section loads as a `GateConfig` (`lab.config.gate`).

Output (`GateResult`): per task the arms' means, Δ, interval, p, BH q, flags (win / harm /
unstable, with Welch beside), the MDE at the next look; the horizontal statistic, its boundary
and the breadth check; failed runs with a worst-case sensitivity line; the verdict — one of
`improvement`, `single_task`, `harm`, `escalate`, `futile`, `inconclusive` — and its reasons.
Render with `render_table` (rich), `render_markdown`, or `to_json`.

Planning and validation: `pipeline.gate.power.power` / `mde` (pooled Student t via the non-central t) and
`simulate` (a protocol's false-positive rate, power and cost, vectorised).
"""

import importlib
from typing import Any

# Everything is imported on first use (PEP 562): reading a lab's `[gate]` (which checks the
# protocol's name against `pipeline.gate.protocol`) must not import numpy and scipy.
_WHERE = {
    "Boundaries": "boundaries", "fixed_boundaries": "boundaries", "obf_spending": "boundaries",
    "sequential_boundaries": "boundaries",
    "GateConfig": "inputs", "GateInput": "inputs", "TaskRuns": "inputs",
    "parse_input": "inputs",
    "mde": "power",  # power() itself: `from pipeline.gate.power import power`
    "evaluate": "judge",
    "FailureReport": "report", "GateResult": "report", "HorizontalResult": "report", "TaskResult": "report",
    "WelchResult": "report", "render_markdown": "report", "render_table": "report", "render_text": "report",
    "SimResult": "sim", "simulate": "sim",
    "Verdict": "verdict",  # (pipeline.outcomes.Verdict, re-exported)
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'pipeline.gate' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"pipeline.gate.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


__all__ = sorted(_WHERE)
