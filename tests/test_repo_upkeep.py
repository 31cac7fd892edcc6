"""The lab's repository over years of hypotheses: tags looked up one ref at a time, trees read in one
git call, refs and objects packed by the loop (`LabRepo.maintain`, `Loop.upkeep`). Real git."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from support.tiny import TinyHarness, commit_change, git, make_lab
from pipeline.labrepo import LabRepo

BASE = "autoresearch/baseline"

pytestmark = pytest.mark.integration


@pytest.fixture
def tiny_registered():
    from pipeline.harness import HARNESSES

    HARNESSES.register("tiny", TinyHarness)
    yield
    HARNESSES.unregister("tiny")


def _loose_refs(root: Path) -> list[str]:
    return [str(p.relative_to(root / ".git")) for p in (root / ".git" / "refs").rglob("*") if p.is_file()]


def _loose_objects(root: Path) -> int:
    out = subprocess.run(["git", "count-objects", "-v"], cwd=root, capture_output=True, text=True, check=True).stdout
    return int(dict(line.split(": ") for line in out.splitlines())["count"])


def _packed_objects(root: Path) -> int:
    out = subprocess.run(["git", "count-objects", "-v"], cwd=root, capture_output=True, text=True, check=True).stdout
    return int(dict(line.split(": ") for line in out.splitlines())["in-pack"])


def test_tags_are_created_read_and_numbered_loose_or_packed(tmp_path: Path) -> None:
    lab = make_lab(tmp_path / "lab")
    repo = LabRepo(lab.root)
    base = repo.resolve(BASE)
    other = commit_change(lab.root, "hyp/1-x", "config.toml", "shrink", "shrink ")
    repo.tag("exp/1", other, "hypothesis 1\n\nits pre-registration")
    repo.tag("exp/2", base)  # lightweight
    repo.tag("exp/1", other, "again")  # the same commit: nothing to do
    with pytest.raises(ValueError, match="already points at"):
        repo.tag("exp/1", base)
    for v in (1, 2, 10):  # numbered as numbers, not as strings (v10 after v9)
        git(lab.root, "tag", f"baseline/v{v}", base)
    git(lab.root, "tag", "baseline/vnext", base)  # not a baseline tag
    for packed in (False, True):
        if packed:
            assert LabRepo(lab.root).maintain()[0].startswith("pack-refs --all: ")
            assert not _loose_refs(lab.root), _loose_refs(lab.root)
        repo = LabRepo(lab.root)
        assert repo.tagged("exp/1") == (other, "hypothesis 1\n\nits pre-registration")
        assert repo.tagged("exp/2") == (base, "")
        assert repo.tagged("exp/3") is None
        assert sorted(repo.baseline_tags()) == ["baseline/v1", "baseline/v10", "baseline/v2"]
        assert repo.baseline_tag(base) == "baseline/v10" and repo.baseline_tag(other) is None
    assert repo._next_baseline_tag(other, "promoted") == "baseline/v11"
    assert repo.tagged("baseline/v11")[0] == other


def test_many_revisions_resolve_in_one_call_and_one_that_is_none_is_named(tmp_path: Path) -> None:
    """`resolve_many` (the champions' standings): branches, annotated tags and shas at once; a name
    that is no revision, or one that git would read as an option, is that revision's error only."""
    from pipeline.errors import UserError

    lab = make_lab(tmp_path / "lab")
    repo = LabRepo(lab.root)
    base = repo.resolve(BASE)
    other = commit_change(lab.root, "hyp/1-x", "config.toml", "shrink", "shrink ")
    repo.tag("exp/1", other, "annotated")
    revs = [BASE, "exp/1", other[:12], "hyp/1-x"]
    assert repo.resolve_many(revs) == {BASE: base, "exp/1": other, other[:12]: other, "hyp/1-x": other}
    got = repo.resolve_many([*revs, "no-such-tag", "--all"])
    assert {r: got[r] for r in revs} == repo.resolve_many(revs)
    assert isinstance(got["no-such-tag"], UserError) and "no-such-tag" in str(got["no-such-tag"])
    assert isinstance(got["--all"], UserError)
    assert repo.resolve_many([]) == {}
    from types import SimpleNamespace

    from pipeline.labrepo import resolve_commits

    assert resolve_commits(lab, ["exp/1", "no-such-tag"])["exp/1"] == other
    gone = resolve_commits(SimpleNamespace(root=tmp_path / "not-a-repo"), ["exp/1"])  # each revision's error
    assert isinstance(gone["exp/1"], UserError)


def test_trees_of_many_commits_come_in_one_call_and_match_one_at_a_time(tmp_path: Path) -> None:
    lab = make_lab(tmp_path / "lab")
    shas = [commit_change(lab.root, f"hyp/{i}-x", "config.toml", "shrink", "shrink" + " " * i)
            for i in range(1, 6)]
    from pipeline import labrepo

    def tree(rev: str) -> str:  # git's own answer, not the cache `trees` fills
        return git(lab.root, "rev-parse", f"{rev}^{{tree}}")

    repo = LabRepo(lab.root)
    labrepo._trees.clear()
    got = repo.trees([*shas, BASE, shas[0]])  # one git call for the shas, the branch name resolved alone
    assert got == {**{s: tree(s) for s in shas}, BASE: tree(BASE)}
    assert len(set(got.values())) == 6  # each edit its own tree
    labrepo._trees.clear()
    missing = "0123456789" * 4  # a sha the repository lacks: left out, the others still in one call
    assert repo.trees([missing, *shas]) == {s: tree(s) for s in shas}
    assert repo.trees([]) == {}
    assert repo.tag_commits([]) == {}
    git(lab.root, "tag", "-a", "-m", "annotated", "baseline/v1", shas[0])
    git(lab.root, "tag", "baseline/v2", shas[1])
    assert repo.tag_commits(["baseline/v1", "baseline/v2"]) == {"baseline/v1": shas[0], "baseline/v2": shas[1]}
    assert repo.tag_commits(["baseline/v1", "baseline/v9"]) == {"baseline/v1": shas[0]}


def test_maintain_packs_refs_and_lets_git_pack_loose_objects_at_its_threshold(tmp_path: Path) -> None:
    lab = make_lab(tmp_path / "lab")
    repo = LabRepo(lab.root)
    base = repo.resolve(BASE)
    tree = repo.tree(base)
    for i in range(30):  # as the loop makes them: plumbing, which never runs git's own gc
        blob = subprocess.run(["git", "hash-object", "-w", "--stdin"], cwd=lab.root, input=f"edit {i}\n",
                              capture_output=True, text=True, check=True).stdout.strip()
        listing = subprocess.run(["git", "ls-tree", tree], cwd=lab.root, capture_output=True, text=True,
                                 check=True).stdout + f"100644 blob {blob}\tnote.txt\n"
        new_tree = subprocess.run(["git", "mktree"], cwd=lab.root, input=listing, capture_output=True, text=True,
                                  check=True).stdout.strip()
        commit = repo.repo.git.commit_tree(new_tree, "-p", base, "-m", f"hypothesis {i}")
        repo.repo.git.update_ref(f"refs/heads/hyp/{i}-x", commit)
        repo.tag(f"exp/{i}", commit, f"hypothesis {i}")
    # git counts loose objects by sampling one of its 256 folders (`objects/17`): enough of them, with
    # fixed contents (so the same shas, the same count there, every time); no commit holds these (an
    # implementer's attempts that were never committed), so git keeps them loose for two weeks
    notes = tmp_path / "notes"
    notes.mkdir()
    for i in range(3000):
        (notes / str(i)).write_text(f"an implementer's attempt {i}\n")
    subprocess.run(["git", "hash-object", "-w", "--stdin-paths"], cwd=lab.root, check=True, capture_output=True,
                   input="\n".join(str(notes / str(i)) for i in range(3000)) + "\n", text=True)
    assert len(_loose_refs(lab.root)) > 60 and _loose_objects(lab.root) > 3000
    git(lab.root, "config", "gc.autoDetach", "false")  # the test waits for it; the loop lets it detach
    git(lab.root, "config", "gc.auto", "20")  # git's threshold (6,700 loose objects by default), lowered
    done = LabRepo(lab.root).maintain()
    assert [line.split(":")[0] for line in done] == ["pack-refs --all", "gc --auto --quiet"], done
    assert all(" s" in line for line in done), done
    assert not _loose_refs(lab.root)
    assert _loose_objects(lab.root) == 3000 and _packed_objects(lab.root) >= 90  # every commit's, packed
    repo = LabRepo(lab.root)
    assert repo.tagged("exp/29")[1] == "hypothesis 29" and repo.resolve("hyp/7-x")
    # a repository that turned git's gc off keeps its objects loose (`gc.auto = 0` is respected)
    git(lab.root, "config", "gc.auto", "0")
    subprocess.run(["git", "hash-object", "-w", "--stdin"], cwd=lab.root, input="one more\n", check=True,
                   capture_output=True, text=True)
    LabRepo(lab.root).maintain()
    assert _loose_objects(lab.root) == 3001


def test_the_loop_packs_its_repository_at_start_then_every_few_hours(tmp_path: Path, tiny_registered) -> None:
    from agent.loop import Loop, LoopOptions
    from agent.loop import scheduler
    from pipeline.api import ExecutorOptions

    lab = make_lab(tmp_path / "lab")
    git(lab.root, "tag", "exp/0", BASE)
    assert _loose_refs(lab.root)
    loop = Loop(lab, LoopOptions(offline=True, smoke=False, executor=ExecutorOptions(workers=1)))
    try:
        loop.upkeep()
        first = loop._upkeep
        assert first is not None
        first.join(timeout=60)
        assert not _loose_refs(lab.root)
        git(lab.root, "tag", "exp/1", BASE)
        loop.upkeep()  # within UPKEEP_S: not again
        assert loop._upkeep is first and _loose_refs(lab.root)
        loop._upkept -= scheduler.UPKEEP_S
        loop.upkeep()
        assert loop._upkeep is not first
        loop._upkeep.join(timeout=60)
        assert not _loose_refs(lab.root)
    finally:
        loop.close()


@pytest.mark.slow
def test_the_upkeep_benchmark_runs_and_packing_leaves_nothing_loose(tmp_path: Path) -> None:
    """`benchmarks/repo_upkeep.py` on a few days, so it cannot rot."""
    import sys

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "upkeep.txt"
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "repo_upkeep.py"), "--days", "2",
                           "--runs-per-day", "200", "--repeat", "1", "--workdir", str(tmp_path), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split("|")[0].strip(): line.split("|")[1:] for line in out.read_text().splitlines() if "|" in line}
    assert int(rows["loose refs"][0]) > 20 and int(rows["loose refs"][1]) == 0
    assert int(rows["loose objects"][0]) > 20 and int(rows["objects in packs"][0]) == 0
    dup = next(k for k in rows if k.startswith("duplicate check"))
    assert all(float(v) > 0 for v in " ".join(rows[dup]).split())
    assert "LabRepo.maintain: " in out.read_text()
