"""The sealed holdout (README, The gate: Holdout): scored only for a baseline's own runs, never seen by the gate, the
agent's context or a prompt, and shown beside the gate's own figure in status and the digest.

The leak check is a non-interference test: two copies of one lab differ only in their holdout labels
(flipped in the copy, so every holdout AUC becomes 1 - AUC). The loop runs the same hypothesis in
both; everything the gate and the agent see must come out identical, while the holdout scores are
exactly complementary."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from support.lab import cli, cli_json, copy_lab, make_branch, open_lab, records
from pipeline.harness.base import GATE_SPLIT, HOLDOUT_SPLIT

pytestmark = pytest.mark.system


def _prepared(root: Path):
    from pipeline.harness import get_harness

    lab = open_lab(root)
    b = lab.config.benchmark
    harness = get_harness(b.harness)
    return harness, harness.prepare(lab.state, b.suite, b.data_seed, b.customers)


def test_transactions_holdout_is_sealed_disjoint_and_scored_apart(lab: Path, tmp_path: Path) -> None:
    harness, prepared = _prepared(lab)
    mask = harness.holdout_mask(prepared)
    ids = harness.test_ids(prepared)
    assert mask is not None and mask.dtype == bool and len(mask) == len(ids)
    # about a third of the test rows, drawn at random per preparation (a secret seed): within 5 binomial σ
    # (on this lab's few test rows 0.2 is 2.2 σ away, so a bound of 0.2 failed about one run in 60)
    from pipeline.harness.transactions import HOLDOUT_FRACTION as p

    assert 0 < mask.sum() < len(mask) and abs(mask.mean() - p) < 5 * np.sqrt(p * (1 - p) / len(mask)), mask.mean()
    # nothing public tells a stage which test rows are holdout: every test row is split 2, and the
    # partition lives only in the sealed folder
    with np.load(prepared.public / "customers.npz") as c:
        assert set(np.unique(c["split"])) == {0, 1, 2}
        assert sorted(c["id"][c["split"] == 2]) == sorted(ids)
    assert not any("split" in p.name for p in prepared.public.iterdir())
    assert (prepared.sealed / "splits.npz").is_file()
    # perfect on the holdout rows, constant on the gate rows: the two splits are scored apart
    y = harness.test_labels(prepared, "churn_60d")
    pred = np.where(mask, y, 0.5)
    path = tmp_path / "predictions.csv"
    path.write_text("id,score\n" + "".join(f"{i},{v}\n" for i, v in zip(ids, pred)))
    assert harness.score(prepared, "churn_60d", path, split=HOLDOUT_SPLIT) == 1.0
    assert harness.score(prepared, "churn_60d", path, split=GATE_SPLIT) == 0.5
    assert harness.score(prepared, "churn_60d", path) == 0.5  # the default is the gate split
    with pytest.raises(ValueError):
        harness.score(prepared, "churn_60d", path, split="test")


def _flip_holdout_labels(root: Path) -> None:
    """The copy's holdout labels are the complement of the original's; nothing else changes."""
    harness, prepared = _prepared(root)
    mask = harness.holdout_mask(prepared)
    path = prepared.sealed / "test_labels.npz"
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    for k, v in arrays.items():
        if k != "ids":
            arrays[k] = np.where(mask, 1 - v, v).astype(v.dtype)
    np.savez(path, **arrays)


def _seen_by_gate_and_agent(root: Path) -> dict:
    """Everything the gate decided on and the agent's next context, as JSON."""
    from agent.graph import build_context
    from agent.loop import Loop, LoopOptions
    from pipeline.api import ExecutorOptions

    loop = Loop(open_lab(root), LoopOptions(offline=True, smoke=False, executor=ExecutorOptions(workers=1)),
                progress=lambda m: None)
    try:
        ctx = dataclasses.asdict(build_context(loop.svc))
        store = loop.store
        hyps = loop.svc.records.all()
        gate = {h.id: [(r.kind, r.look, r.payload) for r in store.gate_records(str(h.id))] for h in hyps}
        results = {(r.commit, r.task, r.seed): r.value for r in store.results_for(hyps[0].commit)} if hyps else {}
        decided = [(h.id, h.title, h.verdict, h.decision, h.look, h.promoted_tag) for h in hyps]
    finally:
        loop.close()
    return json.loads(json.dumps({"context": ctx, "gate": gate, "results": sorted(map(str, results.items())),
                                  "decided": decided}, default=str))


def _holdout_rows(root: Path) -> list:
    from sqlmodel import select

    from pipeline import experiment
    from pipeline.store import HoldoutScore

    store = experiment.open_store(open_lab(root))
    with store.session() as s:
        return [(r.commit, r.task, r.seed, r.value) for r in s.exec(select(HoldoutScore))]


def test_the_holdout_never_reaches_the_gate_the_context_or_a_prompt(lab: Path, tmp_path: Path) -> None:
    make_branch(lab, "res/lr", [("config.toml", "lr = 3e-4", "lr = 3e-3")])
    twin = copy_lab(lab, tmp_path / "twin")
    _flip_holdout_labels(twin)
    for root in (lab, twin):
        assert cli(root, "seed", "--branch", "res/lr").returncode == 0
        run = cli(root, "run", "--offline", "--max-hypotheses", "1", "--workers", "2", timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]

    a, b = _seen_by_gate_and_agent(lab), _seen_by_gate_and_agent(twin)
    assert a["gate"] and a["results"]
    assert a == b  # the gate's records, every run's metric, the decisions and the next context

    # the holdout was scored, on the baseline's own seeds only, and it differs between the twins
    rows_a = {(c, t, s): v for c, t, s, v in _holdout_rows(lab)}
    rows_b = {(c, t, s): v for c, t, s, v in _holdout_rows(twin)}
    assert rows_a and rows_a.keys() == rows_b.keys()
    first = records(lab).all()[0]
    assert {c for c, _, _ in rows_a} == {first.base_commit}  # the baseline's runs, never the challenger's
    assert all(abs(rows_a[k] + rows_b[k] - 1.0) < 1e-9 for k in rows_a)  # flipped labels: AUC → 1 - AUC
    assert any(abs(rows_a[k] - 0.5) > 1e-6 for k in rows_a)

    # no prompt template or phrase can ask for it
    prompts_dir = Path(__file__).resolve().parents[1] / "agent" / "prompt_files"
    assert all("holdout" not in p.read_text().lower() for p in prompts_dir.iterdir() if p.is_file())
    assert "holdout" not in json.dumps(a["context"]).lower()

    # status and the digest show both splits; the first baseline is measured on its own runs
    st = cli_json(lab, "status", "--json")
    pts = st["progress"]["points"]
    assert pts and pts[0]["label"] == "start" and pts[0]["holdout"] is not None
    assert pts[0]["commit"] == first.base_commit[:10] and pts[0]["runs"] > 0 and pts[0]["holdout"] is not None
    dg = cli(lab, "digest", "--since", "1d")
    assert dg.returncode == 0 and "progress" in dg.stdout and "gate split" in dg.stdout, dg.stdout
