"""Hostile branches, round two (issue 20): links. A chain of symlinks in the baseline made the smoke
run's `materialize` write, as root, a file into LAB/runs/ (beside the store and `sealed/`):
`config.toml -> model.py/../X`, `model.py -> train.py/..`, `train.py -> .`. Each link passes a check
made when it is extracted; the later ones change where the earlier ones resolve. Real git repos,
the real CLI, the real smoke path, real tar archives; no mocks.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest
from support.lab import BASELINE, cli, git, records

from pipeline import experiment

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CHAIN = {"config.toml": "model.py/../X", "model.py": "train.py/..", "train.py": "."}


def plant_chain(root: Path) -> str:
    """The baseline's config.toml, model.py and train.py replaced by the chain of links (committed on
    the baseline branch only: the lab's checkout keeps its files, so the lab still loads)."""
    for name, target in CHAIN.items():
        (root / name).unlink()
        os.symlink(target, root / name)
    git(root, "add", "-A")
    git(root, "commit", "-qm", "a chain of links")
    git(root, "branch", "-f", BASELINE, "HEAD")
    commit = git(root, "rev-parse", "HEAD")
    git(root, "reset", "-q", "--hard", "HEAD~1")
    return commit


def outside_files(root: Path) -> set[str]:
    """Every path at or above the lab that the chain could reach (X in runs/, the lab, its parent)."""
    return {str(p) for d in (root / "runs", root, root.parent) if d.is_dir() for p in d.iterdir() if p.name == "X"}


def test_a_chain_of_links_in_the_baseline_writes_nothing_outside_and_the_seed_is_refused(lab: Path,
                                                                                         tmp_path: Path) -> None:
    """Through the real CLI: a seeded edit of config.toml on a baseline holding the chain."""
    plant_chain(lab)
    seed = tmp_path / "seed.json"
    seed.write_text(json.dumps({"title": "Write through the chain", "rationale": "attack",
                                "edits": [{"path": "config.toml", "content": "pwned = true\n"}]}))
    out = cli(lab, "seed", "--file", str(seed))
    assert out.returncode == 0, out.stderr
    out = cli(lab, "run", "--offline", "--max-hypotheses", "1", timeout=600)
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert not outside_files(lab), outside_files(lab)  # nothing written through the links, as root or not
    status = json.loads(cli(lab, "status", "--json").stdout)
    [h] = [h for h in status["hypotheses"] if h["title"] == "Write through the chain"]
    assert (h["decision"], h["reject_kind"]) == ("reject", "smoke_failed"), h
    reason = records(lab).get(h["id"]).reject_reason or ""
    assert "config.toml -> model.py/../X" in reason and "leads out of it" in reason, reason
    assert "Traceback" not in reason


def tar_of(entries: list[tuple[str, str | None]]) -> bytes:
    """A tar archive of (name, link target or None for a small regular file), in the order given."""
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


@pytest.mark.parametrize("order", list(itertools.permutations(CHAIN)))
def test_the_chain_is_refused_in_every_order_and_nothing_lands_outside(tmp_path: Path, order: tuple[str, ...]) -> None:
    from pipeline.safefs import UnsafeTree, extract_tar

    dst = tmp_path / "a" / "b" / "tree"
    entries = [(name, CHAIN[name]) for name in order] + [("X", None), ("model.py/X", None)]
    with pytest.raises(UnsafeTree, match=r"leads out of it|symlink or not a folder") as e:
        extract_tar(io.BytesIO(tar_of(entries)), dst)
    assert "\n" not in str(e.value) and "Errno" not in str(e.value), str(e.value)
    found = [Path(top) / "X" for top, dirs, files in os.walk(tmp_path) if "X" in files + dirs]
    assert found in ([], [dst / "X"]), found  # an X only ever inside the tree itself


def test_the_chain_alone_is_refused_in_every_order(tmp_path: Path) -> None:
    from pipeline.safefs import UnsafeTree, extract_tar

    for i, order in enumerate(itertools.permutations(CHAIN)):
        with pytest.raises(UnsafeTree, match=r"config\.toml -> model\.py/\.\./X: resolves above the tree's root"):
            extract_tar(io.BytesIO(tar_of([(n, CHAIN[n]) for n in order])), tmp_path / str(i))


def test_links_that_stay_inside_the_tree_are_laid_out(tmp_path: Path) -> None:
    from pipeline.safefs import extract_tar

    entries = [("up", "sub/deeper/.."), ("sub/deeper/f.txt", None), ("alias", "up/deeper/f.txt"),
               ("sub/back", "../alias"), ("dangling", "sub/none")]
    extract_tar(io.BytesIO(tar_of(entries)), tmp_path / "tree")
    assert (tmp_path / "tree" / "sub" / "back").read_text() == "# sub/deeper/f.txt\n"


@pytest.mark.parametrize("target", ["/etc/passwd", "..", "sub/../..", "loop", "a/../../x"])
def test_each_way_out_is_refused(tmp_path: Path, target: str) -> None:
    from pipeline.safefs import UnsafeTree, extract_tar

    entries = [("sub/f", None), ("loop", "loop2"), ("loop2", "loop"), ("a", "sub"), ("link", target)]
    with pytest.raises(UnsafeTree, match="leads out of it"):
        extract_tar(io.BytesIO(tar_of(entries)), tmp_path / "tree")


def test_an_edit_through_a_link_is_refused_even_inside_the_tree(tmp_path: Path) -> None:
    from pipeline.safefs import UnsafeTree, write_text

    root = tmp_path / "tree"
    (root / "real").mkdir(parents=True)
    os.symlink("real", root / "src")
    os.symlink("real/f.py", root / "f.py")
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(str(outside), root / "out")
    for path in ("src/x.py", "f.py", "out/x.py", "out/new/x.py"):
        with pytest.raises(UnsafeTree, match="is a symlink or not a folder"):
            write_text(root, path, "x = 1\n")
    for path in ("../x.py", "/tmp/x.py", "a/../../x.py", ""):
        with pytest.raises(UnsafeTree, match="not a path inside the tree"):
            write_text(root, path, "x = 1\n")
    assert not list(outside.iterdir()) and not (root / "real" / "x.py").exists()
    write_text(root, "real/new/y.py", "y = 2\n")  # plain folders are made and written
    assert (root / "real" / "new" / "y.py").read_text() == "y = 2\n"


def test_the_smoke_path_refuses_the_chain_in_one_line(lab: Path) -> None:
    from pipeline.errors import MethodFailure
    from pipeline.lab import load_lab
    from pipeline.smoke import smoke_run

    plant_chain(lab)
    the_lab = load_lab(lab)
    with pytest.raises(MethodFailure) as e:
        smoke_run(the_lab, BASELINE, {"config.toml": "pwned = true\n"})
    assert str(e.value).startswith("the commit's files cannot be laid out: the tree of "), str(e.value)
    assert "config.toml -> model.py/../X: resolves above the tree's root" in str(e.value)
    assert "\n" not in str(e.value)
    assert not outside_files(lab)


def test_a_view_of_a_commit_with_the_chain_is_refused_before_anything_is_written(lab: Path) -> None:
    from pipeline.safefs import UnsafeTree
    from pipeline.worktrees import Worktrees

    commit = plant_chain(lab)
    wt = Worktrees(lab, lab / "runs")
    with pytest.raises(UnsafeTree, match=r"commit [0-9a-f]{12} holds a symlink that leads out of it"):
        wt.view(commit, lambda p: True)
    assert not [p for p in (lab / "runs" / "views").iterdir()]
    assert not outside_files(lab)


def test_the_driver_records_a_commit_with_the_chain_as_the_methods_failure(tmp_path: Path) -> None:
    """A run queued for a commit holding the chain: never laid out; the method's failure, in one line."""
    from support.tiny import TinyHarness, make_lab
    from support.tiny import git as xgit

    from pipeline import runner
    from pipeline.executors.local import LocalExecutor

    lab = make_lab(tmp_path / "lab")
    xgit(lab.root, "checkout", "-q", "-b", "chain")
    os.symlink("x/../X", lab.root / "up")  # the same escape, inside an otherwise sound tree
    os.symlink(".", lab.root / "x")
    xgit(lab.root, "add", "-A")
    xgit(lab.root, "commit", "-qm", "a chain of links")
    commit = xgit(lab.root, "rev-parse", "HEAD")
    xgit(lab.root, "checkout", "-q", BASELINE)
    store = experiment.open_store(lab)
    harness = TinyHarness()
    ids = experiment.ensure_runs(store, lab, commit, ["a"], [0], harness=harness)
    with runner.Driver(lab, store, LocalExecutor(preload=("numpy",), slots=1), harness=harness) as d:
        d.drive(until=ids, timeout_s=60)
    [res] = store.results_for(commit)
    assert (res.outcome, res.kind) == ("method_failure", "unsafe_tree"), res
    assert "holds a symlink that leads out of it" in res.detail and "\n" not in res.detail
    assert not store.stage_execs(ids)  # no stage ran, no view was laid out
    assert not outside_files(lab.root) and not list((lab.state / "views").iterdir())


# ----------------------------------------------------------------------------- the checker's own cost (review of issue 20)

def test_a_tree_built_to_make_the_checker_quadratic_is_refused_by_its_caps(tmp_path: Path) -> None:
    """The review's attack: 40 links, each a 2000-part target (49 s per link before). Refused for
    its targets' length, in one line; then the same idea within the per-target cap, but 1000 links
    deep through one `d -> .`: refused when the tree's walk passes MAX_WALK components."""
    from pipeline.safefs import MAX_TARGET_PARTS, MAX_WALK, UnsafeTree, extract_tar

    long_target = "/".join(["d"] * 1999 + [".."])
    entries = [("d", "."), *((f"l{i}", long_target) for i in range(40))]
    with pytest.raises(UnsafeTree, match=f"a symlink's target of over {MAX_TARGET_PARTS} parts; refused") as e:
        extract_tar(io.BytesIO(tar_of(entries)), tmp_path / "a")
    assert "\n" not in str(e.value)
    with pytest.raises(UnsafeTree, match="a symlink's target over 4096 bytes"):
        extract_tar(io.BytesIO(tar_of([("l", "x" * 5000)])), tmp_path / "b")

    zigzag = "/".join(["d", ".."] * (MAX_TARGET_PARTS // 2 - 1) + ["sub"])  # 255 parts, no link in them
    entries = [("d/f", None), ("sub/f", None),
               *((f"l{i}", zigzag) for i in range(MAX_WALK // (MAX_TARGET_PARTS - 1) + 10))]
    with pytest.raises(UnsafeTree, match=f"its symlinks take over {MAX_WALK} components to resolve; refused"):
        extract_tar(io.BytesIO(tar_of(entries)), tmp_path / "c")


def test_each_link_is_resolved_once_and_a_lookup_stops_at_a_missing_component(tmp_path: Path) -> None:
    """A sound tree of many links through links: walked in components linear in its size (each
    link's own target once), not per use; a dangling `missing/../..` leads nowhere, so stays."""
    from pipeline import safefs

    n = 300
    hub = "/".join(["d", ".."] * 100 + ["sub"])  # 201 parts, resolved once
    entries = [("d/f", None), ("sub/f", None), ("hub", hub),
               ("dangling", "missing/" + "/".join([".."] * 200) + "/etc"),
               *((f"l{i}", "/".join(["hub", ".."] * 20 + ["hub"])) for i in range(n))]
    root = tmp_path / "tree"
    safefs.extract_tar(io.BytesIO(tar_of(entries)), root)  # accepted: every link resolves inside
    assert (root / f"l{n - 1}" / "f").read_text() == "# sub/f\n"
    links, files, dirs = safefs.links_in(root)
    tree = safefs._Tree(links, files, dirs, "the tree")
    for link in sorted(links):
        assert tree.escape(tree._add(link, "l")) is None
    # each target walked once: the 21 uses of `hub` in each l{i} are served from the memo
    assert tree.walked == sum(len(t.split("/")) for t in links.values()) - 200, tree.walked


# ----------------------------------------------------------------------------- a NUL byte in a link's target (review)

def plant_nul_link(root: Path, run_git=git) -> str:
    """A commit (on branch `nul`, the checkout left where it was) whose tree holds `short`, a symlink
    blob (mode 120000) `..\\0x`: it reads as a name inside the tree, git lays it out as `..`."""
    head = run_git(root, "rev-parse", "--abbrev-ref", "HEAD")
    run_git(root, "checkout", "-q", "-b", "nul")
    sha = subprocess.run(["git", "hash-object", "-w", "--stdin"], cwd=root, input=b"..\0x", check=True,
                         capture_output=True).stdout.decode().strip()
    run_git(root, "update-index", "--add", "--cacheinfo", f"120000,{sha},short")
    run_git(root, "commit", "-qm", "a NUL byte in a link's target")
    commit = run_git(root, "rev-parse", "HEAD")
    run_git(root, "checkout", "-q", "-f", head)
    return commit


def test_a_nul_byte_in_a_link_target_is_refused_in_one_line_before_anything_is_laid_out(lab: Path) -> None:
    from pipeline.errors import MethodFailure
    from pipeline.lab import load_lab
    from pipeline.safefs import UnsafeTree
    from pipeline.smoke import smoke_run
    from pipeline.worktrees import Worktrees

    commit = plant_nul_link(lab)
    wt = Worktrees(lab, lab / "runs")
    for attempt in (wt.check_tree, wt.ensure, lambda c: wt.view(c, lambda p: True)):
        with pytest.raises(UnsafeTree, match=r"commit [0-9a-f]{12}: short -> '\.\.\\x00x': a NUL byte") as e:
            attempt(commit)
        assert "\n" not in str(e.value)
    assert not wt.path(commit).exists() and not list((lab / "runs" / "views").iterdir())
    with pytest.raises(MethodFailure) as e:  # git archive cuts the target to `..`: refused as a way out
        smoke_run(load_lab(lab), commit, {})
    assert str(e.value).startswith("the commit's files cannot be laid out: ") and "\n" not in str(e.value)
    assert "short -> ..: resolves above the tree's root" in str(e.value), str(e.value)


def test_a_worktree_is_checked_as_it_is_on_disk(lab: Path) -> None:
    """What git really laid out (here `short -> ..`, from the NUL blob, checked out by hand) is
    refused by the check of the checkout, and the worktree is removed."""
    from pipeline.safefs import UnsafeTree
    from pipeline.worktrees import Worktrees

    commit = plant_nul_link(lab)
    wt = Worktrees(lab, lab / "runs")
    git(lab, "worktree", "add", "-q", "--detach", str(wt.path(commit)), commit)
    assert os.readlink(wt.path(commit) / "short") == ".."
    with pytest.raises(UnsafeTree, match=r"the worktree of [0-9a-f]{12} holds a symlink that leads out of it "
                                         r"\(short -> \.\.: resolves above the tree's root\); refused"):
        wt.check_checkout(wt.path(commit), commit)
    wt._sound_trees.add(commit)  # as if the blob check had passed: ensure still checks the disk
    with pytest.raises(UnsafeTree, match="the worktree of"):
        wt.ensure(commit)
    assert not wt.path(commit).exists()


def test_the_driver_records_a_nul_link_target_as_the_methods_failure_and_keeps_going(tmp_path: Path) -> None:
    """Before: check_tree passed it, git laid out `short -> ..`, the view's os.symlink raised
    ValueError, re-raised after the claim's release: the driver crashed on every start."""
    from support.tiny import TinyHarness, make_lab
    from support.tiny import git as xgit

    from pipeline import runner
    from pipeline.executors.local import LocalExecutor

    lab = make_lab(tmp_path / "lab")
    commit = plant_nul_link(lab.root, xgit)
    store = experiment.open_store(lab)
    harness = TinyHarness()
    ids = experiment.ensure_runs(store, lab, commit, ["a"], [0], harness=harness)
    with runner.Driver(lab, store, LocalExecutor(preload=("numpy",), slots=1), harness=harness) as d:
        d.drive(until=ids, timeout_s=60)
    [res] = store.results_for(commit)
    assert (res.outcome, res.kind) == ("method_failure", "unsafe_tree"), res
    assert "a NUL byte in a symlink's target" in res.detail and "\n" not in res.detail, res.detail
    assert not store.stage_execs(ids)
    assert not (lab.state / "worktrees" / commit).exists() and not list((lab.state / "views").iterdir())


# ----------------------------------------------------------------------------- very deep trees (review)

def plant_deep_file(root: Path, depth: int = 1500) -> str:
    """A commit (on branch `deep`, the checkout left where it was) with one file `depth` folders down."""
    head = git(root, "rev-parse", "--abbrev-ref", "HEAD")
    git(root, "checkout", "-q", "-b", "deep")
    sha = subprocess.run(["git", "hash-object", "-w", "--stdin"], cwd=root, input=b"deep\n", check=True,
                         capture_output=True).stdout.decode().strip()
    git(root, "update-index", "--add", "--cacheinfo", f"100644,{sha},{'a/' * depth}f")
    git(root, "commit", "-qm", "a file 1500 folders down")
    commit = git(root, "rev-parse", "HEAD")
    git(root, "checkout", "-q", "-f", head)
    return commit


def test_a_path_1500_folders_deep_is_refused_before_it_is_written(tmp_path: Path) -> None:
    """Before: check_links' recursive walk raised RecursionError, and so did the temporary folder's
    cleanup. Now the entry is refused before it is written, in one line, and cleanup works."""
    import tempfile

    from pipeline.safefs import MAX_DEPTH, UnsafeTree, check_links, extract_tar

    with tempfile.TemporaryDirectory(dir=tmp_path) as tmp:
        with pytest.raises(UnsafeTree, match=f"a path of over {MAX_DEPTH} components; refused") as e:
            extract_tar(io.BytesIO(tar_of([("ok.txt", None), ("a/" * 1500 + "f", None)])), Path(tmp) / "t")
        assert "\n" not in str(e.value)
        assert not (Path(tmp) / "t" / "a").exists()  # nothing of the deep entry was written
    assert not list(tmp_path.iterdir())  # the temporary folder is gone

    deep = tmp_path / "disk"  # a deep tree made some other way (here by hand) is refused by the check
    os.makedirs(deep / ("d/" * (MAX_DEPTH + 20)))
    with pytest.raises(UnsafeTree, match=f"the tree: a path deeper than {MAX_DEPTH} folders"):
        check_links(deep)
    check_links(tmp_path / "disk" / ("d/" * 30))  # 250 deep below it: fine


def test_a_commit_1500_folders_deep_is_refused_by_view_worktree_and_smoke(lab: Path) -> None:
    from pipeline.errors import MethodFailure
    from pipeline.lab import load_lab
    from pipeline.safefs import UnsafeTree
    from pipeline.smoke import smoke_run
    from pipeline.worktrees import Worktrees

    commit = plant_deep_file(lab)
    wt = Worktrees(lab, lab / "runs")
    for attempt in (wt.check_tree, wt.ensure, lambda c: wt.view(c, lambda p: True)):
        with pytest.raises(UnsafeTree, match=r"commit [0-9a-f]{12}: a/a/a.*: a path of over 256 components") as e:
            attempt(commit)
        assert "\n" not in str(e.value)
    assert not wt.path(commit).exists() and not list((lab / "runs" / "views").iterdir())
    with pytest.raises(MethodFailure) as e:
        smoke_run(load_lab(lab), commit, {})
    assert "a path of over 256 components; refused" in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not [p for p in (lab / "runs").iterdir() if p.name.startswith("smoke-")]  # cleaned up
