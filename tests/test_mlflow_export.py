"""`autoresearch export mlflow` to a real tracking store — a `sqlite:///` backend, and an
`mlflow server` process on 127.0.0.1 — read back with `MlflowClient.search_runs`: counts, params,
tags and metrics equal the store's; a second export changes nothing; an unreachable server is one
line. A real loop decides the hypotheses first (real runs, real results). The holdout figures and the
direction tag are checked on tests/support/views.py's lab too (a promotion, holdout scores, two
directions; planted runs, no training)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from support.lab import free_port
from support.summary import cli, make_lab, run_loop, services

pytestmark = pytest.mark.system






@pytest.fixture(scope="module")
def decided_lab(tmp_path_factory) -> Path:
    root = make_lab(tmp_path_factory.mktemp("mlflow") / "lab")
    proc = run_loop(root, 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def export(root: Path, uri: str) -> dict:
    """`export mlflow`'s JSON; its exit code is 1 exactly when a hypothesis was refused (`failed`)."""
    out = cli(root, "export", "mlflow", "--tracking-uri", uri, check=False)
    got = json.loads(out.stdout)
    assert out.returncode == (1 if got["failed"] else 0), (out.returncode, out.stderr)
    return got


def check_matches_store(root: Path, uri: str) -> None:
    from mlflow.tracking import MlflowClient

    from agent.directions import direction_of, label
    from agent.mlflow_export import COMPUTE_TAG, HYP_TAG, RUN_TAG, changed_keys

    svc = services(root)
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(f"autoresearch/{svc.lab.config.lab.name}")
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    parents = {r.data.tags[HYP_TAG]: r for r in runs if HYP_TAG in r.data.tags}
    hyps = svc.records.all()
    assert sorted(parents) == sorted(str(h.id) for h in hyps)
    # the lab's compute, as `status` prints it: one run, its figures the store's
    (compute,) = [r for r in runs if r.data.tags.get(COMPUTE_TAG) == "lab"]
    spent = svc.store.goodput().as_dict()
    assert spent["useful_cpu_s"] > 0 and spent["smoke_runs"] > 0 and spent["harness_calls"] > 0
    for k in ("useful_cpu_s", "method_failed_cpu_s", "infra_lost_cpu_s", "useful_gpu_s", "infra_lost_gpu_s",
              "smoke_runs", "smoke_cpu_s", "harness_calls", "harness_cpu_s", "goodput"):
        assert math.isclose(compute.data.metrics[f"compute.{k}"], float(spent[k]), rel_tol=1e-12), k
    for h in hyps:
        r = parents[str(h.id)]
        tags = r.data.tags
        assert (tags["verdict"], tags["decision"], tags["commit"], tags["origin"]) == (
            h.verdict or "", h.decision or "", h.commit or "", h.origin or "")
        assert r.data.params == changed_keys(svc.workspace, h.base_commit, h.commit) and r.data.params
        (key,) = r.data.params  # the offline policy changes one [search_space] key
        assert key in (h.change or {})
        assert tags["direction"] == label(direction_of(svc.workspace, h)) == key  # that key is its direction
        gate = svc.store.gate_records(str(h.id), kind="verdict")[-1].payload
        for t in gate["tasks"]:
            assert math.isclose(r.data.metrics[f"delta.{t['task']}"], t["delta"], rel_tol=1e-12)
        assert math.isclose(r.data.metrics["horizontal_delta_sigma"], gate["horizontal"]["delta"], rel_tol=1e-12)
        spent = svc.store.smoke_spent(str(h.id))  # its smoke run, before any run of it was queued
        assert spent["runs"] == r.data.metrics["smoke.runs"] == 1 and spent["cpu_s"] > 0
        assert math.isclose(r.data.metrics["smoke.cpu_s"], spent["cpu_s"], rel_tol=1e-12)
        assert {a.path for a in client.list_artifacts(r.info.run_id)} == {"summary.md", "forest.png"}
        assert r.info.status == "FINISHED"
        nested = [x for x in runs if x.data.tags.get("mlflow.parentRunId") == r.info.run_id]
        results = svc.store.results_for(h.commit)
        assert len(nested) == len(results) > 0
        by_key = {x.data.tags[RUN_TAG]: x for x in nested}
        for res in results:
            x = by_key[f"{h.commit[:12]}:{res.task}:{res.seed}"]
            assert math.isclose(x.data.metrics["auc"], res.value, rel_tol=1e-12)
            assert math.isclose(x.data.metrics["cpu_s"], res.cpu_s, rel_tol=1e-12)
            assert res.env_id and x.data.tags["environment"] == res.env_id  # where it was measured


def metric_points(uri: str) -> int:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    n = 0
    for exp in client.search_experiments():
        for r in client.search_runs([exp.experiment_id], max_results=1000):
            n += sum(len(client.get_metric_history(r.info.run_id, k)) for k in r.data.metrics)
    return n


def test_export_to_a_sqlite_tracking_store_equals_the_store_and_is_idempotent(decided_lab: Path, tmp_path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = export(decided_lab, uri)
    assert first["created"] > 2
    check_matches_store(decided_lab, uri)
    points = metric_points(uri)
    again = export(decided_lab, uri)
    assert (again["created"], again["updated"]) == (0, 0)
    assert metric_points(uri) == points  # nothing logged twice
    assert (tmp_path / "mlflow-artifacts").is_dir()  # the artifacts beside the store, not in ./mlruns
    assert not (Path.cwd() / "mlruns").exists() and not (decided_lab / "mlruns").exists()
    check_matches_store(decided_lab, uri)


def test_export_to_an_mlflow_server_process(decided_lab: Path, tmp_path) -> None:
    port = free_port()
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}", "--artifacts-destination",
         str(tmp_path / "artifacts"), "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "server.log", "w"), start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{uri}/health", timeout=2)
                break
            except OSError:
                assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "mlflow server did not come up"
                time.sleep(0.5)
        first = export(decided_lab, uri)
        assert first["created"] > 2
        check_matches_store(decided_lab, uri)
        again = export(decided_lab, uri)
        assert (again["created"], again["updated"]) == (0, 0)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def test_an_unreachable_tracking_server_is_one_line(decided_lab: Path) -> None:
    out = cli(decided_lab, "export", "mlflow", "--tracking-uri", f"http://127.0.0.1:{free_port()}", check=False)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "cannot reach" in out.stderr


def test_run_with_mlflow_exports_each_hypothesis_as_it_is_decided(lab: Path, tmp_path) -> None:
    from mlflow.tracking import MlflowClient

    from support.lab import make_loop

    uri = f"sqlite:///{tmp_path / 'live.db'}"
    loop = make_loop(lab, offline=True, max_hypotheses=1, mlflow=uri)
    try:
        loop.run()
    finally:
        loop.close()
    (h,) = loop.records.all()
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(f"autoresearch/{loop.lab.config.lab.name}")
    parents = client.search_runs([exp.experiment_id], filter_string=f"tags.`autoresearch.hypothesis` = '{h.id}'")
    assert len(parents) == 1 and parents[0].data.tags["decision"] == h.decision and h.status == "done"


def test_the_export_carries_the_holdout_figures_and_the_direction(lab_template, tmp_path) -> None:
    from mlflow.tracking import MlflowClient

    from agent.mlflow_export import HYP_TAG
    from agent.progress import split_progress
    from support.views import build_views_lab

    built = build_views_lab(lab_template, tmp_path / "lab")
    root, (h1, h2, h3) = built["lab"], built["ids"]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert export(root, uri)["created"] >= 3
    svc = services(root)
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(f"autoresearch/{svc.lab.config.lab.name}")
    parents = {r.data.tags[HYP_TAG]: r for r in client.search_runs([exp.experiment_id], max_results=1000)
               if HYP_TAG in r.data.tags}
    assert {k: parents[str(k)].data.tags["direction"] for k in (h1, h2, h3)} == {
        h1: "finetune.lr", h2: "finetune.lr", h3: "finetune.lora_rank"}
    split = split_progress(svc.lab, svc.store, svc.records)
    (champ,) = [p for p in split["points"] if p["label"] == "baseline/v1"]
    m = parents[str(h1)].data.metrics
    assert m["champion.holdout"] == pytest.approx(0.630) and m["champion.holdout_gain"] == pytest.approx(0.020)
    assert m["champion.gate_split"] == pytest.approx(champ["gate"])
    assert m["champion.gate_split_gain"] == pytest.approx(champ["gate_gain"])
    gate = svc.store.gate_records(str(h1), kind="verdict")[-1].payload["horizontal"]
    assert (m["horizontal_ci_low_sigma"], m["horizontal_ci_high_sigma"]) == pytest.approx(
        (gate["ci_low"], gate["ci_high"]))
    for other in (h2, h3):  # not promoted: no champion figures
        assert not any(k.startswith("champion.") for k in parents[str(other)].data.metrics)
    again = export(root, uri)
    assert (again["created"], again["updated"]) == (0, 0)


ODD_KEY = "x@y"  # a quoted TOML key: a name MLflow refuses (its characters)
LONG_KEY = "k" * 300  # and one over MLflow's 250 characters
MANY = 120  # changed keys in one hypothesis: more params than one MLflow request takes (100)


def odd_keys_lab(template: Path, dst: Path) -> tuple[Path, tuple[int, int, int]]:
    """The tiny lab with three decided hypotheses (planted runs, real gate records): #1 adds the keys
    `"x@y"`, a 300-character one and MANY more to [finetune]; #2 changes `lora_rank`; #3 `lr`."""
    from support.lab import copy_lab, make_loop
    from support.views import BASE, BETTER, decide, seed

    lab = copy_lab(template, dst)
    added = "".join(f"\nextra_{i:03d} = {i}" for i in range(MANY))
    seed(lab, "odd", "Odd keys", "lr = 3e-4", f'lr = 3e-4\n"{ODD_KEY}" = 1\n"{LONG_KEY}" = 2{added}\n')
    seed(lab, "rank", "LoRA rank 16", "lora_rank = 4 ", "lora_rank = 16 ")
    seed(lab, "lr", "Fine-tune with lr 1e-3", "lr = 3e-4", "lr = 1e-3")
    loop = make_loop(lab, offline=True)
    try:
        ids = tuple(decide(loop, BASE, BETTER if i == 0 else BASE).id for i in range(3))
    finally:
        loop.close()
    return lab, ids  # type: ignore[return-value]


def test_names_mlflow_refuses_are_renamed_and_a_failing_hypothesis_stops_no_other(lab_template, tmp_path) -> None:
    """`"x@y"` and a 300-character config key reach a real MLflow store under names MLflow takes, the
    originals in tags; a hypothesis whose export fails (its artifact folder blocked by a file) is
    reported, the others exported; the next export reports it again and goes on; once unblocked it is
    exported too."""
    from mlflow.tracking import MlflowClient

    from agent.mlflow_export import HYP_TAG, ORIGINAL_TAG, Exporter, mlflow_name

    root, (odd, rank, lr) = odd_keys_lab(lab_template, tmp_path / "lab")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    svc = services(root)
    # #2's run exists already (an earlier export), and a file sits where its artifacts go
    exporter = Exporter(svc.lab, svc.store, uri)
    client = MlflowClient(tracking_uri=uri)
    blocked = client.create_run(exporter.experiment_id, tags={HYP_TAG: str(rank)})
    block = Path(blocked.info.artifact_uri.removeprefix("file://"))
    block.parent.mkdir(parents=True, exist_ok=True)
    block.write_text("in the way")

    def parents() -> dict[str, Any]:
        return {r.data.tags[HYP_TAG]: r for r in client.search_runs([exporter.experiment_id], max_results=1000)
                if HYP_TAG in r.data.tags}

    first = export(root, uri)
    (failed,) = first["failed"]
    assert failed["hypothesis"] == rank and str(block) in failed["error"], failed
    runs = parents()
    assert sorted(runs) == sorted(str(i) for i in (odd, rank, lr))  # every hypothesis, the failed one too
    params, tags = runs[str(odd)].data.params, runs[str(odd)].data.tags
    finetune = {f"finetune.{ODD_KEY}": "1", f"finetune.{LONG_KEY}": "2",
                **{f"finetune.extra_{i:03d}": str(i) for i in range(MANY)}}
    assert params == {mlflow_name(k): v for k, v in finetune.items()}  # all MANY + 2
    for key in (f"finetune.{ODD_KEY}", f"finetune.{LONG_KEY}"):
        name = mlflow_name(key)
        assert name != key and len(name) <= 250 and "@" not in name
        assert tags[ORIGINAL_TAG + name] == key  # the original, as the lab wrote it
    assert mlflow_name("finetune.extra_000") == "finetune.extra_000"  # a name MLflow takes is kept
    assert runs[str(lr)].data.params == {"finetune.lr": "0.001"}  # after the failed one: exported
    assert {a.path for a in client.list_artifacts(runs[str(lr)].info.run_id)} == {"summary.md", "forest.png"}

    again = export(root, uri)  # tried again, reported again; the rest unchanged
    assert [f["hypothesis"] for f in again["failed"]] == [rank] and again["created"] == 0
    block.unlink()
    last = export(root, uri)
    assert last["failed"] == []
    runs = parents()
    nested = client.search_runs([exporter.experiment_id], max_results=1000,
                                filter_string=f"tags.`mlflow.parentRunId` = '{runs[str(rank)].info.run_id}'")
    assert last["created"] == len(nested) == len(svc.store.results_for(svc.records.get(rank).commit)) > 0
    assert {a.path for a in client.list_artifacts(runs[str(rank)].info.run_id)} == {"summary.md", "forest.png"}
    assert runs[str(rank)].data.params == {"finetune.lora_rank": "16"}
