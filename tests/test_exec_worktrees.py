"""Worktrees and cache keys on real git repositories."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.tiny import commit_change, git, make_lab

from pipeline.dag import Cache, UserError, check_not_sealed, input_digests, plan_run, render
from pipeline.worktrees import InfrastructureFailure, Worktrees

pytestmark = pytest.mark.integration


@pytest.fixture
def lab(tmp_path: Path):
    return make_lab(tmp_path / "lab")


def test_one_worktree_per_commit_created_then_reused(lab) -> None:
    wt = Worktrees(lab.root, lab.state)
    branch = commit_change(lab.root, "hyp/1-scale", "model.py", "SCALE = 1.0", "SCALE = 2.0")
    p1 = wt.ensure("autoresearch/baseline")
    p2 = wt.ensure(branch)
    assert p1 != p2 and p1.parent == p2.parent == lab.state / "worktrees"
    assert "SCALE = 2.0" in (p2 / "model.py").read_text()
    assert "SCALE = 1.0" in (p1 / "model.py").read_text()
    marker = p1 / "marker"
    marker.write_text("x")
    assert wt.ensure("autoresearch/baseline") == p1 and marker.exists()  # reused, not recreated
    assert wt.gc(keep=[wt.resolve(branch)]) == ([p1.name], 0)
    assert not p1.exists() and p2.exists()
    assert "\n" not in git(lab.root, "worktree", "list")  # the lab's own checkout: trees are laid out, not checked out
    with pytest.raises(InfrastructureFailure):
        wt.ensure("no-such-branch")


def test_repair_after_a_killed_process(lab) -> None:
    """What is not a commit's whole tree goes at start-up, and is laid out again on demand: a tree
    something wrote into, a half-laid one, a folder of another name, a git checkout of an earlier
    version (with git's locked record of it)."""
    wt = Worktrees(lab.root, lab.state)
    sha = wt.resolve("autoresearch/baseline")
    branch = wt.resolve(commit_change(lab.root, "hyp/1-scale", "model.py", "SCALE = 1.0", "SCALE = 2.0"))
    path, sound = wt.ensure(sha), wt.ensure(branch)
    (path / "model.py").write_text("SCALE = 99\n")  # something scribbled on it
    (path / "junk.bin").write_text("x")
    half = lab.state / "worktrees" / f".tmp-{sha}-999999-abcdef"  # a layout killed halfway
    half.mkdir()
    (half / "model.py").write_text("partial")
    legacy = lab.state / "worktrees" / ("0" * 40)
    other = wt.resolve(commit_change(lab.root, "hyp/2-scale", "model.py", "SCALE = 1.0", "SCALE = 3.0"))
    git(lab.root, "worktree", "add", "-q", "--detach", str(wt.path(other)), other)  # an earlier version's
    git(lab.root, "worktree", "lock", str(wt.path(other)))
    legacy.mkdir()
    fixed = wt.repair()
    assert sorted(fixed) == sorted([f"removed {half.name[:40]}, not a commit's tree",
                                    f"removed the tree of {sha[:12]}, which differed from its commit",
                                    f"removed the tree of {other[:12]}, which differed from its commit",
                                    f"removed the tree of {'0' * 12}, which differed from its commit"]), fixed
    assert not half.exists() and not legacy.exists() and not path.exists() and not wt.path(other).exists()
    assert "\n" not in git(lab.root, "worktree", "list")  # git's record of the checkout is gone too
    assert sound.is_dir() and wt.repair() == []  # a sound tree stays
    assert wt.ensure(sha) == path and (path / "model.py").read_text() == "SCALE = 1.0\n"
    assert not (path / "junk.bin").exists()
    assert "SCALE = 3.0" in (wt.ensure(other) / "model.py").read_text() and not (wt.path(other) / ".git").exists()


def test_cache_keys_read_inputs_from_git_not_from_the_working_directory(lab) -> None:
    wt = Worktrees(lab.root, lab.state)
    base = wt.resolve("autoresearch/baseline")
    before = input_digests(wt, base, ["model.py", "config.toml#finetune", "*.md"])
    (lab.root / "model.py").write_text("SCALE = 5.0\n")  # uncommitted: must not matter
    assert input_digests(wt, base, ["model.py", "config.toml#finetune", "*.md"]) == before
    assert set(before) == {"model.py", "config.toml#finetune", "program.md"}
    git(lab.root, "checkout", "--", "model.py")


def test_a_finetune_only_change_keeps_the_pretrain_key(lab) -> None:
    wt = Worktrees(lab.root, lab.state)
    base = wt.resolve("autoresearch/baseline")
    ft = commit_change(lab.root, "hyp/2-shrink", "config.toml", "shrink = 0.1", "shrink = 0.3")
    pt = commit_change(lab.root, "hyp/3-scale", "model.py", "SCALE = 1.0", "SCALE = 3.0")
    stages = lab.stages_in_order()

    def keys(commit: str, task: str = "a", seed: int = 0) -> dict[str, str]:
        return {n.name: n.key for n in plan_run(stages, commit, task, seed, "ds1", lambda c, p: input_digests(wt, c, p))}

    b, f, p = keys(base), keys(ft), keys(pt)
    assert f["pretrain"] == b["pretrain"] and f["finetune"] != b["finetune"]
    assert p["pretrain"] != b["pretrain"] and p["finetune"] != b["finetune"]  # upstream key changed
    assert keys(base, task="b")["pretrain"] == b["pretrain"]  # seed-scoped: shared by tasks
    assert keys(base, task="b")["finetune"] != b["finetune"]
    assert keys(base, seed=1)["pretrain"] != b["pretrain"]
    other_data = {n.name: n.key for n in plan_run(stages, base, "a", 0, "ds2", lambda c, p: input_digests(wt, c, p))}
    assert other_data["pretrain"] != b["pretrain"]


def test_render_and_sealed_paths(tmp_path: Path) -> None:
    argv = render("python train.py --data {data} --out={out} --tag '{task} x'", {"data": "/d ir", "out": "/o", "task": "t"})
    assert argv == ["python", "train.py", "--data", "/d ir", "--out=/o", "--tag", "t x"]
    with pytest.raises(UserError):
        render("python x.py {nope}", {})
    sealed = tmp_path / "runs" / "sealed"
    sealed.mkdir(parents=True)
    cwd = tmp_path / "runs" / "worktrees" / "abc"
    cwd.mkdir(parents=True)
    check_not_sealed(["python", "x.py", "--data", str(tmp_path / "runs" / "data")], cwd, [sealed])
    for bad in (str(sealed / "ds" / "labels.npz"), "../../sealed", f"--labels={sealed}"):
        with pytest.raises(UserError):
            check_not_sealed(["python", "x.py", bad], cwd, [sealed])


def test_cache_publish_is_atomic_and_first_writer_wins(tmp_path: Path) -> None:
    cache = Cache(tmp_path / "cache")
    t1, t2 = cache.new_tmp("k" * 64), cache.new_tmp("k" * 64)
    (t1 / "out.txt").write_text("first")
    (t2 / "out.txt").write_text("second")
    assert not cache.has("k" * 64)
    assert cache.publish(t1, "k" * 64) == cache.path("k" * 64)
    assert cache.publish(t2, "k" * 64) == cache.path("k" * 64)
    assert (cache.path("k" * 64) / "out.txt").read_text() == "first"
    assert not t2.exists()
    orphan = cache.tmp_root / f"{'z' * 16}-999999-abcdef01"  # left by a dead driver
    orphan.mkdir()
    mine = cache.new_tmp("m" * 64)
    assert cache.clear_tmp() == 1 and not orphan.exists() and mine.exists()
    assert os.getpid() != 999999


def test_gc_removes_the_views_and_worktrees_of_commits_no_run_needs_and_the_disk_keeper_keeps_the_rest(lab) -> None:
    """The disk keeper's collection: a decided challenger's and a superseded champion's worktrees
    and views go; the baseline head's, a commit with runs queued, and a view that does not say whose
    it is (the trusted files, an earlier version's) stay. What went is made again on demand."""
    from pipeline import experiment
    from pipeline.dag import Cache
    from pipeline.disk import DiskKeeper

    wt = Worktrees(lab.root, lab.state)
    base = wt.resolve("autoresearch/baseline")
    decided = wt.resolve(commit_change(lab.root, "hyp/1-scale", "model.py", "SCALE = 1.0", "SCALE = 2.0"))
    queued = wt.resolve(commit_change(lab.root, "hyp/2-scale", "model.py", "SCALE = 1.0", "SCALE = 3.0"))
    every = lambda p: True  # noqa: E731
    views = {c: wt.view(c, every) for c in (base, decided, queued)}
    trusted = wt.view(decided, lambda p: p == "model.py", collectable=False)
    trees = {c: wt.ensure(c) for c in (base, decided, queued)}
    store = experiment.open_store(lab)
    store.ensure_arm(queued)
    store.enqueue(queued, [("a", 0)])
    keeper = DiskKeeper(lab, store, Cache(lab.state / "cache"), lab.state / "logs")
    assert keeper.collect_due()
    assert keeper.collect(wt) == (1, 1)
    assert not trees[decided].exists() and not views[decided].exists()
    assert all(trees[c].is_dir() and views[c].is_dir() for c in (base, queued))
    assert trusted.is_dir() and not keeper.collect_due()
    assert not [p for p in (lab.state / "views").iterdir() if p.name.startswith(".gone-")]
    # made again on demand, at the same place
    assert wt.view(decided, every) == views[decided] and "SCALE = 2.0" in (views[decided] / "model.py").read_text()
    assert "SCALE = 2.0" in (wt.ensure(decided) / "model.py").read_text()
