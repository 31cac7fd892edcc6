"""A Ray cluster whose nodes measure with different environments: the driver's stages stay on one.

A real two-node `ray start` cluster: the head node (2 CPUs) imports what this venv has; the second
node (1 CPU) runs with a folder first on its PYTHONPATH that holds another numpy's metadata, as a
node with an older numerical stack would (`environment.installed` reads the first one on the path).
The cache key holds one environment, so stages that ran on both kinds of node would serve one
node's outputs to the other's runs under that key; the driver keeps them on one environment's
nodes, the one with the most slots or the baseline's, parks the others' slots, and says so.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from support.ray_cluster import ENV, RayCluster, ray_exclusive, require_ray
from support.tiny import TinyHarness, make_lab
from pipeline import environment, experiment, labrepo, runner
from pipeline.outcomes import StageOutcome

pytestmark = pytest.mark.system

ray = require_ray()

BASE = "autoresearch/baseline"
OLD_NUMPY = "0.0.1"


@pytest.fixture(scope="module")
def mixed_cluster(tmp_path_factory: pytest.TempPathFactory):
    older = tmp_path_factory.mktemp("older-stack")
    meta = older / f"numpy-{OLD_NUMPY}.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: numpy\nVersion: {OLD_NUMPY}\n")
    path = os.pathsep.join([str(older), *filter(None, [os.environ.get("PYTHONPATH")])])
    saved = {k: os.environ.get(k) for k in ENV}
    try:
        with ray_exclusive(), RayCluster(head_cpus=2, worker_cpus=1, worker_env={"PYTHONPATH": path}) as cluster:
            os.environ.update(ENV)
            ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
            try:
                yield cluster
            finally:
                ray.shutdown()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _measure(lab, store, commit: str, prefer: str | None = None):
    """Runs of `commit` on tasks a, b and seeds 0, 1 through a fresh Ray executor on the cluster:
    (the driver's environment, its note, its slots, the runs' stage executions, the results)."""
    from pipeline.executors.ray_executor import RayExecutor

    ids = experiment.ensure_runs(store, lab, commit, ["a", "b"], [0, 1], harness=TinyHarness())
    executor = RayExecutor(cpus=1, preload=("numpy",))
    assert executor.slots == 3 and len(executor.environments()) == 2
    with runner.Driver(lab, store, executor, harness=TinyHarness(), prefer_env=prefer) as d:
        env, note, slots = d.environment, d.environment_note, d.slots
        d.drive(until=ids, timeout_s=180)
    sha = labrepo.resolve_commit(lab, commit)
    return env, note, slots, store.stage_execs(ids), [r for r in store.results_for(sha) if r.task in ("a", "b")]


def test_stages_stay_on_one_environments_nodes_and_its_cache_keys(mixed_cluster: RayCluster, tmp_path: Path) -> None:
    lab = make_lab(tmp_path / "lab", timeout_s=60)
    store = experiment.open_store(lab)
    repo = labrepo.LabRepo(lab.root)

    # the most slots: the head node's two, the venv's own numpy
    env, note, slots, execs, results = _measure(lab, store, BASE)
    assert dict(env.packages)["numpy"] != OLD_NUMPY
    assert slots == 2
    assert note is not None and note.startswith("1 of 3 slots left idle") and f"→ {OLD_NUMPY}" in note, note
    ran = [e for e in execs if e.outcome == StageOutcome.OK]
    assert ran and len({e.host for e in ran}) == 1, {e.host for e in ran}
    head_host = ran[0].host
    assert len(results) == 4 and all(r.value is not None for r in results)
    assert {r.env_id for r in results} == {env.id}

    # preferring the other environment (a baseline measured there): the second node's one slot. The
    # same code (an empty commit: the tree's stage digests are the same) is executed there again,
    # never served from the first environment's cache entries
    old_env = lab.config.run.environment_of({**environment.here(), "packages": {
        **environment.here()["packages"], "numpy": OLD_NUMPY}})
    again = repo.remeasure(labrepo.resolve_commit(lab, BASE), "measure on the older stack")
    env2, note2, slots2, execs2, results2 = _measure(lab, store, again, prefer=old_env.id)
    assert env2.id == old_env.id and slots2 == 1
    assert note2 is not None and note2.startswith("2 of 3 slots left idle"), note2
    assert not {e.key for e in execs2} & {e.key for e in execs}  # (its runs share their pretraining: hits)
    ran2 = [e for e in execs2 if e.outcome == StageOutcome.OK]
    assert {e.stage for e in ran2} == {"pretrain", "finetune"}
    assert {e.host for e in ran2} != {head_host} and len({e.host for e in ran2}) == 1
    assert {r.env_id for r in results2} == {env2.id} and all(r.value is not None for r in results2)

    # and back in the first environment, the same code again is served from its cache: the keys
    # follow the environment the stages run in, not the node that happened to take them
    third = repo.remeasure(again, "measure on the venv's stack again")
    env3, _, _, execs3, results3 = _measure(lab, store, third)
    assert env3.id == env.id
    assert {e.key for e in execs3} == {e.key for e in execs}
    assert {e.outcome for e in execs3} == {StageOutcome.CACHE_HIT}
    assert [r.value for r in sorted(results3, key=lambda r: (r.task, r.seed))] == \
        [r.value for r in sorted(results, key=lambda r: (r.task, r.seed))]
