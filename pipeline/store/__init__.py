"""The store: every fact about runs in one SQL database (SQLite by default, any SQLAlchemy URL).

Why a database and not files: runs are claimed by concurrent drivers, must survive `kill -9` of any
of them, and are read by `status`, `report` and the gate while a batch is running. The tables are
sqlmodel classes, so the same class is a row and the record that `--json` output prints.

The package: `tables` (the rows, listed there, and value types), `queue` (enqueue, claim,
heartbeat, finish, release, reconcile), `cache` (stage executions and the cache's rows), `reads`
(results, comparisons, holdout scores, goodput, gate records); `Store` here is all of them over
one engine.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import event, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DisconnectionError, OperationalError
from sqlmodel import Session, SQLModel, create_engine

from pipeline.errors import InfrastructureFailure, UserError
from pipeline.store.cache import CacheRows
from pipeline.store.queue import Queue
from pipeline.store.reads import Reads
from pipeline.store.tables import (  # noqa: F401 (re-exported: `from pipeline.store import Run` works)
    METHOD_OUTCOMES,
    Arm,
    BaselineCommit,
    CacheEntry,
    CacheUse,
    Claim,
    Comparison,
    GateRecord,
    Goodput,
    HoldoutScore,
    Owner,
    Result,
    Run,
    RunStatus,
    StageExec,
    StageOutcome,
    now,
)

if TYPE_CHECKING:
    from pipeline.lab import Lab


_SCHEMA_LOCK_KEY = 7_272_741  # PostgreSQL advisory lock: one process at a time creates tables


def create_schema(engine: Engine, tables: list[Any] | None = None) -> None:
    """Create the missing tables (all registered ones, or `tables`), safely when several processes
    start at the same instant: under an advisory lock on PostgreSQL, a file lock beside a SQLite
    file. An unreachable database is `InfrastructureFailure`: one line, not a traceback."""
    try:
        if engine.dialect.name == "postgresql":
            with engine.begin() as conn:
                conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _SCHEMA_LOCK_KEY})
                SQLModel.metadata.create_all(conn, tables=tables)
            return
        path = engine.url.database
        if not path or path == ":memory:":
            SQLModel.metadata.create_all(engine, tables=tables)
            return
        import fcntl

        with open(f"{path}.schema-lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            SQLModel.metadata.create_all(engine, tables=tables)
    except OperationalError as e:
        raise InfrastructureFailure(f"cannot reach the store at {engine.url.render_as_string(hide_password=True)}: "
                               f"{str(e.orig).strip().splitlines()[0] if e.orig else e}") from None


def default_url(lab: "Lab") -> str:
    return f"sqlite:///{lab.state / 'autoresearch.db'}"


IDLE_PING_S = 10.0  # a pooled server connection unused this long is pinged before it is handed out


def _ping_if_idle(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
    """Pessimistic disconnect handling, only where it can matter: a connection that sat in the pool
    past IDLE_PING_S (the server may have restarted or dropped it meanwhile) is pinged first, and a
    dead one is replaced (`DisconnectionError`: the pool retries with a new connection). One reused
    within seconds, as the driver's are under load, is not: SQLAlchemy's `pool_pre_ping` would ping
    at every checkout, a round trip for each of the driver's store calls."""
    last = record.info.get("checked_in_at")
    if last is not None and time.monotonic() - last < IDLE_PING_S:
        return
    try:
        cur = dbapi_conn.cursor()
        try:
            cur.execute("SELECT 1")
        finally:
            cur.close()
    except Exception as e:
        raise DisconnectionError(str(e)) from None


def _mark_checkin(_dbapi_conn: Any, record: Any) -> None:
    record.info["checked_in_at"] = time.monotonic()


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")  # readers (status) never block the driver
    cur.execute("PRAGMA busy_timeout=30000")  # concurrent drivers wait instead of failing
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


class Store(Queue, CacheRows, Reads):
    """A handle on the database. Cheap to create; safe to use from several threads and processes.

    Its methods are grouped by what they touch: the queue (`pipeline.store.queue`), the cache's
    and stage executions' rows (`pipeline.store.cache`), the reads and gate records
    (`pipeline.store.reads`); the tables are in `pipeline.store.tables`."""

    def __init__(self, url: str, *, schema: str | None = None, create: bool = True):
        self.url = url
        kwargs: dict[str, Any] = {}
        if url.startswith("sqlite"):
            path = url.split("///", 1)[-1]
            if path and path != ":memory:":
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
        elif schema:
            kwargs["connect_args"] = {"options": f"-csearch_path={schema}"}

        try:
            self.engine: Engine = create_engine(url, **kwargs)
        except Exception as e:  # a malformed URL or a missing driver
            raise UserError(f"cannot open store {url!r}: {e}") from None
        if url.startswith("sqlite"):
            event.listen(self.engine, "connect", _sqlite_pragmas)
        else:  # a server's connection is pinged when it sat idle in the pool, not at every checkout
            event.listen(self.engine, "checkout", _ping_if_idle)
            event.listen(self.engine, "checkin", _mark_checkin)
        if create:
            create_schema(self.engine)

    @classmethod
    def for_lab(cls, lab: "Lab", url: str | None = None) -> "Store":
        return cls(url or default_url(lab))

    @contextmanager
    def session(self) -> Iterator[Session]:
        with Session(self.engine, expire_on_commit=False) as s:
            yield s

    def dispose(self) -> None:
        self.engine.dispose()
