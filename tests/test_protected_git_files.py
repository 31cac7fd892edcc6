"""Hostile branches, round three (issue 36, item 8): the files git itself obeys in a tree
(`.gitattributes`, `.gitmodules`, `.lfsconfig`, `.gitignore`, at any depth) are the lab's, never the
agent's: an edit of one is refused, and so is a researcher's branch that changes one, even where
`editable` would allow the path. The real template lab, the real loop; no mocks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.lab import BASELINE, git, make_loop, one_pass, open_lab, set_research

pytestmark = pytest.mark.system

GIT_FILES = [".gitattributes", ".gitmodules", ".lfsconfig", "sub/.gitattributes"]
CONTENT = {".gitattributes": "* ident\n*.py filter=evil\n", ".gitmodules": '[submodule "x"]\n\tpath = x\n\turl = /tmp/x\n',
           ".lfsconfig": "[lfs]\n\turl = http://127.0.0.1:1/\n", "sub/.gitattributes": "* eol=crlf\n"}


def every_dotfile_editable(lab: Path) -> None:
    """`editable` widened to every dotfile: what refuses them below is the protection, not the globs."""
    set_research(lab, 'editable = ["model.py", "train.py", "config.toml"]',
                 'editable = ["model.py", "train.py", "config.toml", "**/.*"]')


def test_an_edit_of_a_git_file_is_refused_as_the_labs(lab: Path) -> None:
    from agent.errors import EditRejected
    from agent.workspace import FileEdit, Workspace

    every_dotfile_editable(lab)
    ws = Workspace(open_lab(lab))
    base = ws.baseline_head()
    for path in GIT_FILES:
        with pytest.raises(EditRejected, match=f"{path}: part of the harness or the lab contract; never editable") as e:
            ws.apply(base, [FileEdit(path, CONTENT[path])])
        assert e.value.kind == "harness"
    assert ws.apply(base, [FileEdit("config.toml", "[x]\ny = 1\n")])  # the widened lab still takes an edit


def test_a_seeded_branch_that_changes_a_git_file_is_rejected_naming_it(lab: Path) -> None:
    from agent.commands import seed

    every_dotfile_editable(lab)
    for i, path in enumerate(GIT_FILES):
        branch = f"git-file-{i}"
        wt = lab.parent / f"wt-{i}"
        git(lab, "worktree", "add", "-q", "-b", branch, str(wt), BASELINE)
        (wt / path).parent.mkdir(parents=True, exist_ok=True)
        (wt / path).write_text(CONTENT[path])
        (wt / "model.py").write_text((wt / "model.py").read_text() + "\n# and a change the lab allows\n")
        git(wt, "add", "-A")
        git(wt, "commit", "-qm", f"{branch}: {path}")
        git(lab, "worktree", "remove", "--force", str(wt))
        seed(lab, None, None, branch, 10, branch, None)
    loop = make_loop(lab, offline=True)
    try:
        done = [one_pass(loop) for _ in GIT_FILES]
    finally:
        loop.close()
    for h, path in zip(sorted(done, key=lambda h: h.id), GIT_FILES):
        assert (h.status, h.decision, h.reject_kind, h.commit) == ("done", "reject", "harness", None), h
        assert f"{path}: part of the harness or the lab contract; never editable" in h.reject_reason, h.reject_reason
    assert not loop.store.runs() and git(lab, "branch", "--list", "hyp/*") == ""
