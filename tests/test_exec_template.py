"""The bundled lab template through the real driver: torch+peft warm worker, transactions harness."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pipeline import runner
from pipeline.lab import load_lab
from pipeline import experiment, labrepo

pytestmark = pytest.mark.system

BASE = "autoresearch/baseline"


@pytest.mark.slow
def test_the_template_lab_runs_and_is_scored_by_the_sealed_harness(tmp_path: Path) -> None:
    from agent.labinit import init_lab

    root = init_lab(tmp_path / "lab", suite="small")
    config = root / "research.toml"
    config.write_text(config.read_text().replace("data_seed = 0", "data_seed = 0\ncustomers = 400"))
    lab = load_lab(root)
    store = experiment.open_store(lab)
    tasks = lab.tasks()[:2]
    ids = experiment.ensure_runs(store, lab, BASE, tasks, [0])
    with runner.Driver(lab, store, runner.make_executor("local", lab)) as driver:
        driver.drive(until=ids, timeout_s=300)
    res = experiment.results(store, lab, BASE, tasks)
    assert sorted(res) == sorted(tasks)
    for task in tasks:
        value = res[task][0]
        assert value is not None and math.isfinite(value) and 0.0 < value < 1.0, store.results_for(
            labrepo.resolve_commit(lab, BASE))
    stages = [(e.stage, e.outcome) for e in store.stage_execs(ids)]
    assert stages.count(("pretrain", "ok")) == 1 and stages.count(("finetune", "ok")) == 2
    # the sealed labels stayed out of every stage's reach: none of the logs or outputs name them
    sealed = str(lab.state / "sealed")
    assert all(sealed not in p.read_text(errors="replace") for p in (lab.state / "logs").glob("*.log"))
