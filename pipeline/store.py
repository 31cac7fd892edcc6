"""The store: every fact about runs in one SQL database (SQLite by default, any SQLAlchemy URL).

Why a database and not files: runs are claimed by concurrent drivers, must survive `kill -9` of any
of them, and are read by `status`, `report` and the gate while a batch is running. The tables are
sqlmodel classes, so the same class is a row and the record that `--json` output prints.

- `Arm`: a commit under measurement (baseline or challenger).
- `Run`: one (commit, task, seed), unique; also the queue: `status` moves queued → running →
  done | failed, claimed atomically by a conditional UPDATE that carries an owner (host, pid, process
  start time) and a claim token. Only the holder of the current token can finish or requeue it, so a
  driver presumed dead that wakes up cannot write a second result.
- `StageExec`: one stage of one run, executed or served from the cache: CPU, GPU and wall seconds,
  outcome. Goodput is computed from these rows.
- `Result`: the run's metric, or the reason it has none; unique per run and per (commit, task, seed).
- `CacheEntry`: what a cached stage output cost to compute, so a cache hit knows what it saved.
- `GateRecord`: the gate's records (any JSON payload) keyed by hypothesis, look and kind.

Times are UNIX seconds (floats): comparable across SQLite and PostgreSQL and plain in JSON.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from sqlalchemy import JSON, Column, UniqueConstraint, event, func, text, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlmodel import Field, Session, SQLModel, create_engine, select

from pipeline.errors import InfrastructureFailure, ServiceUnavailable, UserError

if TYPE_CHECKING:
    from pipeline.lab import Lab

RunStatus = Literal["queued", "running", "done", "failed"]
# running: launched, not finished; ok: executed and published; cache_hit: output existed already;
# shared: waited on the same key computed for another run in this batch; method/timeout: the branch's
# code failed (a result the gate sees); infra: the machinery failed (retried); lost: the driver died
# while it ran; cancelled: a graceful stop; upstream_failed: a stage it needs failed.
StageOutcome = Literal[
    "running", "ok", "cache_hit", "shared", "method", "timeout", "infra", "lost", "cancelled", "upstream_failed"
]
METHOD_OUTCOMES = ("method", "timeout")


def now() -> float:
    return time.time()


class Arm(SQLModel, table=True):
    """A commit under measurement. `label` is a human name (branch or tag) at the time it was queued."""

    __tablename__ = "arm"
    commit: str = Field(primary_key=True, max_length=64)
    label: str | None = None
    created_at: float = Field(default_factory=now)


class Run(SQLModel, table=True):
    """One (commit, task, seed) measurement and its place in the queue."""

    __tablename__ = "run"
    __table_args__ = (UniqueConstraint("commit", "task", "seed", name="uq_run_commit_task_seed"),)
    id: int | None = Field(default=None, primary_key=True)
    commit: str = Field(foreign_key="arm.commit", index=True, max_length=64)
    task: str
    seed: int
    status: str = Field(default="queued", index=True)
    priority: int = 0
    infra_failures: int = 0  # stage attempts lost to the machinery, retried with the same seed
    requeues: int = 0  # times a dead driver's claim was taken back
    owner_host: str | None = None
    owner_pid: int | None = None
    owner_started: float | None = None
    claim_token: str | None = None
    heartbeat_at: float | None = None
    queued_at: float = Field(default_factory=now)
    started_at: float | None = None
    finished_at: float | None = None
    dataset_id: str | None = None


class StageExec(SQLModel, table=True):
    """One stage of one run: executed, served from the cache, or failed; with the compute it used."""

    __tablename__ = "stage_exec"
    id: int | None = Field(default=None, primary_key=True)
    run_id: int = Field(foreign_key="run.id", index=True)
    stage: str
    key: str = Field(index=True)
    outcome: str = "running"
    executor: str = "local"
    host: str | None = None
    cpu_s: float = 0.0
    gpu_s: float = 0.0
    wall_s: float = 0.0
    saved_cpu_s: float = 0.0  # for cache_hit/shared: the compute the original execution took
    exit_code: int | None = None
    signal: int | None = None
    detail: str | None = None
    log_path: str | None = None
    started_at: float = Field(default_factory=now)
    finished_at: float | None = None


class Result(SQLModel, table=True):
    """A run's metric (`value`), or why it has none (`outcome`, `kind`, `detail`). Written once."""

    __tablename__ = "result"
    __table_args__ = (UniqueConstraint("commit", "task", "seed", name="uq_result_commit_task_seed"),)
    id: int | None = Field(default=None, primary_key=True)
    run_id: int = Field(foreign_key="run.id", unique=True)
    commit: str = Field(index=True, max_length=64)
    task: str
    seed: int
    value: float | None = None
    outcome: str = "ok"
    kind: str | None = None  # crash, timeout, signal, predictions, nan, memory, infra
    detail: str | None = None
    dataset_id: str | None = None
    cpu_s: float = 0.0  # compute executed for this run (cache hits excluded)
    created_at: float = Field(default_factory=now)


class BaselineCommit(SQLModel, table=True):
    """A commit measured as a baseline (its own runs, re-verification, variance study): only its runs
    are scored on a harness's sealed holdout."""

    __tablename__ = "baseline_commit"
    commit: str = Field(primary_key=True, max_length=64)
    marked_at: float = Field(default_factory=now)


class Comparison(SQLModel, table=True):
    """A challenger commit measured against a baseline commit on the baseline's seed block: the
    lab's history of paired differences (the `paired` protocol's prior, `variance --pair`)."""

    challenger: str = Field(primary_key=True, max_length=64)
    baseline: str = Field(primary_key=True, max_length=64)
    created_at: float = Field(default_factory=now)


class HoldoutScore(SQLModel, table=True):
    """A baseline run's score on the sealed holdout split (`Harness` in harness/base.py). Only the runs of commits in
    `baseline_commit` (the first baseline, the champions) are scored on it; it is read by status,
    the digest and the progress chart, never by the gate, the agent or a prompt."""

    __tablename__ = "holdout_score"
    run_id: int = Field(foreign_key="run.id", primary_key=True)
    commit: str = Field(index=True, max_length=64)
    task: str
    seed: int
    value: float
    created_at: float = Field(default_factory=now)


class CacheEntry(SQLModel, table=True):
    """A published stage output: what it cost, so later hits can count the compute they saved."""

    __tablename__ = "cache_entry"
    key: str = Field(primary_key=True)
    stage: str
    commit: str
    cpu_s: float = 0.0
    wall_s: float = 0.0
    created_at: float = Field(default_factory=now)


class CacheUse(SQLModel, table=True):
    """A cache entry's size on disk and when it was last used: what LRU eviction reads."""

    __tablename__ = "cache_use"
    key: str = Field(primary_key=True)
    size_bytes: int = 0
    used_at: float = Field(default_factory=now, index=True)
    evicted_at: float | None = None


class GateRecord(SQLModel, table=True):
    """The gate's output at one look of one hypothesis; `payload` is the gate's own JSON record."""

    __tablename__ = "gate_record"
    __table_args__ = (UniqueConstraint("hypothesis", "look", "kind", name="uq_gate_record"),)
    id: int | None = Field(default=None, primary_key=True)
    hypothesis: str = Field(index=True)
    look: int
    kind: str = "verdict"
    payload: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    created_at: float = Field(default_factory=now)


@dataclass(frozen=True)
class Owner:
    """Who holds a claim: enough to tell, from the same host, whether that process still exists.

    The process start time guards against a recycled pid looking alive.
    """

    host: str
    pid: int
    started: float

    @classmethod
    def current(cls) -> "Owner":
        import psutil

        return cls(socket.gethostname(), os.getpid(), psutil.Process().create_time())

    def same(self, other: "Owner | None") -> bool:
        return other is not None and (self.host, self.pid) == (other.host, other.pid) and abs(
            self.started - other.started) < 1.0

    def alive(self) -> bool | None:
        """True/False on this host; None when the owner is on another host (use the heartbeat)."""
        if self.host != socket.gethostname():
            return None
        import psutil

        try:
            proc = psutil.Process(self.pid)
            return abs(proc.create_time() - self.started) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False


@dataclass(frozen=True)
class Claim:
    """A claimed run: its row as it was claimed and the token that proves ownership."""

    run: Run
    token: str


@dataclass(frozen=True)
class Goodput:
    """Where the compute went. Seconds are CPU seconds unless named otherwise.

    useful: stages that ran to completion (their outputs are cached and feed results);
    method_failed: stages whose branch code failed (the measurement of a bad idea; not waste of the
    machinery but not progress either); infra_lost: attempts lost to the machinery (killed workers,
    dead drivers) that had to be retried; saved_by_cache: what cache hits would have cost.
    """

    useful_cpu_s: float
    method_failed_cpu_s: float
    infra_lost_cpu_s: float
    saved_by_cache_cpu_s: float
    gpu_s: float
    stages_executed: int
    cache_hits: int
    infra_retries: int
    requeues: int

    @property
    def goodput(self) -> float:
        """Fraction of spent compute that was useful (1.0 when nothing ran)."""
        spent = self.useful_cpu_s + self.method_failed_cpu_s + self.infra_lost_cpu_s
        return self.useful_cpu_s / spent if spent > 0 else 1.0

    def as_dict(self) -> dict[str, float | int]:
        out: dict[str, float | int] = dict(self.__dict__)
        out["goodput"] = self.goodput
        return out


_SCHEMA_LOCK_KEY = 7_272_741  # PostgreSQL advisory lock: one process at a time creates tables


def create_schema(engine: Engine, tables: list[Any] | None = None) -> None:
    """Create the missing tables (all registered ones, or `tables`), safely when several processes
    start at the same instant: under an advisory lock on PostgreSQL, a file lock beside a SQLite
    file. An unreachable database is `ServiceUnavailable`: one line, not a traceback."""
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
        raise ServiceUnavailable(f"cannot reach the store at {engine.url.render_as_string(hide_password=True)}: "
                               f"{str(e.orig).strip().splitlines()[0] if e.orig else e}") from None


def default_url(lab: "Lab") -> str:
    return f"sqlite:///{lab.state / 'autoresearch.db'}"


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")  # readers (status) never block the driver
    cur.execute("PRAGMA busy_timeout=30000")  # concurrent drivers wait instead of failing
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


class Store:
    """A handle on the database. Cheap to create; safe to use from several threads and processes."""

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
        if not url.startswith("sqlite"):
            kwargs["pool_pre_ping"] = True
        try:
            self.engine: Engine = create_engine(url, **kwargs)
        except Exception as e:  # a malformed URL or a missing driver
            raise UserError(f"cannot open store {url!r}: {e}") from None
        if url.startswith("sqlite"):
            event.listen(self.engine, "connect", _sqlite_pragmas)
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

    # --- queue --------------------------------------------------------------------------------

    def ensure_arm(self, commit: str, label: str | None = None) -> None:
        with self.session() as s:
            if s.get(Arm, commit) is None:
                s.add(Arm(commit=commit, label=label))
                try:
                    s.commit()
                except IntegrityError:  # another process added it between our read and write
                    s.rollback()

    def enqueue(self, commit: str, pairs: Iterable[tuple[str, int]], priority: int = 0) -> list[int]:
        """Queue (task, seed) runs of `commit` unless they exist; return every run id, in order.

        Idempotent: the agent may call it again after a crash without creating duplicates. A run
        that exists and is still queued has its priority raised to `priority` if that is higher
        (a baseline run a deeper look now waits for goes ahead with that look's runs); never lowered.
        One read of the commit's runs and one transaction for the new ones, whatever the count.
        """
        pairs = [(t, int(seed)) for t, seed in pairs]
        with self.session() as s:
            known = self._run_ids(s, commit)
            missing = [p for p in dict.fromkeys(pairs) if p not in known]
            if missing:
                s.add_all([Run(commit=commit, task=t, seed=seed, priority=priority) for t, seed in missing])
                try:
                    s.commit()
                except IntegrityError:  # another driver queued some of them meanwhile: theirs stand
                    s.rollback()
                    for t, seed in missing:
                        s.add(Run(commit=commit, task=t, seed=seed, priority=priority))
                        try:
                            s.commit()
                        except IntegrityError:
                            s.rollback()
                known = self._run_ids(s, commit)
            ids = [known[p] for p in pairs]
            raise_ids = [i for p, i in zip(pairs, ids) if p not in missing]
            if raise_ids and priority:
                s.exec(update(Run).where(Run.id.in_(raise_ids), Run.status == "queued",  # type: ignore[call-overload,union-attr]
                                         Run.priority < priority).values(priority=priority))  # type: ignore[operator]
                s.commit()
        return ids

    @staticmethod
    def _run_ids(s: Session, commit: str) -> dict[tuple[str, int], int]:
        rows = s.exec(select(Run.task, Run.seed, Run.id).where(Run.commit == commit)).all()  # type: ignore[call-overload]
        return {(t, int(seed)): int(i) for t, seed, i in rows}

    def claim(self, owner: Owner, limit: int = 1, commits: Iterable[str] | None = None) -> list[Claim]:
        """Atomically take up to `limit` queued runs (highest priority, then oldest).

        A conditional UPDATE (`WHERE status = 'queued'`) is the lock: of two drivers racing for the
        same row exactly one sees rowcount 1. Works the same on SQLite and PostgreSQL.
        """
        claims: list[Claim] = []
        with self.session() as s:
            q = select(Run.id).where(Run.status == "queued").order_by(Run.priority.desc(), Run.id)  # type: ignore[attr-defined]
            if commits is not None:
                q = q.where(Run.commit.in_(list(commits)))  # type: ignore[attr-defined]
            candidates = list(s.exec(q.limit(limit * 4 + 4)))
            for run_id in candidates:
                if len(claims) >= limit:
                    break
                token = uuid.uuid4().hex
                t = now()
                res = s.exec(  # type: ignore[call-overload]
                    update(Run)
                    .where(Run.id == run_id, Run.status == "queued")  # type: ignore[arg-type]
                    .values(
                        status="running", owner_host=owner.host, owner_pid=owner.pid,
                        owner_started=owner.started, claim_token=token, heartbeat_at=t, started_at=t,
                    )
                )
                s.commit()
                if res.rowcount == 1:
                    run = s.get(Run, run_id)  # not loaded in this session before: read as just updated
                    assert run is not None and run.claim_token == token
                    claims.append(Claim(run, token))
        return claims

    def heartbeat(self, owner: Owner) -> int:
        """Refresh every claim this process holds; a driver on another host reads staleness from it."""
        with self.session() as s:
            res = s.exec(  # type: ignore[call-overload]
                update(Run)
                .where(Run.status == "running", Run.owner_host == owner.host, Run.owner_pid == owner.pid)  # type: ignore[arg-type]
                .values(heartbeat_at=now())
            )
            s.commit()
            return int(res.rowcount)

    def set_dataset(self, run_id: int, token: str, dataset_id: str) -> None:
        with self.session() as s:
            s.exec(  # type: ignore[call-overload]
                update(Run).where(Run.id == run_id, Run.claim_token == token).values(dataset_id=dataset_id)  # type: ignore[arg-type]
            )
            s.commit()

    def note_infra_failure(self, run_id: int) -> None:
        with self.session() as s:
            s.exec(  # type: ignore[call-overload]
                update(Run).where(Run.id == run_id).values(infra_failures=Run.infra_failures + 1)  # type: ignore[arg-type]
            )
            s.commit()

    def finish(self, claim: Claim, result: Result, status: RunStatus = "done") -> bool:
        """Write the run's result and close its claim in one transaction.

        Returns False (and writes nothing) when the claim is no longer ours: the run was taken back
        after our heartbeat went stale, or a result already exists. That is how a result is counted
        exactly once even if two drivers believed they owned the run.
        """
        with self.session() as s:
            res = s.exec(  # type: ignore[call-overload]
                update(Run)
                .where(Run.id == claim.run.id, Run.claim_token == claim.token, Run.status == "running")  # type: ignore[arg-type]
                .values(status=status, finished_at=now(), claim_token=None)
            )
            if res.rowcount != 1:
                s.rollback()
                return False
            s.add(result)
            try:
                s.commit()
            except IntegrityError:
                s.rollback()
                return False
            return True

    def release(self, claim: Claim, *, count_requeue: bool) -> bool:
        """Give a claimed run back to the queue (graceful stop, or a retry after lost ownership)."""
        with self.session() as s:
            values: dict[str, Any] = dict(
                status="queued", owner_host=None, owner_pid=None, owner_started=None, claim_token=None
            )
            if count_requeue:
                values["requeues"] = Run.requeues + 1
            res = s.exec(  # type: ignore[call-overload]
                update(Run).where(Run.id == claim.run.id, Run.claim_token == claim.token).values(**values)  # type: ignore[arg-type]
            )
            s.commit()
            return res.rowcount == 1

    def reconcile(self, stale_s: float = 120.0, *, max_requeues: int = 5, reclaim: Owner | None = None,
                  heartbeat_s: float = 5.0) -> list[int]:
        """Take back runs left "running" by a dead driver: re-queue them under the same key.

        Dead means: on this host, the owner process is gone (or its pid was recycled); on another
        host, its heartbeat is older than `stale_s`. Their unfinished stage executions become
        "lost", counted as compute lost to infrastructure from their start to the driver's death: at
        most the first heartbeat it missed (`heartbeat_s` after its last), which is the figure kept.
        A run lost more than `max_requeues`
        times is failed as an infrastructure failure instead of looping forever (a stage that
        takes the whole machine down with it). `reclaim` names a live owner whose claims are
        known to be orphaned too: a new driver in the process of one that failed without closing.
        """
        requeued: list[int] = []
        t = now()
        with self.session() as s:
            running = list(s.exec(select(Run).where(Run.status == "running")))
        for run in running:
            owner = Owner(run.owner_host or "", run.owner_pid or -1, run.owner_started or 0.0)
            alive = False if owner.same(reclaim) else owner.alive()
            if alive is None:
                alive = (t - (run.heartbeat_at or 0.0)) < stale_s
            if alive:
                continue
            with self.session() as s:
                lost_execs = list(
                    s.exec(select(StageExec).where(StageExec.run_id == run.id, StageExec.outcome == "running"))
                )
                for ex in lost_execs:
                    ex.outcome = "lost"
                    # the driver died between its last heartbeat and the one it missed: the stage's
                    # work is lost up to then (never past now); a core kept busy all along
                    last = run.heartbeat_at or ex.started_at
                    ex.finished_at = max(ex.started_at, min(t, max(last, ex.started_at) + heartbeat_s))
                    ex.wall_s = ex.finished_at - ex.started_at
                    ex.cpu_s = ex.wall_s
                    lo = max(0.0, last - ex.started_at)
                    ex.detail = (f"driver {owner.host}:{owner.pid} died: {lo:.1f}-{ex.wall_s:.1f} s of work lost "
                                 "(between its last heartbeat and the one it missed; cpu_s = the upper bound)")
                    s.add(ex)
                giving_up = run.requeues + 1 > max_requeues
                values: dict[str, Any] = dict(
                    owner_host=None, owner_pid=None, owner_started=None, claim_token=None,
                    requeues=Run.requeues + 1,
                )
                if giving_up:
                    values.update(status="failed", finished_at=t)
                else:
                    values.update(status="queued")
                res = s.exec(  # type: ignore[call-overload]
                    update(Run)
                    .where(Run.id == run.id, Run.claim_token == run.claim_token, Run.status == "running")  # type: ignore[arg-type]
                    .values(**values)
                )
                if res.rowcount != 1:
                    s.rollback()
                    continue
                if giving_up:
                    s.add(Result(
                        run_id=run.id, commit=run.commit, task=run.task, seed=run.seed, outcome="infra_failure",
                        kind="lost", detail=f"driver died {run.requeues + 1} times while running it",
                        dataset_id=run.dataset_id,
                    ))
                try:
                    s.commit()
                except IntegrityError:
                    s.rollback()
                    continue
                if not giving_up:
                    requeued.append(int(run.id))  # type: ignore[arg-type]
        return requeued

    # --- stage executions and cache ---------------------------------------------------------

    def stage_started(self, run_id: int, stage: str, key: str, *, executor: str, log_path: str | None) -> int:
        with self.session() as s:
            ex = StageExec(run_id=run_id, stage=stage, key=key, executor=executor, host=socket.gethostname(),
                           log_path=log_path)
            s.add(ex)
            s.commit()
            return int(ex.id)  # type: ignore[arg-type]

    def stage_finished(self, exec_id: int, outcome: StageOutcome, **fields: Any) -> None:
        with self.session() as s:
            ex = s.get(StageExec, exec_id)
            if ex is None:
                raise InfrastructureFailure(f"stage execution {exec_id} does not exist")
            ex.outcome = outcome
            ex.finished_at = now()
            for k, v in fields.items():
                setattr(ex, k, v)
            s.add(ex)
            s.commit()

    def stage_served(self, run_id: int, stage: str, key: str, outcome: StageOutcome, *, executor: str,
                     saved_cpu_s: float = 0.0, detail: str | None = None) -> None:
        """Record a stage that did not execute for this run: a cache hit, shared, or upstream failure."""
        with self.session() as s:
            t = now()
            s.add(StageExec(run_id=run_id, stage=stage, key=key, outcome=outcome, executor=executor,
                            host=socket.gethostname(), saved_cpu_s=saved_cpu_s, detail=detail,
                            started_at=t, finished_at=t))
            s.commit()

    def cache_published(self, key: str, stage: str, commit: str, cpu_s: float, wall_s: float) -> None:
        with self.session() as s:
            if s.get(CacheEntry, key) is None:
                s.add(CacheEntry(key=key, stage=stage, commit=commit, cpu_s=cpu_s, wall_s=wall_s))
                try:
                    s.commit()
                except IntegrityError:
                    s.rollback()

    def cache_touch(self, key: str, size_bytes: int | None = None, used_at: float | None = None) -> None:
        """Note a use of a cache entry (a hit, or its publication with its size)."""
        t = used_at if used_at is not None else now()
        with self.session() as s:
            row = s.get(CacheUse, key)
            if row is None:
                row = CacheUse(key=key, size_bytes=size_bytes or 0, used_at=t)
            else:
                row.used_at = max(row.used_at, t)
                if size_bytes is not None:
                    row.size_bytes, row.evicted_at = size_bytes, None
            s.add(row)
            try:
                s.commit()
            except IntegrityError:
                s.rollback()

    def cache_uses(self) -> list[CacheUse]:
        """The entries on disk, least recently used first."""
        with self.session() as s:
            return list(s.exec(select(CacheUse).where(CacheUse.evicted_at.is_(None))  # type: ignore[union-attr]
                               .order_by(CacheUse.used_at)))

    def cache_bytes(self) -> int:
        """The size of the entries on disk (one aggregate: checked after every publication)."""
        with self.session() as s:
            q = select(func.coalesce(func.sum(CacheUse.size_bytes), 0)).where(
                CacheUse.evicted_at.is_(None))  # type: ignore[union-attr]
            return int(s.exec(q).one())

    def cache_evicted(self, key: str) -> None:
        with self.session() as s:
            row = s.get(CacheUse, key)
            if row is not None:
                row.evicted_at = now()
                s.add(row)
                s.commit()

    def keys_of(self, commits: Iterable[str]) -> set[str]:
        """Every stage key the runs of these commits used (executed, shared or served)."""
        commits = list(commits)
        if not commits:
            return set()
        with self.session() as s:
            q = select(StageExec.key).join(Run, Run.id == StageExec.run_id).where(  # type: ignore[arg-type]
                Run.commit.in_(commits))  # type: ignore[attr-defined]
            return set(s.exec(q))

    def commits_in_flight(self) -> set[str]:
        """Commits with runs queued or running."""
        with self.session() as s:
            q = select(Run.commit).where(Run.status.in_(("queued", "running"))).distinct()  # type: ignore[attr-defined]
            return set(s.exec(q))

    def cache_cost(self, key: str) -> float:
        with self.session() as s:
            entry = s.get(CacheEntry, key)
            return entry.cpu_s if entry else 0.0

    def method_failure_of(self, key: str) -> StageExec | None:
        """A recorded method failure for this stage key: the same inputs fail the same way, so a
        stage that failed in branch code is not re-executed for every run that needs it."""
        with self.session() as s:
            return s.exec(
                select(StageExec)
                .where(StageExec.key == key, StageExec.outcome.in_(METHOD_OUTCOMES))  # type: ignore[attr-defined]
                .order_by(StageExec.id)
            ).first()

    # --- reads ------------------------------------------------------------------------------

    def runs(self, ids: Iterable[int] | None = None, commit: str | None = None) -> list[Run]:
        with self.session() as s:
            q = select(Run).order_by(Run.id)
            if ids is not None:
                q = q.where(Run.id.in_(list(ids)))  # type: ignore[union-attr]
            if commit is not None:
                q = q.where(Run.commit == commit)
            return list(s.exec(q))

    def count_unfinished(self, ids: Iterable[int]) -> int:
        """How many of these runs are still queued or running (cheap enough to ask every turn)."""
        with self.session() as s:
            q = select(func.count()).select_from(Run).where(
                Run.id.in_(list(ids)), Run.status.in_(("queued", "running"))  # type: ignore[union-attr,attr-defined]
            )
            return int(s.exec(q).one())  # type: ignore[call-overload]

    def count_queued(self) -> int:
        with self.session() as s:
            return int(s.exec(select(func.count()).select_from(Run).where(Run.status == "queued")).one())  # type: ignore[call-overload]

    def results_for(self, commit: str, tasks: Iterable[str] | None = None) -> list[Result]:
        with self.session() as s:
            q = select(Result).where(Result.commit == commit).order_by(Result.task, Result.seed)
            if tasks is not None:
                q = q.where(Result.task.in_(list(tasks)))  # type: ignore[attr-defined]
            return list(s.exec(q))

    def mark_baseline(self, commit: str) -> None:
        with self.session() as s:
            if s.get(BaselineCommit, commit) is None:
                s.add(BaselineCommit(commit=commit))
                try:
                    s.commit()
                except IntegrityError:  # another driver marked it first
                    s.rollback()

    def mark_comparison(self, challenger: str, baseline: str) -> None:
        with self.session() as s:
            if s.get(Comparison, (challenger, baseline)) is None:
                s.add(Comparison(challenger=challenger, baseline=baseline))
                try:
                    s.commit()
                except IntegrityError:  # another driver recorded it first
                    s.rollback()

    def comparisons(self) -> list[tuple[str, str]]:
        """(challenger, baseline) of every comparison, oldest first."""
        return [(c, b) for c, b, _ in self.comparisons_timed()]

    def comparisons_timed(self) -> list[tuple[str, str, float]]:
        """(challenger, baseline, when it was first recorded) of every comparison, oldest first."""
        with self.session() as s:
            return [(c.challenger, c.baseline, c.created_at)
                    for c in s.exec(select(Comparison).order_by(Comparison.created_at))]

    def results_of(self, commits: Iterable[str], tasks: Iterable[str] | None = None) -> list[Result]:
        """Every result row of several commits in one read."""
        commits = list(commits)
        if not commits:
            return []
        with self.session() as s:
            q = select(Result).where(Result.commit.in_(commits))  # type: ignore[attr-defined]
            if tasks is not None:
                q = q.where(Result.task.in_(list(tasks)))  # type: ignore[attr-defined]
            return list(s.exec(q))

    def is_baseline(self, commit: str) -> bool:
        with self.session() as s:
            return s.get(BaselineCommit, commit) is not None

    def holdout_put(self, run_id: int, commit: str, task: str, seed: int, value: float) -> None:
        with self.session() as s:
            if s.get(HoldoutScore, run_id) is None:
                s.add(HoldoutScore(run_id=run_id, commit=commit, task=task, seed=seed, value=value))
                s.commit()

    def holdout_scores(self, commit: str) -> dict[str, dict[int, float]]:
        """{task: {seed: holdout score}} of a commit's holdout-scored runs."""
        out: dict[str, dict[int, float]] = {}
        with self.session() as s:
            for r in s.exec(select(HoldoutScore).where(HoldoutScore.commit == commit)):
                out.setdefault(r.task, {})[r.seed] = r.value
        return out

    def stage_exec(self, eid: int) -> StageExec | None:
        """One stage execution by its id (the web page's log link)."""
        with self.session() as s:
            return s.get(StageExec, eid)

    def stage_execs(self, run_ids: Iterable[int] | None = None) -> list[StageExec]:
        with self.session() as s:
            q = select(StageExec).order_by(StageExec.id)
            if run_ids is not None:
                q = q.where(StageExec.run_id.in_(list(run_ids)))  # type: ignore[attr-defined]
            return list(s.exec(q))

    def queue_counts(self) -> dict[str, int]:
        with self.session() as s:
            rows = s.exec(select(Run.status, func.count()).group_by(Run.status)).all()  # type: ignore[call-overload]
        counts = {"queued": 0, "running": 0, "done": 0, "failed": 0}
        counts.update({status: int(n) for status, n in rows})
        return counts

    def goodput(self, since: float | None = None) -> Goodput:
        with self.session() as s:
            q = select(StageExec.outcome, func.sum(StageExec.cpu_s), func.sum(StageExec.saved_cpu_s),  # type: ignore[call-overload]
                       func.sum(StageExec.gpu_s), func.count()).group_by(StageExec.outcome)
            if since is not None:
                q = q.where(StageExec.started_at >= since)
            rows = s.exec(q).all()
            rq = select(func.coalesce(func.sum(Run.requeues), 0), func.coalesce(func.sum(Run.infra_failures), 0))
            requeues, infra = s.exec(rq).one()  # type: ignore[call-overload]
        by: dict[str, tuple[float, float, float, int]] = {
            o: (float(c or 0), float(sv or 0), float(g or 0), int(n)) for o, c, sv, g, n in rows
        }

        def cpu(*outcomes: str) -> float:
            return sum(by.get(o, (0.0, 0.0, 0.0, 0))[0] for o in outcomes)

        return Goodput(
            useful_cpu_s=cpu("ok"),
            method_failed_cpu_s=cpu(*METHOD_OUTCOMES),
            infra_lost_cpu_s=cpu("infra", "lost", "cancelled"),
            saved_by_cache_cpu_s=sum(by.get(o, (0.0, 0.0, 0.0, 0))[1] for o in ("cache_hit", "shared")),
            gpu_s=sum(v[2] for v in by.values()),
            stages_executed=sum(by.get(o, (0, 0, 0, 0))[3] for o in ("ok", "method", "timeout", "infra", "lost", "cancelled")),
            cache_hits=sum(by.get(o, (0, 0, 0, 0))[3] for o in ("cache_hit", "shared")),
            infra_retries=int(infra),
            requeues=int(requeues),
        )

    # --- gate records -----------------------------------------------------------------------

    def put_gate_record(self, hypothesis: str, look: int, payload: Any, kind: str = "verdict") -> GateRecord:
        """Store (or replace) the gate's record for (hypothesis, look, kind).

        `payload` may be a pydantic model (stored as its JSON form) or anything JSON-serialisable.
        Replacing keeps the call idempotent for an agent node that re-runs after a crash.
        """
        if hasattr(payload, "model_dump"):
            payload = payload.model_dump(mode="json")
        payload = json.loads(json.dumps(payload, allow_nan=False))
        with self.session() as s:
            rec = s.exec(select(GateRecord).where(
                GateRecord.hypothesis == hypothesis, GateRecord.look == look, GateRecord.kind == kind
            )).first()
            if rec is None:
                rec = GateRecord(hypothesis=hypothesis, look=look, kind=kind, payload=payload)
            else:
                rec.payload = payload
                rec.created_at = now()
            s.add(rec)
            try:
                s.commit()
            except IntegrityError:  # a concurrent writer inserted it first: overwrite theirs
                s.rollback()
                return self.put_gate_record(hypothesis, look, payload, kind)
            s.refresh(rec)
            return rec

    def move_gate_records(self, hypothesis: str, to: str, kinds: tuple[str, ...]) -> int:
        """Move the records of `kinds` from `hypothesis` to the key `to`, in one transaction (a record
        already under `to` for the same look and kind is replaced). Idempotent: a second call finds
        nothing left to move. How a re-based hypothesis's earlier comparison is kept aside."""
        with self.session() as s:
            rows = list(s.exec(select(GateRecord).where(GateRecord.hypothesis == hypothesis,
                                                        GateRecord.kind.in_(kinds))))
            for rec in rows:
                for old in s.exec(select(GateRecord).where(GateRecord.hypothesis == to, GateRecord.look == rec.look,
                                                           GateRecord.kind == rec.kind)):
                    s.delete(old)
            s.flush()
            for rec in rows:
                rec.hypothesis = to
                s.add(rec)
            s.commit()
            return len(rows)

    def latest_gate_records(self, kind: str) -> dict[str, GateRecord]:
        """Every hypothesis's record of `kind` at its deepest look, in one read: {hypothesis: record}."""
        with self.session() as s:
            rows = s.exec(select(GateRecord).where(GateRecord.kind == kind).order_by(GateRecord.look))
            return {r.hypothesis: r for r in rows}

    def gate_records(self, hypothesis: str, kind: str | None = None) -> list[GateRecord]:
        with self.session() as s:
            q = select(GateRecord).where(GateRecord.hypothesis == hypothesis).order_by(GateRecord.look, GateRecord.kind)
            if kind is not None:
                q = q.where(GateRecord.kind == kind)
            return list(s.exec(q))
