"""Hostile branches, round three (issue 36, items 6 and 8): what a stage sees of a TOML file it names
by tables, and branch trees laid out from git objects, never through the branch's `.gitattributes`.
Real git repositories, the real driver and smoke run in the sandbox, real stage processes; no mocks.
"""

from __future__ import annotations

import functools
import hashlib
import subprocess
import tomllib
from pathlib import Path

import pytest
from support.tiny import TinyHarness, commit_change, git, make_lab, require_sandbox

from pipeline import experiment
from pipeline.dag import input_digests
from pipeline.lab import StageSpec
from pipeline.tomlview import toml_tables
from pipeline.worktrees import Worktrees

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BASELINE = "autoresearch/baseline"
READ = 'cfg = tomllib.loads(Path("config.toml").read_text())["pretrain"]'
# the tiny pretraining, made to say what it finds in config.toml: the whole file it reads, and the
# fine-tuning table it was never keyed on (with the whole file seen, a stale cache entry would serve
# a challenger that changed only that table)
PROBE = '''seen = Path("config.toml").read_text()
(Path(a.out) / "seen.toml").write_text(seen)
print("SEEN", repr(seen), "FINETUNE", tomllib.loads(seen).get("finetune"))
cfg = tomllib.loads(seen)["pretrain"]'''
PRETRAIN_SEES = "[pretrain]\nsleep = 0.0\n"


@pytest.fixture
def tiny_registered():
    """The tiny harness under its name, as a plugin would register it (the smoke run looks it up)."""
    from pipeline.harness import HARNESSES

    added = "tiny" not in HARNESSES.names()
    HARNESSES.register("tiny", TinyHarness)
    yield
    if added:
        HARNESSES.unregister("tiny")


def _drive(lab, commits: list[str], tasks: list[str]) -> list:
    from pipeline import runner
    from pipeline.executors.local import LocalExecutor

    store = experiment.open_store(lab)
    harness = TinyHarness()
    ids = [i for c in commits for i in experiment.ensure_runs(store, lab, c, tasks, [0], harness=harness)]
    with runner.Driver(lab, store, LocalExecutor(preload=("numpy",), slots=1), harness=harness) as d:
        d.drive(until=ids, timeout_s=120)
    return store.stage_execs(ids)


# ----------------------------------------------------------------------------- item 6: a table-keyed input

def test_a_stage_keyed_on_one_table_sees_only_that_table_in_the_driver_and_the_smoke_run(tmp_path: Path,
                                                                                           tiny_registered) -> None:
    """The tiny lab's pretraining declares `config.toml#pretrain`: in a real run and in the smoke run
    its config.toml holds that table alone, so a challenger that changes only `[finetune]` is served
    the baseline's pretraining honestly (same key, same bytes seen)."""
    from pipeline.smoke import smoke_run

    require_sandbox()
    lab = make_lab(tmp_path / "lab")
    text = (lab.root / "pretrain.py").read_text()
    (lab.root / "pretrain.py").write_text(text.replace(READ, PROBE))
    git(lab.root, "commit", "-qam", "pretraining says what it sees")
    base = git(lab.root, "rev-parse", "HEAD")
    challenger = commit_change(lab.root, "hyp/1-shrink", "config.toml", "shrink = 0.1", "shrink = 0.3")

    execs = _drive(lab, [base, challenger], ["a"])
    by = {(e.run_id, e.stage): e for e in execs}
    pretrain = sorted((e for e in execs if e.stage == "pretrain"), key=lambda e: e.id)
    assert [e.outcome for e in pretrain] in (["ok", "cache_hit"], ["ok", "shared"]), [(e.outcome, e.detail) for e in execs]
    assert pretrain[0].key == pretrain[1].key  # keyed on [pretrain] alone: shared
    assert all(e.outcome in ("ok", "cache_hit") for e in by.values()), [(e.stage, e.outcome, e.detail) for e in execs]
    seen = (lab.state / "cache" / pretrain[0].key / "seen.toml").read_text()
    assert seen == PRETRAIN_SEES and tomllib.loads(seen) == {"pretrain": {"sleep": 0.0}}
    log = Path(pretrain[0].log_path).read_text()
    assert f"SEEN {PRETRAIN_SEES!r} FINETUNE None" in log, log

    smoke_run(lab, challenger, {})  # the smoke run's views follow the same rule
    [smoke_log] = (lab.state / "logs" / "smoke").glob("*/pretrain.log")
    assert f"SEEN {PRETRAIN_SEES!r} FINETUNE None" in smoke_log.read_text(), smoke_log.read_text()


def test_a_pretraining_that_reads_the_fine_tuning_table_fails_in_both_arms_instead_of_sharing_a_stale_output(
        tmp_path: Path) -> None:
    """The issue's attack: pretraining keyed on `[pretrain]` reads `[finetune]`. It finds no such
    table: the method's failure, in the challenger and the baseline alike."""
    require_sandbox()
    lab = make_lab(tmp_path / "lab")
    text = (lab.root / "pretrain.py").read_text()
    (lab.root / "pretrain.py").write_text(text.replace(READ, READ.replace('["pretrain"]', '["finetune"]')))
    git(lab.root, "commit", "-qam", "pretraining reads the fine-tuning table")
    base = git(lab.root, "rev-parse", "HEAD")
    challenger = commit_change(lab.root, "hyp/1-shrink", "config.toml", "shrink = 0.1", "shrink = 0.3")
    execs = _drive(lab, [base, challenger], ["a"])
    store = experiment.open_store(lab)
    for commit in (base, challenger):
        [res] = store.results_for(commit)
        assert (res.outcome, res.kind) == ("method_failure", "crash"), res
    [ran] = [e for e in execs if e.stage == "pretrain" and e.outcome == "method"]
    assert "KeyError: 'finetune'" in Path(ran.log_path).read_text()


def test_the_view_and_the_key_of_a_table_keyed_input_cover_the_same_bytes(tmp_path: Path) -> None:
    """What a stage sees of `file#table` is written from the table's values, and the key hashes
    exactly that: formatting, comments and other tables change neither; a value's type changes both
    (a date and the string of it are not the same input); two stages naming different tables of
    one file never share a view; a file that is not TOML is seen, and keyed, whole."""
    lab = make_lab(tmp_path / "lab")
    wt = Worktrees(lab.root, lab.state)
    pretrain = StageSpec(name="pretrain", run="python pretrain.py", inputs=["config.toml#pretrain"])
    both = StageSpec(name="both", run="python pretrain.py", inputs=["config.toml#pretrain", "config.toml#finetune"])
    base = git(lab.root, "rev-parse", "HEAD")

    def view(commit: str, spec: StageSpec) -> bytes:
        return (wt.view(commit, functools.partial(lab.stage_sees, spec)) / "config.toml").read_bytes()

    def key(commit: str) -> dict[str, str]:
        return input_digests(wt, commit, ["config.toml#pretrain"])

    assert view(base, pretrain) == PRETRAIN_SEES.encode()
    assert tomllib.loads(view(base, both).decode()) == {"pretrain": {"sleep": 0.0}, "finetune": {"sleep": 0.0, "shrink": 0.1}}
    assert wt.view(base, functools.partial(lab.stage_sees, pretrain)) != wt.view(base, functools.partial(lab.stage_sees, both))
    # model.py, not an input of these stages but editable: not seen at all
    assert not (wt.view(base, functools.partial(lab.stage_sees, pretrain)) / "model.py").exists()

    reformatted = commit_change(lab.root, "fmt", "config.toml", "[pretrain]\nsleep = 0.0",
                                "# a comment the stage never sees\n[pretrain]\nsleep   =   0.0   # here neither")
    other = commit_change(lab.root, "ft", "config.toml", "shrink = 0.1", "shrink = 0.3")
    typed = commit_change(lab.root, "typed", "config.toml", "[pretrain]\nsleep = 0.0", "[pretrain]\nsleep = 0.0\nwhen = 2020-01-01")
    string = commit_change(lab.root, "string", "config.toml", "[pretrain]\nsleep = 0.0", '[pretrain]\nsleep = 0.0\nwhen = "2020-01-01"')
    assert key(reformatted) == key(other) == key(base) and view(reformatted, pretrain) == view(other, pretrain) == view(base, pretrain)
    assert key(typed) != key(string) and view(typed, pretrain) != view(string, pretrain)
    for commit in (base, typed, string):  # the key is the hash of the bytes seen
        assert key(commit)["config.toml#pretrain"] == hashlib.sha256(view(commit, pretrain)).hexdigest()
    broken = commit_change(lab.root, "broken", "config.toml", "[pretrain]", "[pretrain")
    raw = blobs(lab.root, broken)["config.toml"]
    assert view(broken, pretrain) == raw == toml_tables(raw, ["pretrain"])
    assert key(broken)["config.toml#pretrain"] == hashlib.sha256(raw).hexdigest()


def test_a_table_input_names_one_file_not_a_glob(tmp_path: Path) -> None:
    from pipeline.errors import LabConfigError
    from pipeline.lab import _check_files, parse_config

    lab = make_lab(tmp_path / "lab")
    path = lab.root / "research.toml"
    config = parse_config(path.read_text().replace('"config.toml#pretrain"', '"config*.toml#pretrain"'), path)
    with pytest.raises(LabConfigError, match=r"stage\[0\]\.inputs.*expected one file's path before '#', not a glob"):
        _check_files(lab.root, config, path)


# ----------------------------------------------------------------------------- item 8: the branch's attributes

def hostile_branch(root: Path, marker: Path) -> str:
    """A branch whose `.gitattributes` asks for the lab's `evil` filter (its smudge command appends
    to `marker` and rewrites the file), `ident`, CRLF line ends and `export-subst`; the lab's git
    config defines the filter, as a researcher's might. The checkout is left on the baseline."""
    git(root, "config", "filter.evil.smudge", f"echo ran >> {marker}; sed s/SCALE/PWNED/")
    git(root, "config", "filter.evil.clean", "cat")
    git(root, "checkout", "-q", "-b", "hostile", BASELINE)
    (root / ".gitattributes").write_text("* ident\nmodel.py filter=evil\n*.toml text eol=crlf\n*.py export-subst\n")
    (root / "sub").mkdir()
    (root / "sub" / ".gitattributes").write_text("* text eol=crlf ident\n")
    (root / "sub" / "notes.txt").write_text("$Id$\nline two\n")
    (root / "model.py").write_text((root / "model.py").read_text() + "# $Id$ $Format:%H$\n")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "hostile attributes")
    commit = git(root, "rev-parse", "HEAD")
    git(root, "checkout", "-q", BASELINE)
    marker.unlink(missing_ok=True)  # `checkout` back may smudge too
    return commit


def blobs(root: Path, commit: str) -> dict[str, bytes]:
    names = git(root, "ls-tree", "-r", "--name-only", commit).splitlines()
    return {n: subprocess.run(["git", "cat-file", "blob", f"{commit}:{n}"], cwd=root, check=True,
                              capture_output=True).stdout for n in names}


def laid_out(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_branch_tree_with_hostile_attributes_is_laid_out_byte_for_byte_as_committed(tmp_path: Path) -> None:
    require_sandbox()
    lab = make_lab(tmp_path / "lab")
    marker = tmp_path / "filter-ran"
    commit = hostile_branch(lab.root, marker)
    committed = blobs(lab.root, commit)
    assert b"$Id$" in committed["model.py"] and b"\r\n" not in committed["config.toml"]

    # the hole, shown: git's own checkout of this tree runs the lab's filter and rewrites the bytes
    probe = tmp_path / "probe"
    git(lab.root, "worktree", "add", "-q", "--detach", str(probe), commit)
    assert marker.exists() and laid_out(probe)["model.py"] != committed["model.py"]
    assert b"\r\n" in laid_out(probe)["config.toml"] and b"$Id: " in laid_out(probe)["sub/notes.txt"]
    git(lab.root, "worktree", "remove", "--force", str(probe))
    marker.unlink()

    wt = Worktrees(lab.root, lab.state)
    tree = wt.ensure(commit)
    assert laid_out(tree) == committed and not (tree / ".git").exists()
    assert laid_out(wt.view(commit, lambda p: True)) == committed
    spec = lab.config.stage[1]  # finetune: model.py, finetune.py, config.toml#finetune
    seen = laid_out(wt.view(commit, functools.partial(lab.stage_sees, spec)))
    assert seen["model.py"] == committed["model.py"] and seen["finetune.py"] == committed["finetune.py"]
    assert not marker.exists()

    # and through the real driver: the run measures the committed bytes, no filter ran
    execs = _drive(lab, [commit], ["a"])
    assert [e.outcome for e in execs] == ["ok", "ok"], [(e.stage, e.outcome, e.detail) for e in execs]
    assert not marker.exists()
    assert laid_out(wt.path(commit)) == committed
