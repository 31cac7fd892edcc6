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


def test_promotion_is_a_fast_forward_to_the_measured_commit_and_nothing_else(ws):
    """A promotion moves the baseline to the commit the gate measured against it, never to a merge
    made there: a commit measured against an older head, or one that does not contain the head it
    names, is refused (the loop re-bases it and measures it again)."""
    base = ws.baseline_head()
    a = ws.commit_files("hyp/1-a", base, ws.apply(base, edits_of(CONDITIONAL["add_pix_source"])), "a")
    b = ws.commit_files("hyp/2-b", base, ws.apply(base, edits_of(PLANTED["finetune_lr"])), "b")
    head, tag = ws.promote(a, "promote a", base=base)
    assert head == a and tag == "baseline/v1"
    assert ws.promote(a, "promote a", base=base) == (a, "baseline/v1")  # idempotent re-run
    with pytest.raises(PromotionConflict, match=f"measured against {base[:10]}, but the baseline is now {a[:10]}"):
        ws.promote(b, "promote b", base=base)  # the baseline moved since b was measured
    with pytest.raises(PromotionConflict, match="a merge the gate never measured"):
        ws.promote(b, "promote b", base=a)  # b does not contain the head it claims to be measured against
    merged = ws.merge_onto(a, b, "b re-based onto a")  # what the loop measures instead, then promotes
    assert ws.promote(merged, "promote b", base=a) == (merged, "baseline/v2")
    assert ws.read(merged, "config.toml").count("lr = 3e-3") == 1 and 'sources = ["card", "pix"]' in ws.read(merged, "config.toml")
    assert ws.repo.heads[BASELINE_BRANCH].commit.hexsha == merged


def test_a_tree_is_checked_path_by_path_a_rename_counting_as_both_paths(ws):
    """`check_tree`, the one check of what is measured and promoted: a merge onto a baseline that
    moved an editable file to a locked path carries the agent's edit there (git follows the rename);
    the merged tree is refused by the locked path's name."""
    a0 = ws.baseline_head()
    edit = FileEdit("model.py", "return self.ln_f(x)  # agent edit", "return self.ln_f(x)")
    hyp = ws.commit_files("hyp/1-m", a0, ws.apply(a0, [edit]), "m")
    assert ws.check_tree(a0, hyp) == ["model.py"]
    (ws.lab.root / "frozen").mkdir()
    ws.repo.git.mv("model.py", "frozen/model.py")  # the researcher locks the model away
    ws.repo.git.commit("-qm", "freeze the model")
    ws.repo.git.branch("-f", BASELINE_BRANCH, "HEAD")
    a1 = ws.baseline_head()
    assert ws.changed_paths(a0, a1) == ["frozen/model.py", "model.py"]  # a rename: both its paths
    merged = ws.merge_onto(a1, hyp, "re-based")
    assert "return self.ln_f(x)  # agent edit" in ws.read(merged, "frozen/model.py")  # the merge followed it
    with pytest.raises(EditRejected, match=r"^frozen/model.py: not editable") as info:
        ws.check_tree(a1, merged)
    assert info.value.kind == "outside_editable"


def test_tags_are_idempotent(ws):
    base = ws.baseline_head()
    ws.tag("exp/1/look-2", base)
    ws.tag("exp/1/look-2", base)
    assert ws.repo.tags["exp/1/look-2"].commit.hexsha == base


def test_slugify():
    assert slugify("Add PIX transfers as a source!") == "add-pix-transfers-as-a-source"
    assert slugify("???") == "idea"
