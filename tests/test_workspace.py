"""Hypothesis branches on a real lab repo: checked edits, plumbing commits, tags, promotion."""

import pytest

from agent.labinit import init_lab
from agent.workspace import EditRejected, FileEdit, PromotionConflict, Workspace, check_path, slugify
from pipeline.harness.transactions.variants import CONDITIONAL, NOOPS, PLANTED
from pipeline.lab import BASELINE_BRANCH, load_lab

pytestmark = pytest.mark.integration


@pytest.fixture
def ws(tmp_path):
    root = init_lab(tmp_path / "lab")
    return Workspace(load_lab(root))


def edits_of(variant):
    return [FileEdit(e.path, e.replace, e.search) for e in variant]


def test_commit_on_a_branch_leaves_the_checkout_alone(ws):
    base = ws.baseline_head()
    before = (ws.lab.root / "config.toml").read_text()
    files = ws.apply(base, edits_of(CONDITIONAL["add_pix_source"]))
    sha = ws.commit_files("hyp/1-pix", base, files, "hyp 1: add pix")
    assert ws.repo.commit(sha).parents[0].hexsha == base
    assert 'sources = ["card", "pix"]' in ws.read(sha, "config.toml")
    assert ws.changed_paths(base, sha) == ["config.toml"]
    assert (ws.lab.root / "config.toml").read_text() == before
    assert not ws.repo.is_dirty(untracked_files=True)
    assert ws.repo.heads["hyp/1-pix"].commit.hexsha == sha


def test_whole_file_edit_and_noop_refactor(ws):
    base = ws.baseline_head()
    files = ws.apply(base, edits_of(NOOPS["cross_network_rename"]))
    assert "x_l = x0" in files["model.py"]
    files = ws.apply(base, [FileEdit("config.toml", ws.read(base, "config.toml") + "\n# note\n")])
    assert files["config.toml"].endswith("# note\n")


@pytest.mark.parametrize(
    "edit,kind",
    [
        (FileEdit("research.toml", "x", "y"), "harness"),
        (FileEdit("program.md", "anything"), "harness"),
        (FileEdit("runs/sealed/labels.npz", "0"), "harness"),
        (FileEdit("../outside.py", "print(1)"), "escapes_lab"),
        (FileEdit("/etc/passwd", "root"), "escapes_lab"),
        (FileEdit("sub/../../x.py", "1"), "escapes_lab"),
        (FileEdit("evil.py", "import os"), "outside_editable"),
        (FileEdit("model.py", "y", "this text is not in model.py"), "not_applying"),
        (FileEdit("model.py", "def broken(:\n"), "compile_error"),
        (FileEdit("config.toml", "[data\nsources = 1"), "compile_error"),
    ],
)
def test_rejected_edits(ws, edit, kind):
    with pytest.raises(EditRejected) as info:
        ws.apply(ws.baseline_head(), [edit])
    assert info.value.kind == kind


def test_an_edit_that_changes_nothing_is_rejected(ws):
    base = ws.baseline_head()
    with pytest.raises(EditRejected) as info:
        ws.apply(base, [FileEdit("config.toml", ws.read(base, "config.toml"))])
    assert info.value.kind == "empty"


def test_check_path_normalises():
    class L:
        class config:
            class lab:
                program = "program.md"
                editable = ["model.py", "src/**/*.py"]

        @staticmethod
        def is_trusted(path: str) -> bool:
            return path == "score.py"

    assert check_path(L, "./model.py") == "model.py"
    with pytest.raises(EditRejected, match="trusted harness file"):
        check_path(L, "score.py")
    assert check_path(L, "src/a/b.py") == "src/a/b.py"
    with pytest.raises(EditRejected):
        check_path(L, "src/a/b.txt")


def test_promotion_fast_forward_then_merge_then_conflict(ws):
    base = ws.baseline_head()
    a = ws.commit_files("hyp/1-a", base, ws.apply(base, edits_of(CONDITIONAL["add_pix_source"])), "a")
    b = ws.commit_files("hyp/2-b", base, ws.apply(base, edits_of(PLANTED["finetune_lr"])), "b")
    c = ws.commit_files("hyp/3-c", base, ws.apply(base, [FileEdit("config.toml", 'sources = ["card", "app"]', 'sources = ["card"]')]), "c")
    head, tag = ws.promote(a, "promote a")
    assert head == a and tag == "baseline/v1"
    assert ws.promote(a, "promote a") == (a, "baseline/v1")  # idempotent re-run
    head2, tag2 = ws.promote(b, "promote b")  # baseline moved: a real merge commit
    assert tag2 == "baseline/v2" and len(ws.repo.commit(head2).parents) == 2
    merged = ws.read(head2, "config.toml")
    assert 'sources = ["card", "pix"]' in merged and "lr = 3e-3" in merged
    with pytest.raises(PromotionConflict):
        ws.promote(c, "promote c")
    assert ws.baseline_head() == head2
    assert ws.repo.heads[BASELINE_BRANCH].commit.hexsha == head2


def test_tags_are_idempotent(ws):
    base = ws.baseline_head()
    ws.tag("exp/1/look-2", base)
    ws.tag("exp/1/look-2", base)
    assert ws.repo.tags["exp/1/look-2"].commit.hexsha == base


def test_slugify():
    assert slugify("Add PIX transfers as a source!") == "add-pix-transfers-as-a-source"
    assert slugify("???") == "idea"
