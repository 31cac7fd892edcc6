"""The store on a real SQLite file and on the real PostgreSQL server (a private schema per test)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from pydantic import BaseModel
from sqlalchemy import create_engine, text
from sqlalchemy.exc import IntegrityError, OperationalError

from pipeline.store import Owner, Result, Run, Store

pytestmark = pytest.mark.integration

PG_URL = os.environ.get("AUTORESEARCH_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path: Path):
    """(url, schema) of an empty database; PostgreSQL gets a schema of its own, dropped after."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'store.db'}", None
        return
    try:
        admin = create_engine(PG_URL)
        with admin.connect() as c:
            c.execute(text("select 1"))
    except OperationalError as e:
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL at {PG_URL} is required in CI: {e}")
        # platform limit: a developer machine without the PostgreSQL service; CI fails above instead
        pytest.skip(f"no PostgreSQL at {PG_URL}")
    schema = "t_" + uuid.uuid4().hex[:12]
    with admin.begin() as c:
        c.execute(text(f"create schema {schema}"))
    yield PG_URL, schema
    with admin.begin() as c:
        c.execute(text(f"drop schema {schema} cascade"))
    admin.dispose()


@pytest.fixture
def store(db):
    url, schema = db
    s = Store(url, schema=schema)
    yield s
    s.dispose()


def dead_owner() -> Owner:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return Owner(socket.gethostname(), proc.pid, 1.0)


def test_enqueue_is_idempotent_and_runs_are_unique(store: Store) -> None:
    store.ensure_arm("c" * 40, "baseline")
    first = store.enqueue("c" * 40, [("a", 0), ("a", 1), ("b", 0)])
    again = store.enqueue("c" * 40, [("b", 0), ("a", 0), ("a", 2)])
    assert again[:2] == [first[2], first[0]]
    assert len(store.runs()) == 4
    with store.session() as s:
        s.add(Run(commit="c" * 40, task="a", seed=0))
        with pytest.raises(IntegrityError):
            s.commit()


@pytest.mark.slow
def test_concurrent_claims_take_each_run_exactly_once(db, store: Store, tmp_path: Path) -> None:
    url, schema = db
    store.ensure_arm("d" * 40)
    ids = store.enqueue("d" * 40, [(f"t{i}", s) for i in range(10) for s in range(3)])
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(REPO)!r})
        from pipeline.store import Owner, Store
        store = Store({url!r}, schema={schema!r}, create=False)
        owner = Owner.current()
        got = []
        while True:
            claims = store.claim(owner, 2)
            if not claims:
                break
            got += [c.run.id for c in claims]
        print(json.dumps(got))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(3)]
    claimed = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    flat = [i for got in claimed for i in got]
    assert sorted(flat) == sorted(ids)  # every run claimed, none twice
    assert store.queue_counts()["running"] == len(ids)
    owners = {r.id: r.owner_pid for r in store.runs()}
    for proc, got in zip(procs, claimed):
        assert all(owners[i] == proc.pid for i in got)


def test_a_claim_takes_at_most_its_limit_in_queue_order(store: Store) -> None:
    """On both stores: claim(1) takes one run (the highest priority, then the oldest), claim(3) the
    next three, and nothing is left claimed beyond what was returned."""
    owner = Owner.current()
    store.ensure_arm("c" * 40)
    low = store.enqueue("c" * 40, [("t", i) for i in range(3)], priority=0)
    high = store.enqueue("c" * 40, [("t", i) for i in range(3, 6)], priority=5)
    first = store.claim(owner, 1)
    assert [c.run.id for c in first] == [high[0]]
    assert store.queue_counts()["running"] == 1
    nxt = store.claim(owner, 3)
    assert [c.run.id for c in nxt] == [high[1], high[2], low[0]]
    assert store.queue_counts() == {"queued": 2, "running": 4, "done": 0, "failed": 0}
    assert all(c.run.status == "running" and c.run.claim_token == c.token for c in first + nxt)
    # what `status` lists: the claimed runs alone, read by their status (not every run of the lab)
    assert [r.id for r in store.runs(status="running")] == sorted([high[0], high[1], high[2], low[0]])
    assert [r.id for r in store.runs(commit="c" * 40, status="queued")] == [low[1], low[2]]


def test_result_is_written_once_and_only_by_the_claim_holder(store: Store) -> None:
    store.ensure_arm("e" * 40)
    store.enqueue("e" * 40, [("a", 0), ("b", 0)])
    me = Owner.current()
    c1, c2 = store.claim(me, 2)
    res = Result(run_id=c1.run.id, commit=c1.run.commit, task="a", seed=0, value=0.7)
    assert store.finish(c1, res)
    assert not store.finish(c1, Result(run_id=c1.run.id, commit=c1.run.commit, task="a", seed=0, value=0.9))
    # c2's owner is declared dead by a forged owner row: reconcile takes it back, its token goes stale
    dead = dead_owner()
    with store.session() as s:
        run = s.get(Run, c2.run.id)
        run.owner_host, run.owner_pid, run.owner_started = dead.host, dead.pid, dead.started
        s.add(run)
        s.commit()
    assert store.reconcile() == [c2.run.id]
    assert not store.finish(c2, Result(run_id=c2.run.id, commit=c2.run.commit, task="b", seed=0, value=0.5))
    (again,) = store.claim(me, 1)
    assert again.run.id == c2.run.id and again.run.requeues == 1
    assert store.finish(again, Result(run_id=c2.run.id, commit=c2.run.commit, task="b", seed=0, value=0.6))
    values = {(r.task, r.value) for r in store.results_for("e" * 40)}
    assert values == {("a", 0.7), ("b", 0.6)}


def test_withdraw_removes_only_runs_that_are_queued_and_never_ran(store: Store) -> None:
    """A given-up promotion's replication runs: queued ones that never ran go; one re-queued after a
    crash (its stage history kept) and a running one (given back if the driver stops) move to the back
    of the queue; a finished one, another seed's or another commit's, stays as it is."""
    c, other = "w" * 40, "x" * 40
    store.ensure_arm(c)
    store.ensure_arm(other)
    ids = store.enqueue(c, [("a", 100), ("b", 100), ("c", 100), ("d", 100), ("a", 0)], priority=9)
    store.enqueue(other, [("a", 100)])
    me = Owner.current()
    running, finished, requeued = store.claim(me, 3, commits=[c])  # a/b/c at seed 100, by id
    assert [running.run.id, finished.run.id, requeued.run.id] == ids[:3]
    assert store.finish(finished, Result(run_id=finished.run.id, commit=c, task=finished.run.task, seed=100, value=1.0))
    store.stage_started(requeued.run.id, "train", "k" * 64, executor="local", log_path=None)
    assert store.release(requeued, count_requeue=True)  # back in the queue, with a stage it ran
    assert store.withdraw_queued(c, [100, 101]) == (1, 2)  # d@100 removed; c@100 (a stage ran), a@100 moved back
    left = {(r.task, r.seed): (r.status, r.priority) for r in store.runs() if r.commit == c}
    assert left == {("a", 100): ("running", -1), ("b", 100): ("done", 9), ("c", 100): ("queued", -1),
                    ("a", 0): ("queued", 9)}
    assert [r.status for r in store.runs() if r.commit == other] == ["queued"]
    assert store.withdraw_queued(c, [100]) == (0, 0) and store.withdraw_queued(c, []) == (0, 0)
    store.enqueue(c, [("c", 100)], priority=5)  # a look that needs it after all raises it again
    assert {r.task: r.priority for r in store.runs() if r.commit == c and r.seed == 100}["c"] == 5


def test_reconcile_spares_live_owners_and_fresh_heartbeats(store: Store) -> None:
    store.ensure_arm("f" * 40)
    ids = store.enqueue("f" * 40, [("live", 0), ("remote_fresh", 0), ("remote_stale", 0), ("dead", 0)])
    claims = {c.run.task: c for c in store.claim(Owner.current(), 4)}
    dead = dead_owner()
    exec_id = store.stage_started(claims["dead"].run.id, "pretrain", "k" * 64, executor="local", log_path=None)
    # launched with a whole GPU by a driver whose lab gives its stages half of one now: charged what it held
    remote_exec = store.stage_started(claims["remote_stale"].run.id, "pretrain", "j" * 64, executor="local",
                                      log_path=None, gpu_share=1.0)
    with store.session() as s:
        for task, host, pid, beat in [("remote_fresh", "elsewhere", 1, 0), ("remote_stale", "elsewhere", 1, 600),
                                      ("dead", dead.host, dead.pid, 0)]:
            run = s.get(Run, claims[task].run.id)
            run.owner_host, run.owner_pid, run.owner_started = host, pid, dead.started
            run.heartbeat_at = run.heartbeat_at - beat
            s.add(run)
        s.commit()
    requeued = store.reconcile(stale_s=120, gpus=0.5)
    assert sorted(requeued) == sorted([claims["remote_stale"].run.id, claims["dead"].run.id])
    status = {r.task: r.status for r in store.runs(ids)}
    assert status == {"live": "running", "remote_fresh": "running", "remote_stale": "queued", "dead": "queued"}
    (lost,) = [e for e in store.stage_execs() if e.id == exec_id]
    assert lost.outcome == "lost" and lost.wall_s > 0
    assert lost.gpu_s == pytest.approx(0.5 * lost.wall_s)  # no share recorded: the lab's, held until the driver died
    (whole,) = [e for e in store.stage_execs() if e.id == remote_exec]
    assert whole.outcome == "lost" and whole.wall_s > 0 and whole.gpu_s == pytest.approx(1.0 * whole.wall_s)  # the share it was launched with
    assert store.goodput().infra_lost_gpu_s == pytest.approx(lost.gpu_s + whole.gpu_s)


def test_a_run_that_keeps_killing_its_driver_is_failed_not_looped(store: Store) -> None:
    store.ensure_arm("9" * 40)
    (run_id,) = store.enqueue("9" * 40, [("a", 0)])
    for i in range(3):
        (claim,) = store.claim(Owner.current(), 1)
        dead = dead_owner()
        with store.session() as s:
            run = s.get(Run, run_id)
            run.owner_host, run.owner_pid, run.owner_started = dead.host, dead.pid, dead.started
            s.add(run)
            s.commit()
        store.reconcile(max_requeues=2)
    (run,) = store.runs([run_id])
    assert run.status == "failed" and run.requeues == 3
    (res,) = store.results_for("9" * 40)
    assert res.outcome == "infra_failure" and res.kind == "lost" and res.value is None


class Verdict(BaseModel):
    verdict: str
    p: float
    tasks: dict[str, float]


def test_gate_records_store_pydantic_payloads_and_replace_by_key(store: Store) -> None:
    store.put_gate_record("h1", 2, Verdict(verdict="escalate", p=0.04, tasks={"a": 0.01}))
    store.put_gate_record("h1", 5, {"verdict": "improvement", "p": 0.001, "tasks": {}})
    store.put_gate_record("h1", 2, Verdict(verdict="futile", p=0.5, tasks={}))
    store.put_gate_record("h1", 2, {"note": "sensitivity"}, kind="sensitivity")
    recs = store.gate_records("h1")
    assert [(r.look, r.kind) for r in recs] == [(2, "sensitivity"), (2, "verdict"), (5, "verdict")]
    assert Verdict.model_validate(recs[1].payload) == Verdict(verdict="futile", p=0.5, tasks={})
    with pytest.raises(ValueError):
        store.put_gate_record("h1", 10, {"p": float("nan")})


def test_goodput_splits_useful_failed_lost_and_saved_compute(store: Store) -> None:
    store.ensure_arm("1" * 40)
    a, b = store.enqueue("1" * 40, [("a", 0), ("b", 0)])
    for run_id, outcome, cpu in [(a, "ok", 10.0), (a, "ok", 5.0), (b, "method", 2.0), (b, "infra", 3.0),
                                 (b, "timeout", 4.0)]:
        ex = store.stage_started(run_id, "s", uuid.uuid4().hex, executor="local", log_path=None)
        store.stage_finished(ex, outcome, cpu_s=cpu, wall_s=cpu)
    store.stage_served(b, "pretrain", "k", "cache_hit", executor="local", saved_cpu_s=10.0)
    store.stage_served(b, "pretrain", "k", "shared", executor="local", saved_cpu_s=10.0)
    store.note_infra_failure(b)
    g = store.goodput()
    assert (g.useful_cpu_s, g.method_failed_cpu_s, g.infra_lost_cpu_s, g.saved_by_cache_cpu_s) == (15.0, 6.0, 3.0, 20.0)
    assert (g.stages_executed, g.cache_hits, g.infra_retries) == (5, 2, 1)
    assert g.goodput == pytest.approx(15 / 24)


@pytest.mark.parametrize("db", ["postgres"], indirect=True)  # a server's connections: SQLite has none
def test_a_pooled_connection_the_server_dropped_while_idle_is_replaced_not_raised(db, monkeypatch) -> None:
    """PostgreSQL: the store pings a connection that sat idle in its pool before handing it out, and
    replaces a dead one; a connection reused within IDLE_PING_S is not pinged (no round trip per call)."""
    import pipeline.store as store_mod

    url, schema = db
    s = Store(url, schema=schema)
    try:
        with s.session() as sess:
            pid = sess.execute(text("select pg_backend_pid()")).scalar()  # the pooled connection's backend
        admin = create_engine(PG_URL)
        with admin.begin() as c:
            assert c.execute(text("select pg_terminate_backend(:p)"), {"p": pid}).scalar()
        admin.dispose()
        monkeypatch.setattr(store_mod, "IDLE_PING_S", 0.0)  # it has been idle "long enough"
        assert s.queue_counts() == {"queued": 0, "running": 0, "done": 0, "failed": 0}
        with s.session() as sess:
            assert sess.execute(text("select pg_backend_pid()")).scalar() != pid  # a new connection
    finally:
        s.dispose()


def test_a_database_an_older_version_made_gains_the_new_columns_and_keeps_its_rows(db) -> None:
    """Upgrading the tool on a lab with a store: a table an older version created lacks the columns
    added since (SQLModel's create_all never adds one). Opening it adds each, with the code's default
    for the rows already there, and its index; an older version's writer can still insert."""
    import sqlalchemy as sa
    from sqlmodel import select

    from pipeline.store.tables import SmokeExec

    url, schema = db
    engine = create_engine(url, connect_args={"options": f"-csearch_path={schema}"} if schema else {})
    added = ("executor", "stages", "gpu_s", "started_at", "gpu_from")
    old = sa.MetaData()  # smoke_exec as a version before those columns made it
    sa.Table("smoke_exec", old, *[c._copy() for c in SmokeExec.__table__.columns if c.name not in added])
    old.create_all(engine)
    with engine.begin() as c:
        c.execute(text("insert into smoke_exec (hypothesis, base, outcome, cpu_s, wall_s, gpu_to) "
                       "values ('h-old', 'abc', 'ok', 3.5, 9.0, null)"))

    store = Store(url, schema=schema)
    try:
        cols = {c["name"] for c in sa.inspect(engine).get_columns("smoke_exec")}
        assert set(added) <= cols
        assert "ix_smoke_exec_started_at" in {i["name"] for i in sa.inspect(engine).get_indexes("smoke_exec")}
        with store.session() as s:
            row = s.exec(select(SmokeExec).where(SmokeExec.hypothesis == "h-old")).one()
            # the code's scalar defaults for the old row; None where the code computes its default
            assert (row.executor, row.stages, row.gpu_s, row.cpu_s) == ("here", 0, 0.0, 3.5)
            assert row.started_at is None and row.gpu_from is None
            s.add(SmokeExec(hypothesis="h-new", base="def", outcome="method", stages=2, gpu_from=1.0, gpu_to=2.0))
            s.commit()
        with engine.begin() as c:  # an older version of the tool, still writing to the same database
            c.execute(text("insert into smoke_exec (hypothesis, base, outcome, cpu_s, wall_s) "
                           "values ('h-older', 'abc', 'infra', 1, 1)"))
        Store(url, schema=schema).dispose()  # opened again: nothing left to add, nothing lost
        with store.session() as s:
            rows = {r.hypothesis: r for r in s.exec(select(SmokeExec))}
        assert set(rows) == {"h-old", "h-new", "h-older"}
        assert (rows["h-new"].stages, rows["h-new"].gpu_from) == (2, 1.0)
        assert rows["h-older"].executor == "here"
        assert store.goodput().smoke_runs == 3
    finally:
        store.dispose()
        engine.dispose()


def test_tables_of_past_versions_are_made_fit_for_this_one(db) -> None:
    """Real past shapes: `gpu_usage` when `holder` was unique (one row a process; now one an interval,
    so a second write failed and stopped a GPU lab's loop), `smoke_exec` when `executor` was called
    `where`; and a unique constraint dropped from a table with foreign keys (`result`, SQLite makes
    it again). Each is fixed on open, and no row is lost."""
    import sqlalchemy as sa

    from pipeline.store.tables import Arm, GpuUsage, Run, SmokeExec

    url, schema = db
    engine = create_engine(url, connect_args={"options": f"-csearch_path={schema}"} if schema else {})
    old = sa.MetaData()
    gpu = [c._copy() for c in GpuUsage.__table__.columns]
    for c in gpu:
        if c.name == "holder":
            c.index, c.unique = None, True
    sa.Table("gpu_usage", old, *gpu)
    smoke = [c._copy() for c in SmokeExec.__table__.columns if c.name not in ("gpu_from", "gpu_to")]
    for c in smoke:
        if c.name == "executor":
            c.name = c.key = "where"
    sa.Table("smoke_exec", old, *smoke)
    Arm.__table__.to_metadata(old)
    Run.__table__.to_metadata(old)
    Result.__table__.to_metadata(old).append_constraint(sa.UniqueConstraint("commit", name="uq_old_result_commit"))
    old.create_all(engine)
    with engine.begin() as c:
        c.execute(text("insert into gpu_usage (holder, gpus, started_at, updated_at, samples, busy, util_sum) "
                       "values ('h:1:0', '0', 1, 2, 10, 5, 50)"))
        c.execute(text('insert into smoke_exec (hypothesis, base, outcome, "where", stages, cpu_s, gpu_s, wall_s, '
                       "started_at) values ('h-1', 'abc', 'ok', 'ray', 3, 1, 2, 3, 4)"))
    store = Store(url, schema=schema)
    try:
        store.ensure_arm("c1")
        store.enqueue("c1", [("a", 0), ("a", 1)])
        claims = store.claim(Owner.current(), 2)
        for claim in claims:  # two results of one commit: the old constraint refused the second
            store.finish(claim, Result(run_id=claim.run.id, commit="c1", task="a", seed=claim.run.seed, value=0.5))
        assert len(store.results_for("c1")) == 2
        store.gpu_usage_add("h:1:0", ["0"], 2.0, samples=4, busy=4, util_sum=40.0)  # the second interval
        store.smoke_finished("def", "method", hypothesis="h-2", executor="here", stages=0, cpu_s=0, gpu_s=0,
                             wall_s=1, started_at=5)
        with engine.connect() as c:
            assert c.execute(text("select count(*), sum(samples) from gpu_usage where holder = 'h:1:0'")).one() == (2, 14)
            rows = c.execute(text("select hypothesis, executor, stages from smoke_exec order by hypothesis")).all()
        assert [tuple(r) for r in rows] == [("h-1", "ray", 3), ("h-2", "here", 0)]
        Store(url, schema=schema).dispose()  # opened again: nothing to change
    finally:
        store.dispose()
        engine.dispose()


def test_a_database_a_newer_version_made_is_refused_in_one_line_and_left_alone(db) -> None:
    """A column this version does not know, required and with no default, would refuse every insert
    of this version: the store is refused (UserError), and not altered (the newer version's data stays)."""
    import sqlalchemy as sa

    from pipeline.errors import UserError
    from pipeline.store.tables import SmokeExec

    url, schema = db
    engine = create_engine(url, connect_args={"options": f"-csearch_path={schema}"} if schema else {})
    newer = sa.MetaData()  # also lacking a column (as a newer version that dropped it): nothing is added either
    sa.Table("smoke_exec", newer, *[c._copy() for c in SmokeExec.__table__.columns if c.name != "gpu_to"],
             sa.Column("cost_usd", sa.Float, nullable=False))
    newer.create_all(engine)
    with pytest.raises(UserError, match="smoke_exec has cost_usd, required and unknown to this version"):
        Store(url, schema=schema)
    cols = {c["name"] for c in sa.inspect(engine).get_columns("smoke_exec")}
    assert "cost_usd" in cols and "gpu_to" not in cols
    engine.dispose()


@pytest.mark.slow  # 4-14 s a database: the full suite runs it, `make test-fast` does not
def test_a_years_reads_stay_within_the_databases_bounds_and_read_only_the_deepest_looks(store) -> None:
    """A year of a busy lab compares more commits than PostgreSQL binds in one statement (65,535;
    SQLite's usual build 32,766):
    `result_rows` still reads every one; `latest_gate_records` reads each hypothesis's deepest look
    only, for every hypothesis or the ones asked for."""
    from sqlalchemy import insert

    from pipeline.store.tables import Arm

    commits = [f"c{i:06d}" for i in range(66_000)]
    with store.engine.begin() as c:
        c.execute(insert(Arm), [{"commit": commit} for commit in commits])
        c.execute(insert(Run), [{"commit": commit, "task": "a", "seed": 0, "status": "done"} for commit in commits])
        c.execute(insert(Result), [{"run_id": i + 1, "commit": commit, "task": "a", "seed": 0, "value": float(i),
                                    "outcome": "ok"} for i, commit in enumerate(commits)])
    rows = store.result_rows(commits + commits[:10], ["a"])
    assert len(rows) == 66_000 and {r.commit for r in rows} == set(commits)
    assert store.result_rows(commits, ["b"]) == [] and store.result_rows([]) == []

    for hyp, look in (("1", 1), ("1", 2), ("1", 3), ("2", 1), ("3", 2)):
        store.put_gate_record(hyp, look, {"look": look})
    store.put_gate_record("3", 5, {"look": 5}, kind="rebase")  # another kind's deeper look: not the verdict's
    store.put_gate_record("4", 1, {"look": 1}, kind="rebase")
    latest = store.latest_gate_records("verdict")
    assert {h: r.payload["look"] for h, r in latest.items()} == {"1": 3, "2": 1, "3": 2}
    some = store.latest_gate_records("verdict", ["1", "4"])
    assert {h: r.payload["look"] for h, r in some.items()} == {"1": 3}
