"""Branch files written and read without following links. Standard library only (and its error,
`pipeline.errors.UnsafeTree`).

A branch's tree can hold symlinks, and a chain of them (`config.toml -> model.py/../X`,
`model.py -> train.py/..`, `train.py -> .`) passes a check made one link at a time while each is
extracted: the later links change where the earlier ones resolve. So the driver never opens a path
of a branch's files by name. Each component is opened relative to the tree's root fd with
`O_NOFOLLOW`, and a link at any component is refused (`UnsafeTree`). A tree is laid out without
following any link. Then its links are checked as a whole, after all entries exist: a tree holding a
link whose final target leaves it is refused, whatever order its entries came in (`check_links`).
"""

from __future__ import annotations

import errno
import os
import stat
import tarfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import IO

from pipeline.errors import UnsafeTree  # noqa: F401 (re-exported: raised here)

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_HOPS = 40  # the kernel's own limit on links followed in one lookup
MAX_DEPTH = 256  # components in any path of a tree (deeper ones are refused before anything is written)
MAX_TARGET_BYTES = 4096  # a link's target (the kernel's PATH_MAX)
MAX_TARGET_PARTS = 256  # components of a link's target
MAX_WALK = 100_000  # components walked while resolving all the links of one tree


def parts_of(rel: str) -> list[str]:
    """The components of a tree-relative path; `UnsafeTree` if it is absolute, empty or has `..`."""
    if not isinstance(rel, str) or not rel or "\x00" in rel or rel.startswith("/"):
        raise UnsafeTree(errno.EINVAL, f"{rel!r}: not a path inside the tree")
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise UnsafeTree(errno.EINVAL, f"{rel}: not a path inside the tree")
    if len(parts) > MAX_DEPTH:
        raise UnsafeTree(errno.ENAMETOOLONG, f"{rel[:60]}...: a path of over {MAX_DEPTH} components; refused")
    return parts


def open_root(root: str | os.PathLike[str]) -> int:
    """An fd of the tree's root folder (itself never a link)."""
    try:
        return os.open(root, DIR_FLAGS)
    except OSError as e:
        raise UnsafeTree(e.errno or errno.EINVAL, f"{root}: not a folder ({os.strerror(e.errno or 0)})") from None


def _refuse(rel: str, upto: list[str], e: OSError) -> UnsafeTree:
    where = "/".join(upto)
    if e.errno in (errno.ELOOP, errno.ENOTDIR):
        return UnsafeTree(errno.ELOOP, f"{rel}: {where} is a symlink or not a folder; never written or read through")
    return UnsafeTree(e.errno or errno.EIO, f"{rel}: {where}: {os.strerror(e.errno or errno.EIO)}")


def open_dir(root_fd: int, parts: list[str], *, create: bool = False, rel: str | None = None) -> int:
    """An fd of the folder `parts` below `root_fd`, each component opened with O_NOFOLLOW (made if
    `create`); `UnsafeTree` if any component is a link or not a folder. The caller closes it."""
    rel = rel or "/".join(parts)
    cur = os.dup(root_fd)
    try:
        for i, name in enumerate(parts):
            try:
                nxt = os.open(name, DIR_FLAGS, dir_fd=cur)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(name, 0o755, dir_fd=cur)
                except FileExistsError:
                    pass  # a dangling link there: the open below refuses it
                try:
                    nxt = os.open(name, DIR_FLAGS, dir_fd=cur)
                except OSError as e:
                    raise _refuse(rel, parts[:i + 1], e) from None
            except OSError as e:
                raise _refuse(rel, parts[:i + 1], e) from None
            os.close(cur)
            cur = nxt
        return cur
    except BaseException:
        os.close(cur)
        raise


def _open_file(root_fd: int, rel: str, flags: int, mode: int = 0o644, create_parents: bool = False) -> int:
    parts = parts_of(rel)
    parent = open_dir(root_fd, parts[:-1], create=create_parents, rel=rel)
    try:
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=parent)
    except OSError as e:
        raise _refuse(rel, parts, e) from None
    finally:
        os.close(parent)


def write_bytes(root: str | os.PathLike[str] | int, rel: str, data: bytes, *, executable: bool | None = None,
                exclusive: bool = False) -> None:
    """Write `data` to `rel` below `root` (a folder or its fd): no link followed at any component.
    `executable` None keeps an existing file's mode (a new one gets 0644)."""
    root_fd = root if isinstance(root, int) else open_root(root)
    try:
        flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
        fd = _open_file(root_fd, rel, flags, create_parents=True)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise UnsafeTree(errno.EINVAL, f"{rel}: not a regular file")
            if executable is not None:
                os.fchmod(fd, 0o755 if executable else 0o644)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
    finally:
        if not isinstance(root, int):
            os.close(root_fd)


def write_text(root: str | os.PathLike[str] | int, rel: str, text: str) -> None:
    write_bytes(root, rel, text.encode("utf-8"))


def read_bytes(root: str | os.PathLike[str] | int, rel: str, max_bytes: int) -> bytes:
    """At most `max_bytes` of the regular file `rel` below `root` (`UnsafeTree` if larger or a link)."""
    root_fd = root if isinstance(root, int) else open_root(root)
    try:
        fd = _open_file(root_fd, rel, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise UnsafeTree(errno.EINVAL, f"{rel}: not a regular file")
            if st.st_size > max_bytes:
                raise UnsafeTree(errno.EFBIG, f"{rel}: {st.st_size} bytes, more than the {max_bytes} read")
            chunks, left = [], max_bytes + 1
            while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
                chunks.append(chunk)
                left -= len(chunk)
            data = b"".join(chunks)
            if len(data) > max_bytes:
                raise UnsafeTree(errno.EFBIG, f"{rel}: more than the {max_bytes} bytes read")
            return data
        finally:
            os.close(fd)
    finally:
        if not isinstance(root, int):
            os.close(root_fd)


def make_symlink(root_fd: int, rel: str, target: str) -> None:
    """A symlink `rel -> target` below `root_fd` (its folders made, none of them followed)."""
    parts = parts_of(rel)
    check_target(rel, target)
    parent = open_dir(root_fd, parts[:-1], create=True, rel=rel)
    try:
        os.symlink(target, parts[-1], dir_fd=parent)
    except OSError as e:
        raise _refuse(rel, parts, e) from None
    finally:
        os.close(parent)


# ----------------------------------------------------------------------------- links as a whole


def check_target(rel: str, target: str) -> None:
    """`UnsafeTree` (one line) for a link target that is never laid out: a NUL byte (git and tar
    truncate it, the kernel refuses it), longer than MAX_TARGET_BYTES or MAX_TARGET_PARTS parts."""
    if not isinstance(target, str) or "\x00" in target:
        raise UnsafeTree(errno.EINVAL, f"{rel} -> {target!r}: a NUL byte in a symlink's target; refused")
    if len(target.encode("utf-8", "surrogateescape")) > MAX_TARGET_BYTES:
        raise UnsafeTree(errno.ENAMETOOLONG,
                         f"{rel} -> {target[:40]}...: a symlink's target over {MAX_TARGET_BYTES} bytes; refused")
    if target.count("/") + 1 > MAX_TARGET_PARTS:
        raise UnsafeTree(errno.ENAMETOOLONG,
                         f"{rel} -> {target[:40]}...: a symlink's target of over {MAX_TARGET_PARTS} parts; refused")


class _Tree:
    """The entries of one tree as nodes (0 is the root), and each link's resolution, memoised.

    Each link's final target is resolved once, as the kernel would, inside the tree: a component
    that is a link of the tree is replaced by that link's (memoised) resolution, `..` climbs to the
    parent of what has been resolved so far, a missing component or one that is not a folder ends
    the lookup (the link dangles: it leads nowhere, so not out). Leaving means an absolute target, a
    `..` above the root, or more than MAX_HOPS links followed (a loop). At most MAX_WALK components
    are walked in all, for the whole tree (`UnsafeTree` beyond), so its cost is linear in its size.
    """

    MISSING = -1

    def __init__(self, links: Mapping[str, str], files: Iterable[str], dirs: Iterable[str], what: str):
        self.what = what
        self.parent: list[int] = [0]
        self.kind: list[str] = ["d"]
        self.name: list[str] = [""]
        self.children: dict[tuple[int, str], int] = {}
        self.target: dict[int, str] = {}
        self.walked = 0
        self.memo: dict[int, tuple[int, int] | str] = {}  # link node -> (final node, hops) or why it leaves
        self.busy: list[int] = []  # links being resolved, outermost first
        for path in dirs:
            self._add(path, "d")
        for path in files:
            self._add(path, "f")
        for path, target in links.items():
            check_target(path, target)
            self.target[self._add(path, "l")] = target

    def _add(self, path: str, kind: str) -> int:
        parts = parts_of(path)
        node = 0
        for i, name in enumerate(parts):
            nxt = self.children.get((node, name))
            if nxt is None:
                nxt = len(self.kind)
                self.children[(node, name)] = nxt
                self.parent.append(node)
                self.name.append(name)
                self.kind.append(kind if i == len(parts) - 1 else "d")
            elif i == len(parts) - 1 and kind == "l":
                self.kind[nxt] = "l"  # a malformed tree's link `a` beside `a/x`: what is laid out is the link
            node = nxt
        return node

    def path(self, node: int) -> str:
        names = []
        while node:
            names.append(self.name[node])
            node = self.parent[node]
        return "/".join(reversed(names))

    def show(self, link: int) -> str:
        t = self.target[link]
        return f"{self.path(link)} -> {t if len(t) <= 120 else t[:120] + '...'}"

    def escape(self, link: int) -> str | None:
        """Why the link leads out of the tree (one line), or None."""
        r = self._resolve(link)
        if not isinstance(r[0], str):
            return None
        why, culprit = r
        return f"{self.show(link)}: {why}" + ("" if culprit == link else f", at {self.show(culprit)}")

    def _resolve(self, link: int) -> tuple[int, int] | tuple[str, int]:
        """(final node, links followed) or (why it leaves, the link where it does)."""
        done = self.memo.get(link)
        if done is not None:
            return done
        if link in self.busy or len(self.busy) >= MAX_HOPS:
            return "a loop of links", link
        target = self.target[link]
        if target.startswith("/"):
            self.memo[link] = out = ("an absolute target", link)
            return out
        self.busy.append(link)
        try:
            cur, hops = self.parent[link], 0
            for c in target.split("/"):
                self.walked += 1
                if self.walked > MAX_WALK:
                    raise UnsafeTree(errno.ELOOP, f"{self.what}: its symlinks take over {MAX_WALK} components "
                                                  "to resolve; refused")
                if c in ("", "."):
                    continue
                if cur == self.MISSING or self.kind[cur] != "d":
                    cur = self.MISSING  # ENOENT / ENOTDIR: the lookup ends here, inside the tree
                    break
                if c == "..":
                    if cur == 0:
                        self.memo[link] = out = ("resolves above the tree's root", link)
                        return out
                    cur = self.parent[cur]
                    continue
                nxt = self.children.get((cur, c), self.MISSING)
                if nxt != self.MISSING and self.kind[nxt] == "l":
                    r = self._resolve(nxt)
                    if isinstance(r[0], str):
                        return r  # the whole check stops at the first way out
                    nxt, h = r
                    hops += 1 + h
                    if hops > MAX_HOPS:
                        return "a loop of links", link
                cur = nxt
            self.memo[link] = (cur, hops)
            return cur, hops
        finally:
            self.busy.pop()


def escape_of(links: Mapping[str, str], link: str, files: Iterable[str] = (), dirs: Iterable[str] = ()) -> str | None:
    """Why the link `link` (tree-relative, its target `links[link]`) leads out of the tree of
    `links`, `files` and `dirs` (a folder above any entry is one too), or None (see `_Tree`)."""
    tree = _Tree(links, files, dirs, "the tree")
    return tree.escape(tree._add(link, "l"))


def check_link_map(links: Mapping[str, str], what: str = "the tree", *, files: Iterable[str] = (),
                   dirs: Iterable[str] = ()) -> None:
    """`UnsafeTree` naming the first link (by path) whose final target leaves `what`: the tree of
    `links` (path -> target), `files` (every other entry that is not a folder) and `dirs` (folders;
    those above any entry need not be named). Each link resolved once; a missing entry ends a
    lookup, so name every entry."""
    tree = _Tree(links, files, dirs, what)
    for link in sorted(links):
        why = tree.escape(tree._add(link, "l"))
        if why is not None:
            raise UnsafeTree(errno.ELOOP, f"{what} holds a symlink that leads out of it ({why}); refused")


def walk(root: str | os.PathLike[str], what: str = "the tree") -> Iterator[tuple[str, os.stat_result, int, str]]:
    """Every entry below `root` as (tree-relative path, lstat, fd of its folder, its name), no link
    followed, without recursion; `UnsafeTree` for a path deeper than MAX_DEPTH components.
    A folder is yielded before its entries; the fd is valid only until the next step."""
    root_fd = open_root(root)
    stack: list[tuple[int, str, list[str]]] = []
    try:
        stack.append((root_fd, "", sorted(os.listdir(root_fd))))
        root_fd = -1
        while stack:
            fd, rel, names = stack[-1]
            if not names:
                os.close(fd)
                stack.pop()
                continue
            name = names.pop()
            path = f"{rel}/{name}" if rel else name
            st = os.lstat(name, dir_fd=fd)
            if stat.S_ISDIR(st.st_mode) and len(stack) >= MAX_DEPTH:
                raise UnsafeTree(errno.ENAMETOOLONG, f"{what}: a path deeper than {MAX_DEPTH} folders "
                                                     f"({path[:60]}...); refused")
            yield path, st, fd, name
            if stat.S_ISDIR(st.st_mode):
                sub = os.open(name, DIR_FLAGS, dir_fd=fd)
                try:
                    stack.append((sub, path, sorted(os.listdir(sub))))
                except BaseException:
                    os.close(sub)
                    raise
    finally:
        if root_fd >= 0:
            os.close(root_fd)
        for fd, _, _ in stack:
            os.close(fd)


def links_in(root: str | os.PathLike[str], what: str = "the tree") -> tuple[dict[str, str], list[str], list[str]]:
    """Every entry below `root`, found without following any link: (symlinks as path → target,
    the other files, the folders)."""
    links: dict[str, str] = {}
    files: list[str] = []
    dirs: list[str] = []
    for path, st, dfd, name in walk(root, what):
        if stat.S_ISLNK(st.st_mode):
            links[path] = os.readlink(name, dir_fd=dfd)
        elif stat.S_ISDIR(st.st_mode):
            dirs.append(path)
        else:
            files.append(path)
    return links, files, dirs


def check_links(root: str | os.PathLike[str], what: str | None = None) -> None:
    """Refuse (`UnsafeTree`) a laid-out tree holding a link whose final target leaves it."""
    what = what or "the tree"
    links, files, dirs = links_in(root, what)
    check_link_map(links, what, files=files, dirs=dirs)


# ----------------------------------------------------------------------------- laying out trees

def extract_tar(fileobj: IO[bytes], dst: str | os.PathLike[str], *, what: str = "the tree") -> None:
    """Lay out a tar archive (folders, regular files, symlinks only) in the new folder `dst`.

    No entry is written through a link, whatever order the entries come in; then the links are
    checked as a whole (`check_links`). `UnsafeTree` (one line) for anything refused; `dst` may
    then hold a part of the tree (the caller removes it).
    """
    os.makedirs(dst, exist_ok=True)
    root_fd = open_root(dst)
    try:
        with tarfile.open(fileobj=fileobj, mode="r|*") as tar:
            for m in tar:
                name = m.name.removeprefix("./")
                if name in ("", "."):
                    continue
                if m.isdir():
                    os.close(open_dir(root_fd, parts_of(name), create=True, rel=name))
                elif m.isreg():
                    src = tar.extractfile(m)
                    assert src is not None
                    _write_stream(root_fd, name, src, executable=bool(m.mode & 0o111))
                elif m.issym():
                    make_symlink(root_fd, name, m.linkname)
                else:
                    kind = "hard link" if m.islnk() else "special file"
                    raise UnsafeTree(errno.EINVAL, f"{what}: {name} is a {kind}; only files, folders and symlinks")
        check_links(dst, what)
    except ValueError as e:  # e.g. a NUL byte in a name (never laid out)
        raise UnsafeTree(errno.EINVAL, f"{what}: {e}; refused") from None
    finally:
        os.close(root_fd)


def _write_stream(root_fd: int, rel: str, src: IO[bytes], *, executable: bool) -> None:
    fd = _open_file(root_fd, rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL, create_parents=True)
    try:
        os.fchmod(fd, 0o755 if executable else 0o644)
        while chunk := src.read(1 << 20):
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def copy_tree(src: str | os.PathLike[str], dst: str | os.PathLike[str], keep: Callable[[str], object] | None = None,
              content: Callable[[str, bytes], bytes] | None = None) -> None:
    """Copy the regular files and symlinks of `src` (those whose tree-relative path `keep` allows)
    into the new folder `dst`, with their folders, reading and writing without following any link.
    With `content`, a regular file is read whole and `content(path, its bytes)` written instead."""
    os.makedirs(dst, exist_ok=True)
    dst_fd = open_root(dst)
    try:
        for path, st, dfd, name in walk(src):
            if stat.S_ISDIR(st.st_mode) or (keep is not None and not keep(path)):
                continue
            if stat.S_ISLNK(st.st_mode):
                make_symlink(dst_fd, path, os.readlink(name, dir_fd=dfd))
            elif stat.S_ISREG(st.st_mode):
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
                if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped since the walk saw it
                    os.close(fd)
                    raise UnsafeTree(errno.EINVAL, f"{path}: not a regular file")
                with os.fdopen(fd, "rb") as fh:
                    if content is None:
                        _write_stream(dst_fd, path, fh, executable=bool(st.st_mode & 0o111))
                    else:
                        write_bytes(dst_fd, path, content(path, fh.read()), executable=bool(st.st_mode & 0o111),
                                    exclusive=True)
    finally:
        os.close(dst_fd)


def chmod_dirs(root: str | os.PathLike[str], mode: int = 0o755) -> None:
    """Every folder of the tree at `root`, itself included, set to `mode` (no link followed)."""
    fd = open_root(root)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    for _path, st, dfd, name in walk(root):
        if stat.S_ISDIR(st.st_mode):
            sub = os.open(name, DIR_FLAGS, dir_fd=dfd)
            try:
                os.fchmod(sub, mode)
            finally:
                os.close(sub)
