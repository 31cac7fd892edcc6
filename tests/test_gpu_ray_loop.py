"""`autoresearch run --executor ray` on a GPU lab from a machine without a GPU (issue 33 on Ray).

A `ray start --head --num-gpus 1` node (a logical GPU: Ray hands its actors CUDA_VISIBLE_DEVICES as
on a GPU node) whose workers import a fake NVML; the loop's process sees no GPU. Its own module: two
Ray instances never run side by side (`support.ray_cluster.ray_exclusive`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.ray_cluster import ENV, RayCluster, ray_exclusive, require_ray
from test_gpu_share import FAKE_NVML

pytestmark = pytest.mark.system

require_ray()


def test_run_on_a_ray_cluster_of_gpu_nodes_measures_a_gpu_labs_hypothesis_from_a_driver_without_a_gpu(
        tmp_path: Path) -> None:
    """`autoresearch run --executor ray` as a team runs it: the loop on a head machine with no GPU,
    the stages on a GPU node. The lab's stage exits unless it is given a GPU (as a `.cuda()` lab
    does). Before, its smoke run ran on the head's CPU and the hypothesis was rejected at smoke; now
    it is measured and decided, its GPU-hours counted, and the node's GPU sampled for `status`."""
    from support import cli, cli_env, cli_json
    from support.lab import git, set_research
    from test_in_flight import sim_lab

    root = sim_lab(tmp_path / "lab", tasks=2, sleep=0.3)
    sim = root / "sim.py"
    sim.write_text(sim.read_text().replace("    a = p.parse_args()\n", (
        "    a = p.parse_args()\n"
        "    import os, sys\n"
        "    if not os.environ.get('CUDA_VISIBLE_DEVICES'):\n"
        "        sys.exit('config.toml says require_cuda, but torch sees no CUDA device')\n")))
    git(root, "commit", "-qam", "the stage needs a GPU")
    set_research(root, "[run]\n", '[run]\ngpus = 0.5\nsandbox = "off"\n')
    spec = tmp_path / "h.json"
    spec.write_text(json.dumps({"title": "real", "edits": [{"path": "effect_h.toml", "content": "effect = 12.0\n"}]}))
    assert cli(root, "seed", "--file", str(spec)).returncode == 0

    nvml = tmp_path / "nvml"
    nvml.mkdir()
    (nvml / "pynvml.py").write_text(FAKE_NVML)
    (nvml / "util").write_text("60")
    node_env = {"PYTHONPATH": str(nvml)}  # the GPU node has NVML; the head does not
    with ray_exclusive(), RayCluster(head_cpus=2, worker_cpus=0, head_gpus=1, env=node_env) as cluster:
        run = cli(root, "run", "--offline", "--max-hypotheses", "1", "--executor", "ray", "--ray-address",
                  cluster.address, env=cli_env(**ENV, CUDA_VISIBLE_DEVICES=""), timeout=400)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "executor ray (2 slots)" in run.stderr, run.stderr[-2000:]
    st = cli_json(root, "status", "--json")
    (h,) = st["hypotheses"]
    assert h["status"] == "done" and h["verdict"] == "improvement", (h, run.stderr[-3000:])
    goodput = st["compute"]
    assert goodput["useful_gpu_s"] > 0 and goodput["method_failed_gpu_s"] == 0, goodput
    assert goodput["gpu_busy_share"] == 1.0 and goodput["gpu_mean_util"] == pytest.approx(60.0), goodput
    assert "GPU: useful" in cli(root, "status").stdout
    assert goodput["smoke_runs"] == 1 and goodput["smoke_gpu_s"] > 0, goodput  # its smoke run, on the node's GPU
    summary = (root / "runs" / "summaries" / f"{h['id']}.md").read_text()
    runs_line = next(line for line in summary.splitlines() if line.startswith("- **Runs:** "))
    assert " GPU-h" in runs_line and "before them, 1 smoke run on tiny data" in runs_line, runs_line


def test_a_lab_whose_scorer_needs_a_gpu_is_measured_on_a_ray_cluster_from_a_driver_without_one(
        tmp_path: Path) -> None:
    """`[run] score_gpus` on a cluster whose head has no GPU (before: refused in one line, so a lab
    whose scorer runs a model could not run on Ray at all). The executor holds a share of the node's
    GPU for `prepare`/`score`; the smoke run's scorer and every run's are sent there, each booked with
    its GPU-seconds, and the hypothesis is measured and decided."""
    from agent.labinit import init_lab
    from support import cli, cli_env, cli_json
    from support.lab import set_research

    root = init_lab(tmp_path / "lab", harness="command")
    set_research(root, 'sandbox = "auto"', 'sandbox = "off"\ngpus = 0.5\nscore_gpus = 0.25')
    config = (root / "config.toml").read_text()
    spec = tmp_path / "h.json"
    spec.write_text(json.dumps({"title": "more epochs", "edits": [
        {"path": "config.toml", "content": config.replace("epochs = 60", "epochs = 90")}]}))
    assert cli(root, "seed", "--file", str(spec)).returncode == 0
    with ray_exclusive(), RayCluster(head_cpus=2, worker_cpus=0, head_gpus=2) as cluster:
        run = cli(root, "run", "--offline", "--max-hypotheses", "1", "--executor", "ray", "--ray-address",
                  cluster.address, env=cli_env(**ENV, CUDA_VISIBLE_DEVICES=""), timeout=400)
    assert run.returncode == 0, run.stderr[-4000:]
    st = cli_json(root, "status", "--json")
    (h,) = st["hypotheses"]
    assert h["status"] == "done" and h["verdict"] not in (None, "smoke_failed"), (h, run.stderr[-3000:])
    c = st["compute"]
    assert c["smoke_runs"] == 1 and c["smoke_rejected"] == 0, c
    assert c["harness_gpu_s"] > 0 and c["harness_calls"] > 1, c  # its scores, with their GPU share
    assert c["useful_gpu_s"] > 0 and c["infra_retries"] == 0, c
