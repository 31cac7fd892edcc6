"""Branch deployments: each commit under test laid out in `runs/worktrees/<sha>`, and the per-stage
views of its files in `runs/views/`.

Why a tree of its own per commit: stages run the branch's code exactly as committed, while the lab's
own checkout stays wherever the human or the agent left it, and many commits can be measured at
once. This module is the only one that lays out, reuses, repairs and removes them, and the one that
reads files *at a commit* (from git blobs, never from a working directory a stage could have touched).

Nothing here is a git checkout: a tree is laid out from the commit's objects (`_lay_out`), because
git's checkout (and `git archive`) obeys the branch's own `.gitattributes` outside the sandbox: a
`filter` whose driver the lab's git config defines runs its command, `ident`, `eol`, `text` and
`working-tree-encoding` change the bytes. Laid out from blobs, a tree holds exactly what was committed.

All mutations hold an exclusive file lock (`runs/worktrees/.lock`), so concurrent drivers on one
lab do not race; the kernel drops the lock if its holder is killed.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import git

from pipeline import safefs
from pipeline.errors import InfrastructureFailure, UserError
from pipeline.lab import glob_match
from pipeline.labrepo import LabRepo
from pipeline.tomlview import Seen

SHA = re.compile(r"^[0-9a-f]{40}$")


class Worktrees:
    """The trees of the lab repository's commits (at `repo_root`), kept under `<state>/worktrees`,
    and the stages' views of them, under `<state>/views`."""

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
            raise InfrastructureFailure(str(e)) from None
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
        driver cannot find is a `InfrastructureFailure` here (the machinery's), a user's unknown one there."""
        try:
            return self.lab_repo.resolve(rev)
        except UserError as e:
            raise InfrastructureFailure(str(e)) from None

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

    # --- trees of commits ----------------------------------------------------------------------

    def path(self, commit: str) -> Path:
        return self.root / commit

    def ensure(self, rev: str) -> Path:
        """The tree of `rev`'s commit at `runs/worktrees/<sha>`: reused if there, else laid out from
        the commit's objects (never checked out: see the module's docstring).

        `UnsafeTree` (one line) for a commit whose tree is refused (`check_tree`, before anything is
        laid out) or whose tree on disk holds a link out of it (then removed)."""
        commit = self.resolve(rev)
        self.check_tree(commit)
        path = self.path(commit)
        if not path.is_dir():
            with self._locked():
                if not path.is_dir():
                    tmp = self.root / f".tmp-{commit}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
                    self._lay_out(commit, self._visible_files(commit, lambda p: True), tmp)
                    os.rename(tmp, path)  # whole or not at all: a half-laid tree never has this name
        try:
            self.check_checkout(path, commit)
        except safefs.UnsafeTree:
            with self._locked():
                self._remove_unlocked(path)
            raise
        return path

    def _remove_unlocked(self, path: Path) -> None:
        if (path / ".git").is_file():  # a `git worktree add` of an earlier version
            try:
                self.repo.git.worktree("remove", "--force", "--force", str(path))
            except git.GitCommandError:
                pass
        shutil.rmtree(path, ignore_errors=True)
        self._sound_checkouts.discard(path)
        self.repo.git.worktree("prune")

    def remove(self, rev: str) -> None:
        with self._locked():
            self._remove_unlocked(self.path(self.resolve(rev)))

    def gc(self, keep: Iterable[str]) -> tuple[list[str], int]:
        """Remove the trees and the views of every commit not in `keep` (full shas): decided
        challengers, superseded champions. A view is removed only where it says whose it is (its
        `<digest>.commit` beside it: views made by an earlier version, and the harness's view of the
        trusted files, say nothing and stay). Returns the trees' commits removed and how many
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

        - what is not a commit's whole tree is removed: a half-laid one (`.tmp-*`), a folder of
          another name, a tree whose files differ from its commit's (something wrote into it), a
          git checkout made by an earlier version (`git worktree add`, which obeyed the branch's
          `.gitattributes`), with git's records of those; each is laid out again on demand.
        """
        fixed: list[str] = []
        with self._locked():
            gitdir = Path(self.repo.git_dir) / "worktrees"
            for meta in gitdir.iterdir() if gitdir.is_dir() else []:
                try:  # a `locked` record is never pruned: unlock ours
                    wt = Path((meta / "gitdir").read_text().strip()).parent.resolve()
                except OSError:
                    continue
                if self.root in wt.parents and (meta / "locked").exists():
                    (meta / "locked").unlink()
            for path in sorted(self.root.iterdir()):
                if not path.is_dir():
                    continue
                if not SHA.match(path.name):
                    self._remove_unlocked(path)
                    fixed.append(f"removed {path.name[:40]}, not a commit's tree")
                elif not self._matches(path, path.name):
                    self._remove_unlocked(path)
                    fixed.append(f"removed the tree of {path.name[:12]}, which differed from its commit")
            self.repo.git.worktree("prune")
        return fixed

    def _matches(self, path: Path, commit: str) -> bool:
        """Whether the tree at `path` holds exactly the files of `commit`: the same paths, bytes,
        executable bits and link targets (read without following any link)."""
        try:
            want = self._visible_files(commit, lambda p: True)
            seen: set[str] = set()
            for rel, st, dfd, name in safefs.walk(path):
                if stat.S_ISDIR(st.st_mode):
                    continue
                blob = want.get(rel, (None, None))[0]
                if blob is None:
                    return False
                if stat.S_ISLNK(st.st_mode):
                    same = blob.mode == 0o120000 and os.fsencode(os.readlink(name, dir_fd=dfd)) == blob.data_stream.read()
                elif stat.S_ISREG(st.st_mode) and blob.mode != 0o120000:
                    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
                    with os.fdopen(fd, "rb") as fh:
                        data = fh.read()
                    same = (hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == blob.hexsha
                            and bool(st.st_mode & 0o111) == bool(blob.mode & 0o111))
                else:
                    same = False
                if not same:
                    return False
                seen.add(rel)
            return seen == set(want)
        except (OSError, ValueError, git.GitCommandError, RecursionError):  # UnsafeTree among them
            return False

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
        """`UnsafeTree` if the tree at `path`, as it is on disk, holds a link out of it (what was laid
        out, not what its blobs say); checked once per tree and process."""
        if path in self._sound_checkouts:
            return
        safefs.check_links(path, f"the worktree of {commit[:12]}")
        self._sound_checkouts.add(path)

    def _visible_files(self, commit: str, visible: Callable[[str], object]) -> dict[str, tuple[git.Blob, object]]:
        """The files of `commit` that `visible(path)` answers truthily for, with that answer (a
        `Seen` says how the file is seen); `UnsafeTree` for a refused tree (`check_tree`)."""
        tree = self.files_at(commit)
        links = {p for p, b in tree.items() if b.mode == 0o120000}
        self.check_tree(commit)
        out: dict[str, tuple[git.Blob, object]] = {}
        for p, b in tree.items():
            # a malformed tree can hold both a symlink `a` and a file `a/x`: never write through the link
            if any("/".join(p.split("/")[:i]) in links for i in range(1, p.count("/") + 1)):
                continue
            if seen := visible(p):
                out[p] = (b, seen)
        return out

    def _lay_out(self, commit: str, files: dict[str, tuple[git.Blob, object]], dst: Path) -> None:
        """Write `files` (`_visible_files`) from their git blobs into the new folder `dst`, no link
        followed; a file seen as some of its tables (`Seen`) is written as the stage sees it. On any
        failure nothing is left at `dst`."""
        dst.mkdir(parents=True)
        root_fd = safefs.open_root(dst)
        try:
            for path, (blob, seen) in files.items():
                if blob.mode == 0o120000:  # a symlink in the tree stays one (it resolves inside the sandbox)
                    safefs.make_symlink(root_fd, path, blob.data_stream.read().decode("utf-8", "surrogateescape"))
                    continue
                data = blob.data_stream.read()  # the raw object: no filter, no attribute applies
                if isinstance(seen, Seen):
                    data = seen.content(data)
                safefs.write_bytes(root_fd, path, data, executable=bool(blob.mode & 0o111), exclusive=True)
            safefs.chmod_dirs(dst)
        except ValueError as e:  # never a traceback: the one-line refusal
            shutil.rmtree(dst, ignore_errors=True)
            raise safefs.UnsafeTree(errno.EINVAL, f"commit {commit[:12]}: {e}; refused") from None
        except BaseException:
            shutil.rmtree(dst, ignore_errors=True)
            raise
        finally:
            os.close(root_fd)

    def view(self, commit: str, visible: Callable[[str], object], *, collectable: bool = True) -> Path:
        """A folder holding only the files of `commit` that `visible(path)` allows, from git blobs.

        What a sandboxed stage sees as its working directory (`visible` is `Lab.stage_sees` for the
        stage): a stage that reads a file it did not declare finds it missing, instead of a cache
        key that ignores it, and a file it declared by tables holds just those. Views never change
        once made (`runs/views/<hash of commit and what is seen>`), so they are shared and built
        once. Laid out without following any link (`pipeline.safefs`); a commit with a link that
        leaves its tree is refused (`UnsafeTree`) before anything is written. A `collectable` view
        says whose it is (`<digest>.commit` beside it), for `gc`.
        """
        files = self._visible_files(commit, visible)
        tables = {p: list(s.tables) for p, (_, s) in files.items() if isinstance(s, Seen) and s.tables}
        digest = hashlib.sha256(json.dumps([commit, sorted(files), *([tables] if tables else [])],
                                           sort_keys=True).encode()).hexdigest()[:32]
        final = self.views / digest
        if final.is_dir():
            return final
        tmp = self.views / f".tmp-{digest}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._lay_out(commit, files, tmp)
        if collectable:
            safefs.write_text(self.views, f"{digest}.commit", commit + "\n")
        try:
            os.rename(tmp, final)
        except OSError:  # another driver made it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
        return final
