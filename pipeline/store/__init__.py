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

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import MetaData, UniqueConstraint, event, inspect, literal, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError, DisconnectionError, IntegrityError, OperationalError
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
    MeasureEnv,
    Owner,
    Result,
    Run,
    RunStatus,
    StageExec,
    StageOutcome,
    StoreLab,
    now,
)

if TYPE_CHECKING:
    from pipeline.lab import Lab

log = logging.getLogger(__name__)


_SCHEMA_LOCK_KEY = 7_272_741  # PostgreSQL advisory lock: one process at a time creates tables


# columns a later version renamed: (table, old name) -> new name; the rows keep their values
RENAMED_COLUMNS = {("smoke_exec", "where"): "executor"}


def _upgrade(conn: Connection, tables: list[Any] | None) -> list[str]:
    """Bring tables an older version of the tool created up to this version's shape, keeping every row:
    - a column the code renamed since is renamed (`RENAMED_COLUMNS`);
    - a column the code has and the table lacks is added, with the code's scalar default as its SQL
      default, so the rows already there read that value (None where the code computes its default,
      as a timestamp's), and nullable;
    - a unique constraint the code no longer has is dropped (SQLite, which drops none, makes the
      table again: `_rebuild_sqlite`);
    - an index the code declares is made where missing (a new column's) or of the wrong kind (a
      unique index the code no longer wants unique is made again plain).
    A column the code does not know stays, unread; one that is NOT NULL with no default would refuse
    this version's every insert, and is a newer version's (ours drop none but those renamed): the
    store is refused in one line (`UserError`), never altered under that version. Nothing is retyped.
    Returns what it did, one phrase each, for the log."""
    inspector = inspect(conn)
    dialect = conn.dialect
    quote = dialect.identifier_preparer.quote
    done: list[str] = []
    wanted = tables if tables is not None else SQLModel.metadata.sorted_tables
    names = [t.name for t in wanted]
    existing = {name: cols for (_schema, name), cols in inspector.get_multi_columns(filter_names=names).items()}
    indexes = {name: ix for (_schema, name), ix in inspector.get_multi_indexes(filter_names=names).items()}
    constraints = {name: u for (_schema, name), u in
                   inspector.get_multi_unique_constraints(filter_names=names).items()}
    for table in wanted:  # first, before anything is changed: a newer version's store is left as it is
        renamed = {old for (tname, old) in RENAMED_COLUMNS if tname == table.name}
        newer = [c["name"] for c in existing.get(table.name, []) if c["name"] not in table.columns
                 and c["name"] not in renamed and not c["nullable"] and c.get("default") is None]
        if newer:
            raise UserError(f"the store's table {table.name} has {', '.join(newer)}, required and unknown to this "
                            "version of autoresearch: a newer version made it; use that version, or another database")
    for table in wanted:
        if table.name not in existing:
            continue
        qtable = dialect.identifier_preparer.format_table(table)
        have = {c["name"]: c for c in existing[table.name]}
        for (tname, old_name), new_name in RENAMED_COLUMNS.items():
            if tname == table.name and old_name in have and new_name not in have:
                conn.execute(text(f"ALTER TABLE {qtable} RENAME COLUMN {quote(old_name)} TO {quote(new_name)}"))
                have[new_name] = have.pop(old_name)
                done.append(f"renamed {table.name}.{old_name} to {new_name}")
        missing = [c for c in table.columns if c.name not in have]
        for col in missing:
            ddl = f"{quote(col.name)} {col.type.compile(dialect=dialect)}"
            default = col.default
            if default is not None and getattr(default, "is_scalar", False) and default.arg is not None:
                value = default.arg.value if isinstance(default.arg, Enum) else default.arg
                literal_sql = literal(value, col.type).compile(dialect=dialect, compile_kwargs={"literal_binds": True})
                ddl += f" DEFAULT {literal_sql}"
            conn.execute(text(f"ALTER TABLE {qtable} ADD COLUMN {ddl}"))
            done.append(f"added {table.name}.{col.name}")
        uniques = {frozenset(c.name for c in u.columns) for u in table.constraints if isinstance(u, UniqueConstraint)}
        uniques |= {frozenset(c.name for c in ix.columns) for ix in table.indexes if ix.unique}
        stale = [u for u in constraints.get(table.name, []) if frozenset(u["column_names"]) not in uniques]
        if stale and dialect.name == "sqlite":  # SQLite cannot drop a constraint: the table is made again
            rebuilt, what = _rebuild_sqlite(conn, table, [*have, *(c.name for c in missing)])
            done.append(what)
            if rebuilt:  # with every index the code declares
                continue
            stale = []
        for u in stale:
            conn.execute(text(f"ALTER TABLE {qtable} DROP CONSTRAINT {quote(u['name'])}"))
            done.append(f"dropped {table.name}'s unique constraint on {', '.join(u['column_names'])}")
        in_db = {ix["name"]: ix for ix in indexes.get(table.name, [])}
        for index in table.indexes:
            found = in_db.get(index.name)
            if found is not None and bool(found["unique"]) == bool(index.unique):
                continue
            if found is not None:
                conn.execute(text(f"DROP INDEX {dialect.identifier_preparer.format_index(index)}"))
            index.create(conn)
            done.append(f"{'remade' if found is not None else 'made'} index {index.name}")
    return done


def _rebuild_sqlite(conn: Connection, table: Any, have: list[str]) -> tuple[bool, str]:
    """Make a SQLite table again as the code declares it (SQLite alters no constraint in place), with
    every row of the columns both versions have: the new table under a scratch name, the rows copied,
    the old one dropped, the new one renamed, its indexes made; (whether it did, what it did). Not for
    a table other tables' foreign keys point at (dropping it would cascade to them), nor where the
    old rows do not fit: the table stays as it was, and the insert the constraint refuses with it."""
    if any(fk.column.table is table for other in SQLModel.metadata.tables.values() if other is not table
           for fk in other.foreign_keys):
        return False, f"left {table.name} as it was (other tables refer to it)"
    scratch = f"{table.name}__upgrade"
    meta = MetaData()
    for fk in table.foreign_keys:  # the tables its foreign keys name, for the copy's to resolve
        if fk.column.table.name not in meta.tables:
            fk.column.table.to_metadata(meta)
    copy = table.to_metadata(meta, name=scratch)
    for index in list(copy.indexes):
        copy.indexes.discard(index)
    common = ", ".join(f'"{c.name}"' for c in table.columns if c.name in have)
    try:
        with conn.begin_nested():  # all or nothing: rows an older version left NULL may not fit
            copy.create(conn)
            conn.execute(text(f'INSERT INTO "{scratch}" ({common}) SELECT {common} FROM "{table.name}"'))
            conn.execute(text(f'DROP TABLE "{table.name}"'))
            conn.execute(text(f'ALTER TABLE "{scratch}" RENAME TO "{table.name}"'))
            for index in table.indexes:
                index.create(conn)
    except DBAPIError as e:
        return False, f"left {table.name} as it was (its rows do not fit this version's: {str(e.orig).strip()[:120]})"
    return True, f"made {table.name} again (a unique constraint this version no longer has)"


def create_schema(engine: Engine, tables: list[Any] | None = None) -> None:
    """Create the missing tables (all registered ones, or `tables`) and add the columns a table made
    by an older version of the tool lacks (`_upgrade`), safely when several processes start at the
    same instant: under an advisory lock on PostgreSQL, a file lock beside a SQLite file. An
    unreachable database is `InfrastructureFailure`, an upgrade the database refuses `UserError`:
    one line each, not a traceback. What the upgrade did is logged once it is committed."""
    where = engine.url.render_as_string(hide_password=True)
    done: list[str] = []

    def build(conn: Connection) -> None:
        SQLModel.metadata.create_all(conn, tables=tables)
        try:
            done.extend(_upgrade(conn, tables))
        except DBAPIError as e:
            reason = str(e.orig).strip().splitlines()[0] if e.orig else str(e)
            raise UserError(f"the store at {where} could not be brought up to this version: {reason}") from None

    try:
        if engine.dialect.name == "postgresql":
            with engine.begin() as conn:
                # a session idle inside a transaction on these tables must not hang every open
                conn.execute(text("SET LOCAL lock_timeout = '60s'"))
                conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _SCHEMA_LOCK_KEY})
                build(conn)
        else:
            path = engine.url.database
            if not path or path == ":memory:":
                with engine.begin() as conn:
                    build(conn)
            else:
                import fcntl

                with open(f"{path}.schema-lock", "a") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX)
                    with engine.begin() as conn:
                        build(conn)
    except OperationalError as e:
        raise InfrastructureFailure(f"cannot reach the store at {where}: "
                                    f"{str(e.orig).strip().splitlines()[0] if e.orig else e}") from None
    if done:
        log.warning("store upgraded to this version: %s", "; ".join(done))


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
        self.url, self.schema = url, schema
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
        """The store of `lab` at `url` (default: SQLite in its `runs/`). A store that holds another
        lab's state (a database given to two labs) is refused in one line (`UserError`)."""
        store = cls(url or default_url(lab))
        try:
            store.claim_lab(lab)
        except BaseException:
            store.dispose()
            raise
        return store

    def claim_lab(self, lab: "Lab") -> None:
        """Record `lab` as the store's lab on first use; refuse one whose history does not hold the
        first commit recorded (another lab, not a clone or a move of it). A lab whose first commit
        cannot be known (a shallow clone) is neither recorded nor refused. Labs that share a history
        (two made in one repository) are one lab to this check."""
        from pipeline.labrepo import in_history, root_commits

        roots = root_commits(lab.root)
        if roots is None:
            return
        for _ in range(5):
            with self.session() as s:
                row = s.get(StoreLab, 1)
                if row is None:
                    s.add(StoreLab(root_commit=min(roots), name=lab.root.name, path=str(lab.root)))
                    try:
                        s.commit()
                        return
                    except IntegrityError:  # another process claimed it at the same instant: read it
                        continue
            if row.root_commit in roots or in_history(lab.root, row.root_commit):
                return
            where = self.engine.url.render_as_string(hide_password=True)
            raise UserError(f"the store {where} holds the state of another lab ({row.name!r} at {row.path}, "
                            f"first commit {row.root_commit[:10]}), not of {lab.root}: give each lab its own "
                            "database (--db or AUTORESEARCH_DB)")
        raise InfrastructureFailure(f"could not record the lab of the store at {self.engine.url.render_as_string(hide_password=True)}: claimed and gone 5 times")

    @contextmanager
    def session(self) -> Iterator[Session]:
        with Session(self.engine, expire_on_commit=False) as s:
            yield s

    def dispose(self) -> None:
        self.engine.dispose()
