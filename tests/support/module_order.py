"""The order the test modules are handed to the xdist workers: the longest first.

`make test` runs two workers with `--dist loadfile` (a module runs whole on one worker). xdist's
default hands out the modules with the most tests first, so the modules of one long test (the soak,
3 minutes; the loop on a Ray cluster) came last and one worker ran them alone for minutes while the
other sat idle. Longest first (the classic greedy schedule) ends both workers close together.

The weights are each module's seconds, summed over its tests' setup, call and teardown, in
`tests/module_seconds.json`; a module not in it (a new one) counts as the median. Refresh them from a
full run on the 2-core machine: `TEST_MODULE_SECONDS=tests/module_seconds.json make test` writes
the measured sums there at the end (the controller's, which sees every worker's reports), merged
into the modules' weights already there. xdist hands a worker its next module once it has two tests
or fewer left, so this is longest-first with a module of look-ahead.
"""

from __future__ import annotations

import json
import os
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

WEIGHTS = Path(__file__).resolve().parent.parent / "module_seconds.json"
_seconds: dict[str, float] = defaultdict(float)


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[Any]) -> None:
    """Items grouped by module, the heaviest module first; each module's items in their own order.
    Deterministic (every worker must collect the same order)."""
    try:
        weights = {str(k): float(v) for k, v in json.loads(WEIGHTS.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return  # no weights: xdist's own order
    default = statistics.median(weights.values()) if weights else 0.0
    items.sort(key=lambda it: (-weights.get(_module(it.nodeid), default), _module(it.nodeid)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds[_module(report.nodeid)] += report.duration


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    out = os.environ.get("TEST_MODULE_SECONDS")
    if not out or hasattr(session.config, "workerinput"):  # a worker sees only its own modules
        return
    try:  # merged into what is there: a run of some modules (make test-fast, -k) keeps the others' weights
        merged = {str(k): float(v) for k, v in json.loads(Path(out).read_text()).items()}
    except (OSError, ValueError, AttributeError):
        merged = {}
    merged.update({k: round(v, 1) for k, v in _seconds.items()})
    Path(out).write_text(json.dumps(dict(sorted(merged.items())), indent=1) + "\n")
