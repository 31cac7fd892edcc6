"""Hypotheses as git history: branches off the baseline, one commit and tag per experiment, promotion.

Everything here writes git objects through a private index file (plumbing), never through the
lab's checkout: a researcher's working tree is left alone, and an interrupted write leaves at
most an unreferenced object behind. Branch and tag updates are idempotent, so a node that crashed
half-way can simply run again.

Edits come from the agent (LLM or offline policy) and are untrusted: every path is checked
against the lab's `editable` globs before anything is written.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import PurePosixPath

import git

from agent.errors import EditRejected, PromotionConflict  # noqa: F401 (re-exported: promote and merge_onto raise it)
from pipeline.api import CONFIG_NAME, Lab, LabRepo, glob_match

GIT_FILES = {".gitattributes", ".gitignore", ".gitmodules", ".lfsconfig"}  # git obeys them at any depth of a tree
PROTECTED = {CONFIG_NAME, *GIT_FILES}


@dataclass(frozen=True)
class FileEdit:
    """A search/replace block on one file, or (search is None) the file's whole new content."""

    path: str
    replace: str
    search: str | None = None

    @classmethod
    def from_dict(cls, d: dict) -> "FileEdit":
        if not isinstance(d, dict) or not isinstance(d.get("path"), str):
            raise EditRejected("malformed", "an edit needs a string 'path'")
        if "content" in d:
            if not isinstance(d["content"], str):
                raise EditRejected("malformed", f"{d['path']}: 'content' must be a string")
            return cls(d["path"], d["content"])
        if not isinstance(d.get("search"), str) or not isinstance(d.get("replace"), str):
            raise EditRejected("malformed", f"{d['path']}: expected 'search' and 'replace' strings, or 'content'")
        return cls(d["path"], d["replace"], d["search"])

    def to_dict(self) -> dict:
        if self.search is None:
            return {"path": self.path, "content": self.replace}
        return {"path": self.path, "search": self.search, "replace": self.replace}


def slugify(title: str, limit: int = 40) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")
    return slug[:limit].rstrip("-") or "idea"


def check_path(lab: Lab, path: str) -> str:
    """The normalised lab-relative path if the agent may edit it; `EditRejected` otherwise."""
    if not path or "\x00" in path:
        raise EditRejected("escapes_lab", f"{path!r}: not a path")
    p = PurePosixPath(path.replace("\\", "/"))
    if p.is_absolute() or ".." in p.parts:
        raise EditRejected("escapes_lab", f"{path}: leaves the lab; expected a path relative to the lab root")
    norm = str(PurePosixPath(*[part for part in p.parts if part not in ("", ".")]))
    program = lab.config.lab.program
    if (norm in PROTECTED or norm.rsplit("/", 1)[-1] in GIT_FILES or norm == program
            or norm.split("/")[0] in {"runs", ".git"}):
        raise EditRejected("harness", f"{norm}: part of the harness or the lab contract; never editable")
    if lab.is_trusted(norm):
        raise EditRejected("trusted", f"{norm}: a trusted harness file ([benchmark] trusted); "
                           "only a human moves it, with `autoresearch trust`")
    if not any(glob_match(norm, g) for g in lab.config.lab.editable):
        raise EditRejected("outside_editable", f"{norm}: not editable; editable files are {lab.config.lab.editable}")
    return norm


def check_syntax(path: str, text: str) -> None:
    """Reject code that cannot even be parsed: cheaper than a failed run, and fed back for repair."""
    try:
        if path.endswith(".py"):
            compile(text, path, "exec")
        elif path.endswith(".toml"):
            tomllib.loads(text)
        elif path.endswith(".json"):
            json.loads(text)
    except (SyntaxError, ValueError) as e:
        raise EditRejected("compile_error", f"{path}: {type(e).__name__}: {e}") from None


class Workspace(LabRepo):
    """The lab's repository seen as hypotheses: branches `hyp/<id>-<slug>` and their edits, on the
    lab's `LabRepo` (resolving, the baseline and its tags, tags, merges, promotion)."""

    def __init__(self, lab: Lab):
        super().__init__(lab.root)
        self.lab = lab
        self._ensure_identity()

    def _ensure_identity(self) -> None:
        reader = self.repo.config_reader()
        if not reader.has_option("user", "name"):
            with self.repo.config_writer() as cw:
                cw.set_value("user", "name", "autoresearch")
                cw.set_value("user", "email", "autoresearch@localhost")

    # -------------------------------------------------------------- reading

    def read(self, commit: str, path: str) -> str | None:
        """A file's exact text at a commit (GitPython's `git show` would strip the final newline)."""
        try:
            blob = self.repo.commit(commit).tree / path
        except KeyError:
            return None
        return blob.data_stream.read().decode("utf-8")

    def changed_paths(self, base: str, commit: str) -> list[str]:
        """Every path whose entry differs between two commits or trees: a rename counts as both its
        paths (`--no-renames`), and names come unquoted (`-z`), exactly as git stores them."""
        out = self.repo.git.diff_tree("-r", "-z", "--no-renames", "--name-only", base, commit)
        return [path for path in out.split("\x00") if path]

    def check_tree(self, base: str, tree: str) -> list[str]:
        """The paths `tree` (a commit or a tree) changes relative to `base`, each one the agent's to
        change (`check_path`: `editable`, not trusted, not the lab contract); `EditRejected` naming
        the first that is not. This is the check of what is measured and promoted, whatever made the
        tree: a commit, a merge onto a moved baseline (a re-base, a seeded branch's adoption), a
        resume. A merge is checked as its result, not as its inputs: `git merge-tree` follows renames
        (git 2.39's has no `-X no-renames`, and ignores `merge.renames`), so an edit of an editable
        file the baseline has since moved lands in the file's new path; a rename counts here as both
        its paths, so that edit is refused by its new path's name."""
        changed = self.changed_paths(base, tree)
        for path in changed:
            check_path(self.lab, path)
        return changed

    def diff(self, base: str, commit: str) -> str:
        return self.repo.git.diff(base, commit)

    def diff_stat(self, base: str, commit: str) -> str:
        return self.repo.git.diff("--stat", base, commit)

    # -------------------------------------------------------------- writing

    def apply(self, base: str, edits: list[FileEdit]) -> dict[str, str]:
        """The new content of every touched file, after all checks; nothing is written yet."""
        if not edits:
            raise EditRejected("empty", "no edits")
        files: dict[str, str] = {}
        for e in edits:
            path = check_path(self.lab, e.path)
            current = files.get(path, self.read(base, path))
            if e.search is None:
                files[path] = e.replace
                continue
            if current is None:
                raise EditRejected("not_applying", f"{path}: file does not exist; send its whole content instead")
            count = current.count(e.search)
            if count != 1:
                where = "not found" if count == 0 else f"found {count} times"
                raise EditRejected("not_applying", f"{path}: search text {where}; it must match exactly once")
            files[path] = current.replace(e.search, e.replace, 1)
        for path, text in files.items():
            check_syntax(path, text)
        if all(self.read(base, p) == t for p, t in files.items()):
            raise EditRejected("empty", "the edits change nothing")
        return files

    def tree_of(self, base: str, files: dict[str, str]) -> str:
        """The git tree `base` would have with `files` written into it (objects only, no ref moves)."""
        with tempfile.TemporaryDirectory() as tmp:
            env = {"GIT_INDEX_FILE": os.path.join(tmp, "index")}
            g = self.repo.git
            g.read_tree(base, env=env)
            for path, text in files.items():
                blob = self._blob(text)
                mode = "100755" if self._is_exec(base, path) else "100644"
                g.update_index("--add", "--cacheinfo", f"{mode},{blob},{path}", env=env)
            return g.write_tree(env=env)

    def commit_files(self, branch: str, base: str, files: dict[str, str], message: str) -> str:
        """Commit `files` on top of `base` and point `branch` at it, through a private index."""
        tree = self.tree_of(base, files)
        commit = self.repo.git.commit_tree(tree, "-p", base, "-m", message)
        self.repo.git.update_ref(f"refs/heads/{branch}", commit)
        return commit

    def _blob(self, text: str) -> str:
        with tempfile.NamedTemporaryFile("w", delete=False, encoding="utf-8") as fh:
            fh.write(text)
            name = fh.name
        try:
            return self.repo.git.hash_object("-w", name)
        finally:
            os.unlink(name)

    def _is_exec(self, base: str, path: str) -> bool:
        try:
            return self.repo.git.ls_tree(base, "--", path).startswith("100755")
        except git.GitCommandError:
            return False

    def point_branch(self, branch: str, commit: str) -> None:
        self.repo.git.update_ref(f"refs/heads/{branch}", commit)

