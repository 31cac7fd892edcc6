"""Bounded disk: the stage cache under `[run] cache_max_gb` by LRU eviction, stage logs and smoke
runs' logs under `[run] logs_max_mb` by age, and what each of the lab's folders holds (for `status`).

Eviction never takes an entry that is needed: the keys of the current baseline's runs, of every
commit with runs queued or running (an in-flight hypothesis, a champion's fresh runs), and the ones
the driver's own active runs hold as inputs. An entry evicted anyway (a later hypothesis needs an
old one) is not missing, only recomputed: the driver looks an output up on disk, never in the store.
Each eviction is atomic (the folder is renamed away, then removed), so no stage sees half of one.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:
    from pipeline.dag import Cache
    from pipeline.lab import Lab
    from pipeline.store import Store
    from pipeline.worktrees import Worktrees

log = logging.getLogger("autoresearch.disk")

GB = 1 << 30
MB = 1 << 20
# a smoke run's folder or logs this recent may be in use: twice the most a smoke stage may take
# (pipeline.smoke.SMOKE_TIMEOUT_S, 300 s), so a silent stage's log, opened at its start, stays
SMOKE_FRESH_S = 600.0
LOW_WATER = 0.9  # evict down to this fraction of the cap, so that not every publication evicts
GC_EVERY_S = 600.0  # how often the driver removes worktrees and views no run needs
REREAD_EVERY = 50  # bounds between two reads of the cache's size from the store (other drivers publish too)


def tree_bytes(path: Path) -> int:
    """Apparent size of the regular files under `path` (symlinks not followed)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            if not os.path.islink(os.path.join(root, name)):
                total += st.st_size
    return total


class DiskKeeper:
    def __init__(self, lab: Lab, store: Store, cache: Cache, logs: Path):
        self.lab, self.store, self.cache, self.logs = lab, store, cache, logs
        run = lab.config.run
        self.cache_max = int(run.cache_max_gb * GB) if run.cache_max_gb is not None else None
        self.logs_max = run.logs_max_mb * MB
        self.evicted = 0
        self._known: int | None = None  # the cache's bytes at the last read, plus what this driver published since
        self._collected_at: float | None = None  # when worktrees and views were last collected
        self._unread = 0  # bounds since that read (other drivers publish too: read again every REREAD_EVERY)

    # --- the cache ------------------------------------------------------------------------------

    def adopt_untracked(self) -> int:
        """Entries on disk the store has no size for (made by an earlier version): measure them once."""
        known = {u.key for u in self.store.cache_uses()}
        n = 0
        for p in self.cache.root.iterdir():
            if p.name.startswith(".") or not p.is_dir() or p.name in known:
                continue
            self.store.cache_touch(p.name, tree_bytes(p), used_at=p.stat().st_mtime)
            n += 1
        return n

    def published(self, key: str) -> int:
        """A new entry's size (the caller records it with the publication, in one write)."""
        size = tree_bytes(self.cache.path(key))
        if self._known is not None:
            self._known += size
        return size

    def used(self, key: str) -> None:
        self.store.cache_touch(key)

    def collect(self, worktrees: "Worktrees") -> tuple[int, int]:
        """The worktrees and views of commits nothing needs any more (decided challengers,
        superseded champions) removed: every commit with runs queued or running and the baseline's
        head are kept. At the driver's start and every GC_EVERY_S after. (worktrees, views) removed."""
        self._collected_at = time.monotonic()
        removed, views = worktrees.gc(self.needed_commits())
        if removed or views:
            log.info("disk: removed %d worktree(s) and %d view(s) of commits no run needs", len(removed), views)
        return len(removed), views

    def collect_due(self) -> bool:
        return self._collected_at is None or time.monotonic() - self._collected_at > GC_EVERY_S

    def needed_commits(self) -> set[str]:
        """The commits a run still needs: every one with runs queued or running, and the baseline's head."""
        from pipeline.errors import InfrastructureFailure
        from pipeline.labnames import BASELINE_BRANCH
        from pipeline.labrepo import resolve_commit

        commits = set(self.store.commits_in_flight())
        try:
            commits.add(resolve_commit(self.lab, BASELINE_BRANCH))
        except InfrastructureFailure:  # no baseline branch (a bare benchmark run): nothing more to keep
            pass
        return commits

    def protected(self, held: Iterable[str]) -> set[str]:
        return self.store.keys_of(self.needed_commits()) | set(held)

    def bound(self, held: Iterable[str]) -> int:
        """Evict least recently used entries until the cache is under its low-water mark; returns
        how many. `held`: keys this driver is using right now (inputs of active runs, flights)."""
        if self.cache_max is None:
            return 0
        if self._known is not None and self._known <= self.cache_max * LOW_WATER and self._unread < REREAD_EVERY:
            self._unread += 1  # under the cap by what this driver published since the last read: no query
            return 0
        self._known, self._unread = self.store.cache_bytes(), 0
        if self._known <= self.cache_max:
            return 0
        uses = self.store.cache_uses()
        total = sum(u.size_bytes for u in uses)
        keep = self.protected(held)
        target = int(self.cache_max * LOW_WATER)
        n = 0
        for u in uses:  # least recently used first
            if total <= target:
                break
            if u.key in keep:
                continue
            self._evict(u.key)
            total -= u.size_bytes
            n += 1
        self._known = total
        if n:
            self.evicted += n
            state = "" if total <= self.cache_max else (
                f"; still {total / GB:.2f} GB: the rest is needed by the baseline or runs in flight")
            log.info("cache: evicted %d least recently used entr%s (cap %.2f GB)%s", n, "y" if n == 1 else "ies",
                     self.cache_max / GB, state)
        return n

    def _evict(self, key: str) -> None:
        path = self.cache.path(key)
        if path.is_dir():
            gone = self.cache.tmp_root / f"evict-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            try:
                os.rename(path, gone)  # atomic: the entry is there whole, or not at all
            except OSError:
                return
            shutil.rmtree(gone, ignore_errors=True)
        self.store.cache_evicted(key)

    # --- logs -----------------------------------------------------------------------------------

    def rotate_logs(self, keep: Iterable[Path] = (), now: float | None = None) -> int:
        """Remove the oldest logs while they hold more than `logs_max_mb` (never one in use).

        Stage logs (`logs/*.log`) and smoke runs' logs (`logs/smoke/<run>/*.log`) count together. A
        smoke run's folder made or with a log written in the last SMOKE_FRESH_S may be in use (the smoke
        run of a driver is not in `keep`): it stays; a folder left empty is removed.
        """
        now = time.time() if now is None else now
        keep = {Path(p) for p in keep}
        files = []
        for p in self.logs.glob("*.log"):
            try:
                st = p.stat()
            except OSError:
                continue
            files.append((st.st_mtime, st.st_size, p))
        smoke_dirs = []
        for d in (self.logs / "smoke").glob("*"):
            try:
                dst = d.lstat()
            except OSError:
                continue
            if not stat.S_ISDIR(dst.st_mode):
                continue
            own = []
            for p in d.glob("*.log"):
                try:
                    st = p.lstat()
                except OSError:
                    continue
                own.append((st.st_mtime, st.st_size, p))
            # the folder's own mtime too: a smoke run's new folder has no log until its first stage starts
            fresh = any(now - mtime < SMOKE_FRESH_S for mtime in (dst.st_mtime, *(m for m, _, _ in own)))
            keep.update(p for _, _, p in own if fresh)
            files.extend(own)
            if not fresh:
                smoke_dirs.append(d)
        total = sum(size for _, size, _ in files)
        n = 0
        for _, size, p in sorted(files):
            if total <= self.logs_max:
                break
            if p in keep:
                continue
            p.unlink(missing_ok=True)
            total -= size
            n += 1
        for d in smoke_dirs:  # never a fresh one
            try:
                d.rmdir()  # only when empty
            except OSError:
                pass
        return n


def usage(lab: Lab, store: Store) -> dict[str, float | None]:
    """MB on disk per folder of the lab's state, and the caps."""
    state = lab.state
    out: dict[str, float | None] = {"cache_mb": round(store.cache_bytes() / MB, 3)}
    for name in ("worktrees", "views", "logs"):
        p = state / name
        out[f"{name}_mb"] = round(tree_bytes(p) / MB, 3) if p.is_dir() else 0.0
    out["cache_max_gb"] = lab.config.run.cache_max_gb
    out["logs_max_mb"] = lab.config.run.logs_max_mb
    return out


def open_regular(path: Path) -> BinaryIO | None:
    """A file a stage may have written, opened for reading without following a link and without
    blocking (a FIFO in its place), or None if it is missing, a link or not a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return os.fdopen(fd, "rb")


def read_tail(path: Path, limit: int) -> tuple[str, int]:
    """The last `limit` bytes of a file (a stage's log: any size) as text, and the file's size.

    Read with a seek, never whole; not through a link. ("", 0) if there is no such regular file."""
    fh = open_regular(path)
    if fh is None:
        return "", 0
    with fh:
        size = os.fstat(fh.fileno()).st_size
        fh.seek(max(0, size - limit))
        return fh.read(limit).decode(errors="replace"), size
