"""Branch files written and read without following links. Standard library only.

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
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_HOPS = 40  # the kernel's own limit on links followed in one lookup


class UnsafeTree(OSError):
    """A tree or a path in it that the driver refuses to write or read through (one line)."""

    def __str__(self) -> str:
        return str(self.strerror)


def parts_of(rel: str) -> list[str]:
    """The components of a tree-relative path; `UnsafeTree` if it is absolute, empty or has `..`."""
    if not isinstance(rel, str) or not rel or "\x00" in rel or rel.startswith("/"):
        raise UnsafeTree(errno.EINVAL, f"{rel!r}: not a path inside the tree")
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise UnsafeTree(errno.EINVAL, f"{rel}: not a path inside the tree")
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
    parent = open_dir(root_fd, parts[:-1], create=True, rel=rel)
    try:
        os.symlink(target, parts[-1], dir_fd=parent)
    except OSError as e:
        raise _refuse(rel, parts, e) from None
    finally:
        os.close(parent)


# ----------------------------------------------------------------------------- links as a whole

def escape_of(links: Mapping[str, str], link: str) -> str | None:
    """Why the link `link` (tree-relative, its target `links[link]`) leads out of the tree, or None.

    Resolved as the kernel would, inside the tree: each component that is itself a link of the tree
    is replaced by its target, `..` climbs what has been resolved so far. Leaving means an absolute
    target, a `..` above the root, or more than MAX_HOPS links (a loop).
    """
    stack = link.split("/")[:-1]
    todo = deque(links[link].split("/"))
    if links[link].startswith("/"):
        return f"{link} -> {links[link]}: an absolute target"
    hops = 0
    while todo:
        c = todo.popleft()
        if c in ("", "."):
            continue
        if c == "..":
            if not stack:
                return f"{link} -> {links[link]}: resolves above the tree's root"
            stack.pop()
            continue
        stack.append(c)
        at = "/".join(stack)
        if at in links:
            hops += 1
            if hops > MAX_HOPS:
                return f"{link} -> {links[link]}: a loop of links"
            target = links[at]
            if target.startswith("/"):
                return f"{link} -> {links[link]}: reaches {at} -> {target}, an absolute target"
            stack.pop()
            todo.extendleft(reversed(target.split("/")))
    return None


def check_link_map(links: Mapping[str, str], what: str = "the tree") -> None:
    """`UnsafeTree` naming the first link (by path) whose final target leaves `what`."""
    for link in sorted(links):
        why = escape_of(links, link)
        if why is not None:
            raise UnsafeTree(errno.ELOOP, f"{what} holds a symlink that leads out of it ({why}); refused")


def links_in(root: str | os.PathLike[str]) -> dict[str, str]:
    """Every symlink below `root` (tree-relative path → target), found without following any."""
    out: dict[str, str] = {}
    for top, dirs, files, dfd in os.fwalk(root, follow_symlinks=False):
        rel = os.path.relpath(top, root)
        for name in [*dirs, *files]:
            st = os.lstat(name, dir_fd=dfd)
            if stat.S_ISLNK(st.st_mode):
                out[name if rel == "." else f"{rel}/{name}"] = os.readlink(name, dir_fd=dfd)
    return out


def check_links(root: str | os.PathLike[str], what: str | None = None) -> None:
    """Refuse (`UnsafeTree`) a laid-out tree holding a link whose final target leaves it."""
    check_link_map(links_in(root), what or "the tree")


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


def copy_tree(src: str | os.PathLike[str], dst: str | os.PathLike[str],
              keep: Callable[[str], bool] | None = None) -> None:
    """Copy the regular files and symlinks of `src` (those whose tree-relative path `keep` allows)
    into the new folder `dst`, with their folders, reading and writing without following any link."""
    os.makedirs(dst, exist_ok=True)
    dst_fd = open_root(dst)
    try:
        for top, dirs, files, dfd in os.fwalk(src, follow_symlinks=False):
            rel = os.path.relpath(top, src)
            for name in sorted([*dirs, *files]):
                path = name if rel == "." else f"{rel}/{name}"
                st = os.lstat(name, dir_fd=dfd)
                if stat.S_ISDIR(st.st_mode) or (keep is not None and not keep(path)):
                    continue
                if stat.S_ISLNK(st.st_mode):
                    make_symlink(dst_fd, path, os.readlink(name, dir_fd=dfd))
                elif stat.S_ISREG(st.st_mode):
                    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                    with os.fdopen(fd, "rb") as fh:
                        _write_stream(dst_fd, path, fh, executable=bool(st.st_mode & 0o111))
    finally:
        os.close(dst_fd)
