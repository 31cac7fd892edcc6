"""Branch deployments: one git worktree per commit under test, in `runs/worktrees/<sha>`.

Why worktrees: stages run the branch's code exactly as committed, while the lab's own checkout
stays wherever the human or the agent left it, and many commits can be measured at once. This module
is the only one that creates, reuses, repairs and removes them, and the one that reads files *at a
commit* (from git blobs, never from a working directory a stage could have touched).

All mutations hold an exclusive file lock (`runs/worktrees/.lock`), so concurrent drivers on one
lab do not race `git worktree add`; the kernel drops the lock if its holder is killed.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import git

from pipeline import safefs
from pipeline.errors import UserError, WorktreeError
from pipeline.lab import glob_match
from pipeline.labrepo import LabRepo

SHA = re.compile(r"^[0-9a-f]{40}$")


class Worktrees:
    """Worktrees of the lab repository at `repo_root`, kept under `<state>/worktrees`."""

    def __init__(self, repo_root: Path, state: Path):
        self.repo_root = Path(repo_root).resolve()
        self.root = Path(state).resolve() / "worktrees"
        self.root.mkdir(parents=True, exist_ok=True)
        self.views = Path(state).resolve() / "views"
        self.views.mkdir(parents=True, exist_ok=True)
        self._sound_trees: set[str] = set()  # commits whose links were checked (a commit never changes)
        self._sound_checkouts: set[Path] = set()  # worktrees whose links on disk were checked
        try:
            self.lab_repo = LabRepo(self.repo_root)
        except UserError as e:
            raise WorktreeError(str(e)) from None
        self.repo = self.lab_repo.repo

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.root / ".lock", "a+") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    # --- reading commits --------------------------------------------------------------------

    def resolve(self, rev: str) -> str:
        """The full sha of a revision (sha, branch, tag), by the lab's `LabRepo`: a revision the
        driver cannot find is a `WorktreeError` here (the machinery's), a user's unknown one there."""
        try:
            return self.lab_repo.resolve(rev)
        except UserError as e:
            raise WorktreeError(str(e)) from None

    def files_at(self, commit: str) -> dict[str, git.Blob]:
        """Every file of the commit's tree, by POSIX path."""
        tree = self.repo.commit(commit).tree
        return {b.path: b for b in tree.traverse() if isinstance(b, git.Blob)}

    def match(self, commit: str, patterns: Iterable[str]) -> dict[str, git.Blob]:
        """Files of the commit that match any glob, sorted by path."""
        files = self.files_at(commit)
        out: dict[str, git.Blob] = {}
        for pattern in patterns:
            out.update({p: b for p, b in files.items() if glob_match(p, pattern)})
        return dict(sorted(out.items()))

    def read(self, commit: str, path: str) -> bytes:
        blob = self.files_at(commit).get(path)
        if blob is None:
            raise FileNotFoundError(f"{path} not in commit {commit[:12]}")
        return blob.data_stream.read()

    # --- worktrees --------------------------------------------------------------------------

    def path(self, commit: str) -> Path:
        return self.root / commit

    def ensure(self, rev: str) -> Path:
        """The worktree for `rev`'s commit: reused if it exists and is sound, else (re)created.

        `UnsafeTree` (one line) for a commit whose tree is refused (`check_tree`, before anything is
        laid out) or whose checkout on disk holds a link out of it (then removed)."""
        commit = self.resolve(rev)
        self.check_tree(commit)
        path = self.path(commit)
        if not self._sound(path, commit):
            with self._locked():
                if not self._sound(path, commit):
                    self._remove_unlocked(path)
                    try:
                        self.repo.git.worktree("add", "--detach", "--force", str(path), commit)
                    except git.GitCommandError as e:
                        raise WorktreeError(f"cannot create worktree for {commit[:12]}: {e.stderr.strip()}") from None
        try:
            self.check_checkout(path, commit)
        except safefs.UnsafeTree:
            with self._locked():
                self._remove_unlocked(path)
            raise
        return path

    def _sound(self, path: Path, commit: str) -> bool:
        if not (path / ".git").is_file():
            return False
        try:
            return git.Repo(path).head.commit.hexsha == commit
        except (git.InvalidGitRepositoryError, git.NoSuchPathError, ValueError, git.GitCommandError):
            return False

    def _remove_unlocked(self, path: Path) -> None:
        if path.exists():
            try:
                self.repo.git.worktree("remove", "--force", "--force", str(path))
            except git.GitCommandError:
                shutil.rmtree(path, ignore_errors=True)
        self.repo.git.worktree("prune")

    def remove(self, rev: str) -> None:
        with self._locked():
            self._remove_unlocked(self.path(self.resolve(rev)))

    def gc(self, keep: Iterable[str]) -> tuple[list[str], int]:
        """Remove the worktrees and the views of every commit not in `keep` (full shas): decided
        challengers, superseded champions. A view is removed only where it says whose it is (its
        `<digest>.commit` beside it: views made by an earlier version, and the harness's view of the
        trusted files, say nothing and stay). Returns the worktrees' commits removed and how many
        views. Whatever is removed is made again on demand (`ensure`, `view`)."""
        keep_set = set(keep)
        removed: list[str] = []
        with self._locked():
            for path in sorted(self.root.iterdir()):
                if path.is_dir() and SHA.match(path.name) and path.name not in keep_set:
                    self._remove_unlocked(path)
                    removed.append(path.name)
        views = 0
        for owner in sorted(self.views.glob("*.commit")):
            try:  # the driver's own file, read as any in the lab's state is: no link, bounded
                commit = safefs.read_bytes(self.views, owner.name, 128).decode("ascii", "replace").strip()
            except OSError:  # UnsafeTree among them
                continue
            if commit in keep_set:
                continue
            view = owner.with_suffix("")
            gone = self.views / f".gone-{view.name}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
            try:
                os.rename(view, gone)  # atomic: a stage starting now finds it whole or makes it again
            except FileNotFoundError:
                pass
            except OSError:
                continue
            owner.unlink(missing_ok=True)
            shutil.rmtree(gone, ignore_errors=True)
            views += 1
        return removed, views

    def repair(self) -> list[str]:
        """Start-up repair after a killed process; returns what was fixed, for the log.

        - git's records of worktrees whose folder is gone are pruned;
        - `locked` markers and `index.lock` files left in our worktrees' git dirs are removed
          (only our own: no other process mutates worktrees under runs/worktrees without our lock);
        - folders that are not sound worktrees of their commit (a half-made `worktree add`) are removed;
        - sound worktrees are reset to their commit, so a stage that wrote into its working
          directory cannot leak into later runs.
        """
        fixed: list[str] = []
        with self._locked():
            self.repo.git.worktree("prune")
            gitdir = Path(self.repo.git_dir) / "worktrees"
            for meta in gitdir.iterdir() if gitdir.is_dir() else []:
                target = meta / "gitdir"
                try:
                    wt = Path(target.read_text().strip()).parent.resolve()
                except OSError:
                    continue
                if self.root not in wt.parents:
                    continue
                for stale in ("locked", "index.lock"):
                    if (meta / stale).exists():
                        (meta / stale).unlink()
                        fixed.append(f"removed {stale} of {wt.name[:12]}")
            for path in sorted(self.root.iterdir()):
                if not path.is_dir():
                    continue
                if not SHA.match(path.name) or not self._sound(path, path.name):
                    self._remove_unlocked(path)
                    shutil.rmtree(path, ignore_errors=True)
                    fixed.append(f"removed broken worktree {path.name[:12]}")
                    continue
                wt = git.Repo(path)
                if wt.is_dirty(untracked_files=True):
                    wt.git.reset("--hard", path.name)
                    wt.git.clean("-fdx")
                    fixed.append(f"reset worktree {path.name[:12]}")
            self.repo.git.worktree("prune")
        return fixed

    def check_tree(self, commit: str) -> None:
        """`UnsafeTree` (one line) if the commit holds a symlink whose final target, resolved within
        the tree with all its links, leaves it, a target with a NUL byte (git would lay it out cut
        short) or a path deeper than `safefs.MAX_DEPTH`: such a tree is never laid out or measured."""
        if commit in self._sound_trees:
            return
        what = f"commit {commit[:12]}"
        links: dict[str, str] = {}
        files: list[str] = []
        dirs: list[str] = []
        try:
            for item in self.repo.commit(commit).tree.traverse():
                if isinstance(item, git.Blob) and item.mode == 0o120000:
                    links[item.path] = item.data_stream.read().decode("utf-8", "surrogateescape")
                elif isinstance(item, git.Blob):
                    files.append(item.path)
                else:  # a folder, or a submodule's (empty) folder
                    dirs.append(item.path)
            safefs.check_link_map(links, what, files=files, dirs=dirs)
        except RecursionError:  # GitPython walks a tree recursively
            raise safefs.UnsafeTree(errno.ENAMETOOLONG, f"{what}: folders nested too deep to read; refused") from None
        except safefs.UnsafeTree as e:
            raise safefs.UnsafeTree(e.errno, e.strerror if what in str(e.strerror) else f"{what}: {e}") from None
        self._sound_trees.add(commit)

    def check_checkout(self, path: Path, commit: str) -> None:
        """`UnsafeTree` if the worktree at `path`, as it is on disk, holds a link out of it (what git
        laid out, not what its blobs say); checked once per worktree and process."""
        if path in self._sound_checkouts:
            return
        safefs.check_links(path, f"the worktree of {commit[:12]}")
        self._sound_checkouts.add(path)

    def view(self, commit: str, visible: Callable[[str], bool], *, collectable: bool = True) -> Path:
        """A folder holding only the files of `commit` that `visible(path)` allows, from git blobs.

        What a sandboxed stage sees as its working directory: a stage that reads a file it did not
        declare finds it missing, instead of a cache key that ignores it. Views never change once
        made (`runs/views/<hash of commit and file list>`), so they are shared and built once.
        Laid out without following any link (`pipeline.safefs`); a commit with a link that leaves
        its tree is refused (`UnsafeTree`) before anything is written. A `collectable` view says
        whose it is (`<digest>.commit` beside it), for `gc`.
        """
        tree = self.files_at(commit)
        links = {p for p, b in tree.items() if b.mode == 0o120000}
        self.check_tree(commit)
        # a malformed tree can hold both a symlink `a` and a file `a/x`: never write through the link
        files = {p: b for p, b in tree.items() if visible(p)
                 and not any("/".join(p.split("/")[:i]) in links for i in range(1, p.count("/") + 1))}
        digest = hashlib.sha256(json.dumps([commit, sorted(files)]).encode()).hexdigest()[:32]
        final = self.views / digest
        if final.is_dir():
            return final
        tmp = self.views / f".tmp-{digest}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        tmp.mkdir(parents=True)
        root_fd = safefs.open_root(tmp)
        try:
            for path, blob in files.items():
                if blob.mode == 0o120000:  # a symlink in the tree stays one (it resolves inside the sandbox)
                    safefs.make_symlink(root_fd, path, blob.data_stream.read().decode("utf-8", "surrogateescape"))
                else:
                    safefs.write_bytes(root_fd, path, blob.data_stream.read(), executable=bool(blob.mode & 0o111),
                                       exclusive=True)
            safefs.chmod_dirs(tmp)
        except ValueError as e:  # never a traceback: the one-line refusal
            shutil.rmtree(tmp, ignore_errors=True)
            raise safefs.UnsafeTree(errno.EINVAL, f"commit {commit[:12]}: {e}; refused") from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            os.close(root_fd)
        if collectable:
            safefs.write_text(self.views, f"{digest}.commit", commit + "\n")
        try:
            os.rename(tmp, final)
        except OSError:  # another driver made it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
        return final

    def archive(self, commit: str) -> bytes:
        """The commit's tree as a tar archive: how a worktree travels to a remote worker."""
        import io

        buf = io.BytesIO()
        self.repo.archive(buf, treeish=commit, format="tar")
        return buf.getvalue()
