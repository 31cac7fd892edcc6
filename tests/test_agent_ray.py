"""`autoresearch run --executor ray` on a real two-node Ray cluster started as separate processes
(`ray start --head`, `ray start --address` with its own temp dir): the loop measures and decides
exactly as it does on the local executor (same runs, same metrics, same verdict), as real CLI
processes; its stages ran on both nodes, in warm workers."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from support.lab import cli, cli_env, cli_json, copy_lab, open_lab
from support.ray_cluster import ENV, RayCluster, ray_exclusive, require_ray

pytestmark = pytest.mark.system

require_ray()



@pytest.fixture(scope="module", autouse=True)
def _one_ray_at_a_time():
    with ray_exclusive():
        yield



def _name(p) -> str:
    try:
        return " ".join(p.cmdline())
    except Exception:  # psutil.Error: it just exited
        return ""


def test_the_loop_on_a_two_node_ray_cluster_measures_and_decides_like_the_loop_on_local(
        lab_template: Path, tmp_path: Path) -> None:
    from pipeline import experiment

    labs = {name: copy_lab(lab_template, tmp_path / name / "lab") for name in ("local", "ray")}
    reports = {}
    with RayCluster(head_cpus=1, worker_cpus=1) as cluster:
        for name, lab in labs.items():
            extra = ["--ray-address", cluster.address] if name == "ray" else []
            run = cli(lab, "run", "--offline", "--max-hypotheses", "1", "--executor", name, "--workers", "2", *extra,
                      env=cli_env(**ENV), timeout=400)
            assert run.returncode == 0, run.stderr[-4000:]
            assert f"executor {name} (2 slots)" in run.stderr
            (h,) = cli_json(lab, "status", "--json")["hypotheses"]
            assert h["status"] == "done" and h["verdict"], h
            reports[name] = cli_json(lab, "report", str(h["id"]), "--json")
            st = cli_json(lab, "status", "--json")
            assert st["queue"]["queued"] == st["queue"]["running"] == st["queue"]["failed"] == 0
        # the drivers are gone and so are their warm worker actors: nothing of ours is left on the cluster
        deadline = time.monotonic() + 60
        while any("WarmWorker" in _name(p) for p in cluster.processes()):
            assert time.monotonic() < deadline, [_name(p) for p in cluster.processes()]
            time.sleep(0.5)
    # both nodes ran stages (one warm worker actor per CPU: one on each node)
    execs = experiment.open_store(open_lab(labs["ray"])).stage_execs()
    nodes = {e.host for e in execs if e.outcome == "ok"}
    assert len(nodes) == 2 and all("/ray-" in n for n in nodes), nodes
    local, on_ray = reports["local"], reports["ray"]
    assert on_ray["hypothesis"]["title"] == local["hypothesis"]["title"]
    assert on_ray["gate"]["verdict"] == local["gate"]["verdict"]
    assert on_ray["gate"]["look"] == local["gate"]["look"]
    for a, b in zip(local["gate"]["tasks"], on_ray["gate"]["tasks"]):
        assert a["task"] == b["task"]
        assert (a["baseline_runs"], a["challenger_runs"]) == (b["baseline_runs"], b["challenger_runs"])
        # the same stages with the same seeds and one thread: the same numbers
        assert a["baseline_mean"] == pytest.approx(b["baseline_mean"], abs=1e-9)
        assert a["challenger_mean"] == pytest.approx(b["challenger_mean"], abs=1e-9)
