"""Hostile branches on the Ray executor (issue 20: "the attack suite runs on the Ray executor as well
as the local one"), and the Ray node's own unpacking of a stage's code view.

- The node lays out the code view and input folders with the driver's link-safe extraction
  (`pipeline/safefs.py`, shipped to the node as source), not tarfile's `data` filter, which checks one
  link at a time as it extracts it: a chain of links passes that. Tested on real tar archives against
  the function the actor calls (no cluster needed), then through a real actor on a real cluster.
- A representative subset of tests/test_attacks.py's branches, measured by `autoresearch run
  --executor ray` on a real `ray start --head` cluster (RAY_AUTH_MODE=disabled, as the README says),
  with the same outcomes as on the local executor: (a) the sealed labels are not reachable, (c)
  nothing outside `{out}` is writable, and a branch whose tree holds a link out of it is refused
  before anything of it runs, on either executor.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import sqlite3
import tarfile
import uuid
from pathlib import Path

import pytest

from support.lab import cli, cli_env, git
from support.ray_cluster import ENV, RayCluster, ray_exclusive, require_ray
from support.tiny import require_sandbox

pytestmark = pytest.mark.system

ray = require_ray()

from test_attacks import _attack_train, _branch, _make_lab

CHAIN = {"config.toml": "model.py/../X", "model.py": "train.py/..", "train.py": "."}  # issue 20's chain


def tar_of(entries: list[tuple[str, str | None]]) -> bytes:
    """A tar archive of (name, link target, or None for a small regular file), in the order given."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, target in entries:
            info = tarfile.TarInfo(name)
            if target is None:
                data = f"# {name}\n".encode()
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                info.type, info.linkname = tarfile.SYMTYPE, target
                tar.addfile(info)
    return buf.getvalue()


def node_worker():
    """A warm worker as a Ray node builds it (its sources written to the node cache), outside Ray:
    its `safefs` is the node's copy of pipeline/safefs.py, loaded from that file."""
    from pipeline.executors import ray_task
    from pipeline.executors.ray_executor import node_sources

    w = ray_task.WarmWorker(node_sources(), preload=[])
    assert w.safefs.__file__ == os.path.join(w.pkg, "_ar_safefs.py")
    return w


def x_files(top: Path) -> list[Path]:
    return [Path(d) / "X" for d, dirs, files in os.walk(top) if "X" in files + dirs]


# ----------------------------------------------------------------------------- the node's unpacking

@pytest.mark.parametrize("order", list(itertools.permutations(CHAIN)))
def test_the_node_refuses_a_chain_of_links_in_every_order_and_writes_nothing_outside(tmp_path: Path,
                                                                                     order: tuple[str, ...]) -> None:
    from pipeline.executors import ray_task

    w = node_worker()
    dest = tmp_path / "node" / "tree" / "abc"
    dest.parent.mkdir(parents=True)
    entries = [(n, CHAIN[n]) for n in order] + [("X", None), ("model.py/X", None)]
    with pytest.raises(w.safefs.UnsafeTree, match=r"leads out of it|symlink or not a folder") as e:
        ray_task.unpack(tar_of(entries), str(dest), w.safefs, what="the code view abc")
    assert "\n" not in str(e.value) and "Errno" not in str(e.value), str(e.value)
    assert not dest.exists() and list(dest.parent.iterdir()) == []  # nothing left, the half-made copy removed
    assert x_files(tmp_path) == []  # nothing written through the links, above the tree or anywhere


@pytest.mark.parametrize("target", ["/etc/passwd", "..", "sub/../..", "a/../../x"])
def test_the_node_refuses_a_link_that_leaves_the_tree(tmp_path: Path, target: str) -> None:
    from pipeline.executors import ray_task

    w = node_worker()
    entries = [("sub/f", None), ("a", "sub"), ("link", target)]
    with pytest.raises(w.safefs.UnsafeTree, match="leads out of it"):
        ray_task.unpack(tar_of(entries), str(tmp_path / "tree"), w.safefs)
    assert not (tmp_path / "tree").exists()


def test_the_data_filter_the_node_used_before_lays_the_chain_out(tmp_path: Path) -> None:
    """Why the node changed: tarfile's `data` filter checks each link of the chain as it comes (each
    passes: the links it goes through do not exist yet), and the whole chain then leads out."""
    with tarfile.open(fileobj=io.BytesIO(tar_of(list(CHAIN.items())))) as tar:
        tar.extractall(tmp_path / "tree", filter="data")
    assert os.path.realpath(tmp_path / "tree" / "config.toml") == str(tmp_path.parent / "X")  # two folders up


def test_the_node_lays_out_links_that_stay_inside(tmp_path: Path) -> None:
    from pipeline.executors import ray_task

    w = node_worker()
    entries = [("up", "sub/deeper/.."), ("sub/deeper/f.txt", None), ("alias", "up/deeper/f.txt"), ("run.sh", None)]
    dest = ray_task.unpack(tar_of(entries), str(tmp_path / "tree"), w.safefs)
    assert (Path(dest) / "alias").read_text() == "# sub/deeper/f.txt\n"
    assert ray_task.unpack(b"not read: it is there already", dest, w.safefs) == dest  # once per node


# ----------------------------------------------------------------------------- on a real cluster

@pytest.fixture(scope="module")
def cluster():
    """One real `ray start --head` node of 2 CPUs for this module (the Ray file lock held: Ray modules
    never overlap)."""
    with ray_exclusive(), RayCluster(head_cpus=2, worker_cpus=0) as c:
        yield c


def on_a_warm_worker(cluster, monkeypatch, tmp_path: Path, ident: str, entries: list[tuple[str, str | None]],
                     argv: list[str], timeout_s: float, probe) -> tuple[dict, object]:
    """One unsandboxed stage on a real `WarmWorker` actor of `cluster`, its code view the tar of
    `entries`: the actor's result, and `probe()` as the node computes it."""
    from pipeline.executors import ray_task
    from pipeline.executors.ray_executor import node_sources

    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    try:
        ray.cloudpickle.register_pickle_by_value(ray_task)
        actor = ray.remote(ray_task.WarmWorker).options(num_cpus=1, max_restarts=0).remote(node_sources(), [])
        job = {"job_id": ident, "tree_id": ident, "cwd": str(tmp_path / "view"), "out": str(tmp_path / "out"),
               "argv": argv, "env": {}, "env_allow": ["PATH"], "env_prefixes": [], "sandbox": None, "cpus": 1,
               "memory_mb": None, "timeout_s": timeout_s}
        res = ray.get(actor.run.remote(job, [ray.put(tar_of(entries))], []), timeout=120)
        seen = ray.get(ray.remote(probe).remote())
        ray.kill(actor)
    finally:
        ray.shutdown()
    return res, seen


def test_a_warm_worker_actor_refuses_a_hostile_code_view_as_the_stages_failure(cluster, tmp_path: Path,
                                                                               monkeypatch) -> None:
    from pipeline.executors import ray_task

    ident = f"hostile-{uuid.uuid4().hex[:12]}"
    res, node_cache = on_a_warm_worker(
        cluster, monkeypatch, tmp_path, ident, [("train.py", "."), ("model.py", "train.py/.."), ("config.toml", "model.py/../X")],
        ["python", "-c", "open('/tmp/ran', 'w')"], 30, lambda: ray_task.NODE_CACHE)
    assert (res["status"], res["exit_code"]) == ("exit", 1), res
    assert res["detail"].startswith(f"ray node: the code view {ident} holds a symlink that leads out of it"), res
    assert res["log"].decode().startswith("ray node: ") and res["out"] == b""
    from pipeline.executors import classify
    from pipeline.executors.base import JobResult

    assert classify(JobResult(ident, res["status"], exit_code=res["exit_code"])) == ("method", "crash")
    assert not os.path.exists(os.path.join(node_cache, "tree", ident))  # nothing of it kept on the node
    assert x_files(Path(node_cache) / "tree") == [] and not os.path.exists(os.path.join(node_cache, "X"))


LINK_OUT = "../../runs/sealed"  # config.toml of the branch: a link whose target leaves the tree


@pytest.fixture(scope="module")
def attacked_on_ray(cluster, tmp_path_factory: pytest.TempPathFactory) -> dict:
    require_sandbox()
    base = tmp_path_factory.mktemp("attacks-ray")
    home = base / "home"
    home.mkdir()
    root = _make_lab(base / "lab", "auto")
    for key in ("a", "c"):
        _branch(root, f"attack-{key}", {"train.py": _attack_train(key, home)})
    git(root, "checkout", "-q", "-b", "attack-link", "autoresearch/baseline")
    (root / "config.toml").unlink()
    os.symlink(LINK_OUT, root / "config.toml")
    git(root, "commit", "-qam", "attack-link")
    git(root, "checkout", "-q", "main")
    branches = ["attack-a", "attack-c", "attack-link"]
    for name in branches:
        out = cli(root, "seed", "--branch", name, "--title", name)
        assert out.returncode == 0, out.stderr
    env = cli_env(HOME=str(home), **ENV)
    run = cli(root, "run", "--offline", "--max-hypotheses", str(len(branches)), "--executor", "ray",
              "--ray-address", cluster.address, "--workers", "2", env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "executor ray (2 slots)" in run.stderr
    status = cli(root, "status", "--json", env=env)
    assert status.returncode == 0, status.stderr
    hyps = {h["title"]: h for h in json.loads(status.stdout)["hypotheses"]}
    return {"root": root, "hyps": hyps, "db": sqlite3.connect(root / "runs" / "autoresearch.db")}


def _logs_of(ctx: dict, key: str) -> str:
    h = ctx["hyps"][f"attack-{key}"]
    commit = ctx["db"].execute("SELECT \"commit\" FROM hypothesis WHERE id = ?", (h["id"],)).fetchone()[0]
    rows = ctx["db"].execute("SELECT s.log_path, s.executor FROM stage_exec s JOIN run r ON r.id = s.run_id "
                             "WHERE r.\"commit\" = ?", (commit,)).fetchall()
    assert rows and {e for _, e in rows} == {"ray"}, rows  # its stages ran on the cluster
    return "\n".join(Path(p).read_text(errors="replace") for p, _ in rows if p and Path(p).is_file())


def _not_promoted(ctx: dict, key: str) -> dict:
    h = ctx["hyps"][f"attack-{key}"]
    assert h["status"] == "done" and h["decision"] != "promote" and h["promoted_tag"] is None, h
    return h


def test_on_ray_nothing_was_promoted_and_the_baseline_never_moved(attacked_on_ray: dict) -> None:
    root = attacked_on_ray["root"]
    assert git(root, "tag", "-l", "baseline/*") == ""
    assert git(root, "rev-parse", "autoresearch/baseline") == git(root, "rev-parse", "main")
    assert set(attacked_on_ray["hyps"]) == {"attack-a", "attack-c", "attack-link"}


def test_on_ray_attack_a_sealed_labels_are_not_in_the_sandbox(attacked_on_ray: dict) -> None:
    _not_promoted(attacked_on_ray, "a")
    text = _logs_of(attacked_on_ray, "a")
    assert "ATTACK a BLOCKED: no sealed labels reachable" in text and "SUCCEEDED" not in text


def test_on_ray_attack_c_nothing_outside_out_is_writable(attacked_on_ray: dict) -> None:
    _not_promoted(attacked_on_ray, "c")
    text = _logs_of(attacked_on_ray, "c")
    assert "ATTACK c BLOCKED" in text and "SUCCEEDED" not in text
    assert "Read-only file system" in text  # the upstream output it was given, the node's copy
    assert not list((attacked_on_ray["root"] / "runs").rglob("PWNED"))


def test_on_ray_a_link_out_of_the_tree_is_refused_before_anything_runs(attacked_on_ray: dict) -> None:
    h = _not_promoted(attacked_on_ray, "link")
    assert (h["decision"], h["reject_kind"]) == ("reject", "smoke_failed"), h
    db = attacked_on_ray["db"]
    reason = db.execute("SELECT reject_reason FROM hypothesis WHERE id = ?", (h["id"],)).fetchone()[0]
    assert f"config.toml -> {LINK_OUT}" in reason and "leads out of it" in reason and "Traceback" not in reason
    commit = git(attacked_on_ray["root"], "rev-parse", "attack-link")
    assert db.execute("SELECT count(*) FROM run WHERE \"commit\" = ?", (commit,)).fetchone()[0] == 0


def test_the_nodes_default_memory_bound_is_the_local_executors(tmp_path: Path) -> None:
    """With no `[run] memory_mb`, a Ray node bounds a CPU stage as the local executor does on the same
    machine (`pipeline.memory.memory_plan`), from the node's own MemTotal and cores; a GPU stage gets none."""
    from pipeline.executors import ray_task
    from pipeline.lab import RunSection
    from pipeline.memory import local_slots, memory_plan

    meminfo = tmp_path / "meminfo"
    for total_mb in (24_000, 3_000, 512_000):
        meminfo.write_text(f"MemTotal:       {total_mb * 1024} kB\nMemFree:  1 kB\n")
        for cpus in (1, 2):
            run = RunSection(cpus=cpus)
            plan = memory_plan(run, local_slots(run), total_mb)
            sandbox = {"tmp_max_mb": run.tmp_max_mb, "out_max_mb": run.out_max_mb}
            assert ray_task.node_memory_mb(cpus, 0, sandbox, str(meminfo)) == plan.memory_mb, (total_mb, cpus)
    assert ray_task.node_memory_mb(1, 1, {"tmp_max_mb": 1, "out_max_mb": 1}, str(meminfo)) is None
    assert ray_task.node_memory_mb(1, 0, None, str(tmp_path / "missing")) is None


def test_a_ray_stage_without_memory_mb_runs_under_the_nodes_bound(cluster, tmp_path: Path, monkeypatch) -> None:
    """A real warm-worker actor: the stage's own RLIMIT_AS is the node's default, not unlimited."""
    from pipeline.executors import ray_task

    res, expected = on_a_warm_worker(
        cluster, monkeypatch, tmp_path, f"rlimit-{uuid.uuid4().hex[:12]}", [("README", None)],
        ["python", "-c", "import resource; print('rlimit_as', resource.getrlimit(resource.RLIMIT_AS)[0])"], 60,
        lambda: ray_task.node_memory_mb(1, 0, None))
    assert (res["status"], res["exit_code"]) == ("ok", 0), res
    (limit,) = [int(ln.split()[1]) for ln in res["log"].decode().splitlines() if ln.startswith("rlimit_as ")]
    assert expected is not None and expected >= 1024
    # the bound is on top of what the forked child maps already (child._limit_memory)
    assert expected << 20 <= limit < (expected + 4096) << 20, (limit >> 20, expected)
