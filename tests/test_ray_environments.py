"""A Ray cluster whose nodes measure with different environments: the driver's stages stay on one.

A real two-node `ray start` cluster: the head node (2 CPUs) imports what this venv has; the second
node (1 CPU) runs with a folder first on its PYTHONPATH that holds another numpy's metadata, as a
node with an older numerical stack would (`environment.installed` reads the first one on the path).
The cache key holds one environment, so stages that ran on both kinds of node would serve one
node's outputs to the other's runs under that key; the driver keeps them on one environment's
nodes, the one with the most slots or the baseline's, gives the others' slots back to the cluster
(their CPUs are free for other work), and says so. A node of another environment that joins later
gets no stage either: a replacement actor is placed on a node of the driver's environment only (it
waits for room there rather than land elsewhere); when no node of the driver's environment is left,
the stages fail in one line.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest

from support.ray_cluster import RayCluster, ray_exclusive, require_ray
from support.tiny import TinyHarness, make_lab
from pipeline import environment, experiment, labrepo, runner
from pipeline.executors import StageJob
from pipeline.outcomes import StageOutcome

pytestmark = pytest.mark.system

ray = require_ray()

BASE = "autoresearch/baseline"
OLD_NUMPY = "0.0.1"


def older_stack(tmp_path: Path) -> dict[str, str]:
    """A node's environment whose Python finds another numpy's metadata first."""
    older = tmp_path / "older-stack"
    meta = older / f"numpy-{OLD_NUMPY}.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: numpy\nVersion: {OLD_NUMPY}\n")
    return {"PYTHONPATH": os.pathsep.join([str(older), *filter(None, [os.environ.get("PYTHONPATH")])])}


@pytest.fixture
def mixed_cluster(tmp_path: Path):
    """Head node: 2 CPUs, this venv's numpy; second node: 1 CPU, the older numpy."""
    with ray_exclusive(), RayCluster(head_cpus=2, worker_cpus=1, worker_env=older_stack(tmp_path)) as cluster, \
            cluster.connected():
        yield cluster


@pytest.fixture
def head_only(tmp_path: Path):
    """A head node of 2 CPUs; the test adds a node of the older numpy later."""
    with ray_exclusive(), RayCluster(head_cpus=2, worker_cpus=0) as cluster, cluster.connected():
        yield cluster


def _measure(lab, store, commit: str, prefer: str | None = None):
    """Runs of `commit` on tasks a, b and seeds 0, 1 through a fresh Ray executor on the cluster:
    (the driver's environment, its note, its slots, the runs' stage executions, the results)."""
    from pipeline.executors.ray_executor import RayExecutor

    ids = experiment.ensure_runs(store, lab, commit, ["a", "b"], [0, 1], harness=TinyHarness())
    executor = RayExecutor(cpus=1, preload=("numpy",))
    assert executor.slots == 3 and len(executor.environments()) == 2
    with runner.Driver(lab, store, executor, harness=TinyHarness(), prefer_env=prefer) as d:
        env, note, slots = d.environment, d.environment_note, d.slots
        _free_cpus(3 - slots)  # the other nodes' slots given back: their CPUs free for other work
        d.drive(until=ids, timeout_s=180)
    sha = labrepo.resolve_commit(lab, commit)
    return env, note, slots, store.stage_execs(ids), [r for r in store.results_for(sha) if r.task in ("a", "b")]


def _free_cpus(n: int, within: float = 30.0) -> None:
    """Wait until the cluster has exactly `n` CPUs free (Ray frees an ended actor's CPU soon after)."""
    deadline = time.monotonic() + within
    while ray.available_resources().get("CPU", 0) != n:
        assert time.monotonic() < deadline, (n, ray.available_resources())
        time.sleep(0.3)


def test_stages_stay_on_one_environments_nodes_and_its_cache_keys(mixed_cluster: RayCluster, tmp_path: Path) -> None:
    lab = make_lab(tmp_path / "lab", timeout_s=60)
    store = experiment.open_store(lab)
    repo = labrepo.LabRepo(lab.root)

    # the most slots: the head node's two, the venv's own numpy
    env, note, slots, execs, results = _measure(lab, store, BASE)
    assert dict(env.packages)["numpy"] != OLD_NUMPY
    assert slots == 2
    assert note is not None and note.startswith("1 of 3 slots given back to the cluster") and f"→ {OLD_NUMPY}" in note, note
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
    assert note2 is not None and note2.startswith("2 of 3 slots given back to the cluster"), note2
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


def _job(tmp_path: Path, name: str) -> StageJob:
    code, out = tmp_path / "code", tmp_path / "out" / name
    for d in (code, out):
        d.mkdir(parents=True, exist_ok=True)
    (code / "stage.py").write_text("import sys, time\ntime.sleep(0.3)\nopen(sys.argv[1] + '/done', 'w').write('ok')\n")
    return StageJob(job_id=f"{name}-{uuid.uuid4().hex[:6]}", cwd=code, commit="0" * 40, out=out,
                    argv=["python", str(code / "stage.py"), str(out)], log_path=tmp_path / "logs" / f"{name}.log",
                    timeout_s=60)


def _collect(ex, jobs: list, limit: float = 120) -> dict:
    for j in jobs:
        ex.submit(j)
    got: dict = {}
    deadline = time.monotonic() + limit
    while len(got) < len(jobs) and time.monotonic() < deadline:
        got.update({r.job_id.split("-")[0]: r for r in ex.poll(0.3)})
    assert len(got) == len(jobs), got
    return got


def test_a_replacement_waits_for_room_on_its_environments_node_and_a_lost_environment_fails_in_a_line(
        head_only: RayCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from pipeline.executors import ray_executor
    from pipeline.executors.ray_executor import RayExecutor

    @ray.remote(num_cpus=1)
    class Blocker:  # holds a CPU of the head node
        def ping(self) -> int:
            return 1

    def block_head() -> object:
        b = Blocker.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=head_id, soft=False)).remote()
        assert ray.get(b.ping.remote(), timeout=60) == 1
        return b

    head_id = next(n["NodeID"] for n in ray.nodes() if n["Alive"])
    ex = RayExecutor(cpus=1, preload=())
    blockers = []
    try:
        assert ex.slots == 2
        assert ex.measure_in(lambda facts: facts["packages"].get("numpy") != OLD_NUMPY) == 0
        assert ex._nodes == [head_id] and {s.node for s in ex._idle} == {head_id}
        # a node of another environment joins the cluster (an autoscaler's, a replaced machine)
        head_only._start([f"--address={head_only.address}", "--num-cpus=1"], older_stack(tmp_path))
        deadline = time.monotonic() + 60
        while ray.cluster_resources().get("CPU", 0) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.5)
        victim, survivor = list(ex._idle)
        ray.kill(victim.actor)  # its node keeps going; the actor is lost
        blockers.append(block_head())  # the lost actor's CPU: taken, so there is room on the new node only
        got = _collect(ex, [_job(tmp_path, f"s{i}") for i in range(4)])
        assert sorted(r.status for r in got.values()) == ["infra", "ok", "ok", "ok"], got
        # the stages that ran, ran on the head node: never on the older numpy's
        assert {r.host for r in got.values() if r.status == "ok"} == {f"{os.uname().nodename}/ray-{head_id[:8]}"}
        (fresh,) = [s for s in ex._idle if s is not survivor]
        time.sleep(3)
        ex.poll(0.3)
        # its replacement waits for room on the head node: the new node's CPU stays free, no actor there
        assert fresh.pending is not None and fresh.facts is None
        _free_cpus(1)
        ray.kill(blockers.pop())  # room again on the head node: it warms there
        deadline = time.monotonic() + 90
        while fresh.pending is not None:
            assert time.monotonic() < deadline
            ex.poll(0.3)
        assert fresh.node == head_id and fresh.facts["packages"]["numpy"] != OLD_NUMPY
        got = _collect(ex, [_job(tmp_path, f"u{i}") for i in range(2)])
        assert {r.status for r in got.values()} == {"ok"}
        # then both head slots are lost and the head node is full: no slot measures with the driver's
        # environment, and none starts there in WARM_TIMEOUT_S; the stages waiting fail as infrastructure,
        # in one line (the new node's free CPU is not used)
        monkeypatch.setattr(ray_executor, "WARM_TIMEOUT_S", 3.0)
        for slot in list(ex._idle):
            ray.kill(slot.actor)
        blockers += [block_head(), block_head()]
        # two stages go to the dead actors (lost, as infrastructure) and ask for replacements on the
        # full head node; the third waits for them, then fails with the reason
        got = _collect(ex, [_job(tmp_path, f"t{i}") for i in range(3)], limit=60)
        assert {r.status for r in got.values()} == {"infra"}
        assert any("no slot of the cluster measures with the driver's environment any more" in (r.detail or "")
                   for r in got.values()), [r.detail for r in got.values()]
        assert ray.available_resources().get("CPU", 0) == 1
    finally:
        ex.close()
        for b in blockers:
            ray.kill(b)


def test_a_mixed_clusters_other_nodes_slots_are_given_back_and_a_stray_replacement_ended(
        mixed_cluster: RayCluster) -> None:
    """`measure_in` ends the slots on the other environment's node (its CPU free again), and a
    replacement asked for before it (placed anywhere) that warms up there is ended and asked for
    again on the driver's environment's node."""
    from pipeline.executors.ray_executor import RayExecutor

    ex = RayExecutor(cpus=1, preload=())
    try:
        assert ex.slots == 3
        _free_cpus(0)
        stray = next(s for s in ex._idle if s.facts["packages"]["numpy"] == OLD_NUMPY)
        assert ex.measure_in(lambda facts: facts["packages"].get("numpy") != OLD_NUMPY) == 1
        assert ex.slots == 2 and stray not in ex._idle and len(ex._nodes) == 1
        _free_cpus(1)
        # a replacement made before the choice lands where Ray puts it: on the older node's free CPU
        actor = ex._new_worker()
        late = ray_executor_slot(actor)
        ex._idle.append(late)
        ray.wait([late.pending], timeout=60)
        ex.poll(0.3)  # the sweep: ended, and another asked for on the driver's node (full: it waits)
        assert late not in ex._idle and ex._released == 2
        (again,) = [s for s in ex._idle if s.pending is not None]
        _free_cpus(1)
    finally:
        ex.close()


def _take_down(cluster: RayCluster, node_id: str) -> None:
    """Kill the processes of the cluster's second node (`node_id`) and wait until Ray sees it dead."""
    import psutil

    for p in [p for p in cluster.processes() if cluster.dirs[1] in " ".join(p.cmdline())]:
        try:
            p.kill()
        except psutil.Error:
            pass
    deadline = time.monotonic() + 90
    while any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
        assert time.monotonic() < deadline, "Ray did not notice the node's death"
        time.sleep(0.5)


def ray_executor_slot(actor):
    from pipeline.executors.ray_executor import _Slot

    return _Slot(actor, pending=actor.warm.remote())


def test_when_the_environments_nodes_are_replaced_the_new_ones_are_tried_and_learned(tmp_path: Path) -> None:
    """Spot machines taken back, the autoscaler's new ones minutes later: the slots lost while no
    node can take them are asked of the cluster anyway and wait, pending (an autoscaler's demand);
    the node that joins is tried, it measures with the driver's environment, so it is learned and
    the stages go on there."""
    from pipeline.executors.ray_executor import RayExecutor

    with ray_exclusive(), RayCluster(head_cpus=0, worker_cpus=2) as cluster, cluster.connected():
        ex = RayExecutor(cpus=1, preload=())
        try:
            assert ex.slots == 2
            assert ex.measure_in(lambda facts: facts["packages"].get("numpy") != OLD_NUMPY) == 0
            (first,) = ex._nodes
            _take_down(cluster, first)  # the machine is taken back
            # the stages sent to its slots are lost; no node can take their replacements yet
            got = _collect(ex, [_job(tmp_path, f"s{i}") for i in range(2)], limit=60)
            assert {r.status for r in got.values()} == {"infra"}, got
            # their replacements wait, pending, for a node to join (the demand an autoscaler scales up for)
            assert len(ex._idle) == 2 and all(s.pending is not None and s.node is None for s in ex._idle)
            waiting = [_job(tmp_path, f"u{i}") for i in range(4)]
            for j in waiting:
                ex.submit(j)
            ex.poll(1.0)  # they wait for a slot: not failed as stranded
            cluster._start([f"--address={cluster.address}", "--num-cpus=2"])  # the new machine
            (second,) = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")]
            got = {}
            deadline = time.monotonic() + 180
            while len(got) < len(waiting) and time.monotonic() < deadline:
                got.update({r.job_id.split("-")[0]: r for r in ex.poll(0.3)})
            assert {r.status for r in got.values()} == {"ok"} and len(got) == 4, got
            assert {r.host for r in got.values()} == {f"{os.uname().nodename}/ray-{second[:8]}"}
            assert ex._nodes == [first, second] and all(s.node == second for s in ex._idle), ex._idle
        finally:
            ex.close()


def test_when_every_node_of_the_environment_is_gone_and_others_live_the_loop_stops_to_measure_there(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster re-imaged under a running loop (another numpy, torch or driver), node by node: once no
    node of the driver's environment has been alive for ENV_GONE_S while nodes of another live, the
    driver says so and the loop stops as after an upgrade on its own machine (`environment changed`,
    `run` exits with code 3; its next start measures in the cluster's environment). While no node that
    could take a slot is alive, it is an outage, not a move: nothing is said."""
    from agent.loop import ENVIRONMENT_CHANGED, guards
    from pipeline.executors import ray_executor
    from pipeline.executors.ray_executor import RayExecutor
    from support.lab import make_loop

    from pipeline.harness import HARNESSES

    monkeypatch.setattr(ray_executor, "ENV_GONE_S", 2.0)
    monkeypatch.setattr(guards, "CLUSTER_ENV_CHECK_S", 0.0)
    monkeypatch.setattr(HARNESSES, "_entries", {**HARNESSES._entries, "tiny": TinyHarness})  # the loop opens
    # the lab, whose harness is named as a plugin's would be
    lab = make_lab(tmp_path / "lab", timeout_s=60)
    store = experiment.open_store(lab)
    with ray_exclusive(), RayCluster(head_cpus=0, worker_cpus=2) as cluster, cluster.connected():
        loop = make_loop(lab.root, offline=True, max_hypotheses=1)
        try:
            with runner.Driver(lab, store, RayExecutor(cpus=1, preload=()), harness=TinyHarness()) as d:
                ex = d.executor
                (first,) = ex._nodes
                assert d.environment_gone() is None and not loop.environment_moved(d)
                _take_down(cluster, first)  # the node is taken down to be re-imaged
                got = _collect(ex, [_job(tmp_path, f"s{i}") for i in range(2)], limit=60)
                assert {r.status for r in got.values()} == {"infra"}, got  # sent to the dead slots
                time.sleep(2.5)  # past ENV_GONE_S with no node alive but the head (no CPU: no slot)
                assert d.environment_gone() is None and not loop.environment_moved(d)
                # the node comes back with another numpy: a lost slot is tried there, given back
                cluster._start([f"--address={cluster.address}", "--num-cpus=2"], older_stack(tmp_path))
                deadline = time.monotonic() + 120
                while not ex._foreign:
                    assert time.monotonic() < deadline, "the new node was never tried"
                    ex.poll(0.3)
                    time.sleep(0.3)
                assert ex._nodes == [first]
                why = d.environment_gone()  # the clock starts at the first look that sees it
                assert why is None
                time.sleep(2.5)
                why = d.environment_gone()
                assert why is not None and "no node of the measurement environment is left" in why, why
                assert "every live node of the cluster that could hold a slot (1) has measured with another" in why
                assert loop.environment_moved(d) and loop.stop_reason == ENVIRONMENT_CHANGED and loop.stop.is_set()
            [ev] = [e for e in loop.records.events(20) if e.kind == "environment"]
            assert "the cluster's environment changed under the running loop" in ev.message
        finally:
            loop.close()
