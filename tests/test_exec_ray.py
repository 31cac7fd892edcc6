"""The Ray executor on a real `ray start --head` node of 2 CPUs: same batch, same metrics as local.

Skipped only where Ray cannot be imported, and never in CI (CI=1 turns a missing Ray into a failure).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from support.tiny import TinyHarness, git, make_lab, open_tiny_lab
from support.ray_cluster import ENV, RayCluster, ray_exclusive, require_ray
from pipeline import runner
from pipeline.executors.local import LocalExecutor
from pipeline import experiment, labrepo

pytestmark = pytest.mark.system


ray = require_ray()

BASE = "autoresearch/baseline"
SECRET = "EXEC_TEST_API_KEY"
CANARY = "EXEC_TEST_CANARY"


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for the module. A secret-looking variable is in the environment Ray's workers
    inherit, so the test can check that stages never see it."""
    os.environ[SECRET] = "sk-should-never-reach-a-stage"
    os.environ[CANARY] = "visible"
    # a `ray start --head` node of our own, never a cluster left running on the machine (nor an
    # in-process `address="local"` Ray: a later module's actors on another Ray of this process then
    # died before they ran, "all references to the actor were removed")
    saved = {k: os.environ.get(k) for k in ENV}
    try:
        with ray_exclusive(), RayCluster(head_cpus=2, worker_cpus=0) as cluster:
            os.environ.update(ENV)
            ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
            try:
                yield
            finally:
                ray.shutdown()
    finally:
        for k, v in {**saved, SECRET: None, CANARY: None}.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_the_same_batch_gives_the_same_metrics_on_local_and_ray(local_ray, tmp_path: Path) -> None:
    from pipeline.executors.ray_executor import RayExecutor

    tasks, seeds = ["a", "b", "crash", "hang", "env"], [0, 1]
    lab = make_lab(tmp_path / "local", timeout_s=15)  # every stage's limit: only `hang` waits it out
    git(tmp_path, "clone", "-q", "-b", BASE, str(lab.root), str(tmp_path / "ray"))
    ray_lab = open_tiny_lab(tmp_path / "ray")
    out: dict[str, dict[str, dict[int, float | None]]] = {}
    kinds: dict[str, dict[tuple[str, int], str | None]] = {}
    envs_of: dict[str, set[str | None]] = {}
    for name, the_lab in (("local", lab), ("ray", ray_lab)):
        store = experiment.open_store(the_lab)
        ids = experiment.ensure_runs(store, the_lab, BASE, tasks, seeds, harness=TinyHarness())
        if name == "local":
            executor = LocalExecutor(preload=("numpy",), slots=2)
        else:
            executor = RayExecutor(cpus=1, preload=("numpy",))
            assert executor.slots == 2
        with runner.Driver(the_lab, store, executor, harness=TinyHarness()) as d:
            d.drive(until=ids, timeout_s=120)
        out[name] = experiment.results(store, the_lab, BASE, tasks)
        kinds[name] = {(r.task, r.seed): r.kind for r in store.results_for(labrepo.resolve_commit(the_lab, BASE))}
        assert all(e.executor == name for e in store.stage_execs(ids))
        envs_of[name] = {r.env_id for r in store.results_for(labrepo.resolve_commit(the_lab, BASE)) if r.value is not None}
    assert out["local"] == out["ray"]
    # the node sent its measurement environment with each stage (the same machine and interpreter here)
    assert envs_of["ray"] == envs_of["local"] and None not in envs_of["ray"] and len(envs_of["ray"]) == 1
    assert all(isinstance(v, float) for t in ("a", "b", "env") for v in out["ray"][t].values())
    assert kinds["ray"] == kinds["local"]
    assert kinds["ray"][("crash", 0)] == "crash" and kinds["ray"][("hang", 1)] == "timeout"

    # the commit's content travelled: Ray stages ran in an unpacked archive, not in the lab's worktree
    cwds = {p.read_text() for p in (ray_lab.state / "cache").glob("*/cwd.txt")}
    assert cwds and all("autoresearch-ray" in c and str(ray_lab.state) not in c for c in cwds)
    # and no secret-looking variable reached a stage, while ordinary ones did
    envs = [json.loads(p.read_text()) for p in (ray_lab.state / "cache").glob("*/env.json")]
    assert len(envs) == 2
    for env in envs:
        assert SECRET not in env and env[CANARY] == "visible" and env["OMP_NUM_THREADS"] == "1"
        assert not [k for k in env if any(w in k.upper() for w in ("KEY", "TOKEN", "SECRET", "PASSWORD"))]
    # on both executors the stage ran in the sandbox: its own pid namespace (pid 1 is the sandbox's
    # init), no network, nothing of the lab's state but the folders mounted for it
    for the_lab in (lab, ray_lab):
        seen = [json.loads(p.read_text()) for p in (the_lab.state / "cache").glob("*/sandbox.json")]
        assert len(seen) == 2, the_lab
        for s in seen:
            # a loopback of its own: the host's PostgreSQL (127.0.0.1:5432, these tests') is not on it
            assert s["pid1"].endswith("cat") and s["net"] == "Connection refused", s
            assert not {"autoresearch.db", "sealed", "logs", "worktrees"} & set(s["state"]), s
