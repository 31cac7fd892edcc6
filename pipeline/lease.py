"""One driver per lab: a lease row in the store (holder host, pid, start time, heartbeat).

Two drivers on one lab would drive the same hypotheses (seen: a real gain abandoned by one while
the other escalated it, and a tag conflict). `acquire` takes the lease or raises `UserError` naming
the holder; a holder that is dead — on this host its process is gone (or its pid was recycled), on
another its heartbeat is older than `stale_s` — is taken over. The taking is a compare-and-swap on
the row, so of two drivers starting at the same instant exactly one wins. The holder refreshes the
heartbeat (`refresh`) and deletes the row on a clean stop (`release`).

`Heartbeat` is a process's one heartbeat thread: each beat refreshes the lease (where the process
holds it) and every run the process claimed, which is how another host tells a live driver from
a dead one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, update
from sqlalchemy.exc import IntegrityError
from sqlmodel import Field, SQLModel

from pipeline.errors import UserError
from pipeline.store import Owner, Store, create_schema  # noqa: F401 (Owner: the lease holder, re-exported)

KEY = "driver"
STALE_S = 120.0
HEARTBEAT_S = 5.0

log = logging.getLogger("autoresearch.lease")


class Lease(SQLModel, table=True):
    __tablename__ = "lease"
    key: str = Field(primary_key=True)
    host: str
    pid: int
    started: float  # the holder's process start time: a recycled pid is not the holder
    acquired_at: float
    heartbeat_at: float


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    acquired_at: float
    heartbeat_at: float
    alive: bool

    def as_dict(self) -> dict[str, Any]:
        return {"host": self.host, "pid": self.pid, "since": self.acquired_at,
                "heartbeat_age_s": round(time.time() - self.heartbeat_at, 1), "alive": self.alive}

    def describe(self) -> str:
        return (f"{self.host} pid {self.pid} since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.acquired_at))}"
                f" (heartbeat {time.time() - self.heartbeat_at:.0f} s ago)")


def _alive(row: Lease, stale_s: float) -> bool:
    by_pid = Owner(row.host, row.pid, row.started).alive()
    return by_pid if by_pid is not None else time.time() - row.heartbeat_at < stale_s


def holder(store: Store, stale_s: float = STALE_S) -> Holder | None:
    """Who holds the lab's lease now (alive or not), or None."""
    create_schema(store.engine, [Lease.__table__])
    with store.session() as s:
        row = s.get(Lease, KEY)
    if row is None:
        return None
    return Holder(row.host, row.pid, row.acquired_at, row.heartbeat_at, _alive(row, stale_s))


def acquire(store: Store, owner: Owner, stale_s: float = STALE_S) -> Holder | None:
    """Take the lab's lease for `owner`; returns the dead holder taken over from, if any.

    Raises `UserError` (one line naming the holder) when a live driver holds it.
    """
    create_schema(store.engine, [Lease.__table__])
    for _ in range(5):
        t = time.time()
        with store.session() as s:
            row = s.get(Lease, KEY)
            if row is None:
                s.add(Lease(key=KEY, host=owner.host, pid=owner.pid, started=owner.started, acquired_at=t,
                            heartbeat_at=t))
                try:
                    s.commit()
                    return None
                except IntegrityError:  # another driver inserted it first: look again
                    s.rollback()
                    continue
            old = Holder(row.host, row.pid, row.acquired_at, row.heartbeat_at, _alive(row, stale_s))
            if Owner(row.host, row.pid, row.started).same(owner):
                return None  # ours already (a second Loop in this process)
            if old.alive:
                raise UserError(f"this lab is already driven by {old.describe()}; stop that `autoresearch run` "
                              "first (a second driver would decide the same hypotheses twice)")
            res = s.exec(update(Lease).where(  # type: ignore[call-overload]
                Lease.key == KEY, Lease.pid == row.pid, Lease.host == row.host,  # type: ignore[arg-type]
                Lease.heartbeat_at == row.heartbeat_at).values(  # type: ignore[arg-type]
                host=owner.host, pid=owner.pid, started=owner.started, acquired_at=t, heartbeat_at=t))
            if res.rowcount == 1:
                s.commit()
                return old
            s.rollback()  # someone else took it over in between: look again
    raise UserError("could not take this lab's driver lease (other drivers keep taking it); try again")


def refresh(store: Store, owner: Owner) -> bool:
    """The holder's heartbeat; False if the lease is no longer ours (taken over after we stalled)."""
    with store.session() as s:
        res = s.exec(update(Lease).where(  # type: ignore[call-overload]
            Lease.key == KEY, Lease.pid == owner.pid, Lease.host == owner.host).values(  # type: ignore[arg-type]
            heartbeat_at=time.time()))
        s.commit()
        return res.rowcount == 1


def release(store: Store, owner: Owner) -> None:
    with store.session() as s:
        s.exec(delete(Lease).where(Lease.key == KEY, Lease.pid == owner.pid,  # type: ignore[call-overload]
                                   Lease.host == owner.host))  # type: ignore[arg-type]
        s.commit()


class Heartbeat:
    """This process's one heartbeat: a thread whose every beat (each `every_s`) refreshes the lab's
    lease when the process holds it (`holds_lease`) and the heartbeat of every run `owner` claimed
    (`Store.heartbeat`). The loop starts one with its lease and hands it to its driver; a driver on
    its own (`python -m pipeline.runner`, the variance study) starts one for its runs. `on_lost` is
    called once if the lease was taken over by another driver (this one stalled past `stale_s`).
    A beat that fails (the database hiccuping) is logged, and the next one tries again."""

    def __init__(self, store: Store, owner: Owner, every_s: float = HEARTBEAT_S, *, holds_lease: bool = False,
                 on_lost: Callable[[], None] | None = None):
        self.store, self.owner, self.every_s = store, owner, every_s
        self.holds_lease = holds_lease
        self.on_lost = on_lost
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = False

    def start(self) -> Heartbeat:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="autoresearch-heartbeat", daemon=True)
            self._thread.start()
        return self

    def beat(self) -> None:
        """One beat: the lease (if held and not lost), then the runs."""
        if self.holds_lease and not self.lost and not refresh(self.store, self.owner):
            self.lost = True
            if self.on_lost is not None:
                self.on_lost()
        self.store.heartbeat(self.owner)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.beat()
            except Exception as e:  # a database hiccup must not kill the process; the next beat retries
                log.warning("heartbeat failed: %s", e)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
