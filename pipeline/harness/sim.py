"""Harness "sim": a simulated lab for trying the loop at scale (32-64 slots) on one small machine.

Its one stage (`templates/sim/sim.py`) sleeps a set time and reports a planted metric: a level per
task, plus the sum of the `effect` of every `effect_*.toml` file in the commit (in σ units: a
hypothesis is a new such file, so two hypotheses never conflict when one is re-based on the
other), plus seed noise, shared between the two arms at seed k with a set correlation (and across
tasks at one seed with another), the rest drawn from the commit's effect files: a no-op reproduces
its baseline exactly. Everything else is the real product: driver, executor, sandbox, cache,
store, gate, graph.

The metric is written by the stage itself (predictions.csv: `id,score` and the one row `0,<value>`)
and this scorer only reads it back, bounded and without following links: nothing is sealed, so
this harness is for measuring the loop, never a research benchmark. `prepare` writes `{data}/sim.json`;
the smoke run's preparation (`smoke=True`) marks it so, and the stage does not sleep then.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import numpy as np

from pipeline.harness.base import Harness, Prepared, read_predictions

SIM_TASKS = [f"t{i}" for i in range(1, 65)]


class SimHarness(Harness):
    name = "sim"
    suites = {"sim": SIM_TASKS}
    metrics = {"score"}

    def prepare(self, state_dir: Path, suite: str, data_seed: int, customers: int | None = None, *,
                smoke: bool = False) -> Prepared:
        dataset_id = f"sim-s{data_seed}{'-smoke' if smoke else ''}"
        public = Path(state_dir) / "data" / dataset_id
        sealed = Path(state_dir) / "sealed" / dataset_id
        if not (public / "sim.json").exists():
            for root in (public.parent, sealed):
                root.mkdir(parents=True, exist_ok=True)
            tmp = Path(f"{public}.tmp-{uuid.uuid4().hex[:6]}")
            tmp.mkdir()
            (tmp / "sim.json").write_text(json.dumps({"dataset_id": dataset_id, "data_seed": data_seed,
                                                      "smoke": smoke}))
            try:
                os.rename(tmp, public)
            except OSError:  # prepared meanwhile by another process
                shutil.rmtree(tmp, ignore_errors=True)
        return Prepared(dataset_id, public, sealed)

    def test_ids(self, prepared: Prepared) -> np.ndarray:
        return np.array([0], dtype=np.int64)

    def score(self, prepared: Prepared, task: str, predictions: Path, metric: str = "score",
              split: str = "gate") -> float:
        if split != "gate":
            raise ValueError(f"no split {split!r} in {prepared.dataset_id}")
        return float(read_predictions(predictions, self.test_ids(prepared))[0])
