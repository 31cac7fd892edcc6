"""The loop with two hypotheses in flight, its store and its LangGraph checkpoints in PostgreSQL,
and the `--hours` budget. Real PostgreSQL at 127.0.0.1:5432 (a database of its own per test), real
executor, real git; the tiny lab."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from support.lab import TASKS, RunProcess, cli_json, make_loop, set_research

pytestmark = pytest.mark.system


def test_two_hypotheses_in_flight_with_store_and_checkpoints_in_postgresql(lab: Path, pg_url: str) -> None:
    import psycopg

    set_research(lab, "max_in_flight = 1", "max_in_flight = 2")
    loop = make_loop(lab, offline=True, db=pg_url, max_hypotheses=2)
    try:
        out = loop.run()
    finally:
        loop.close()
    said = loop.said
    assert out["started"] == 2

    # both were measured at once: each one's first look was queued before either had a verdict
    def first(pattern: str) -> int:
        return next(i for i, line in enumerate(said) if pattern in line)

    first_verdict = first("verdict")
    assert first("#1 ") < first_verdict and first("#2 ") < first_verdict, said
    assert first("measuring, look of 2") < first_verdict
    assert sum("measuring, look of 2" in line for line in said[:first_verdict]) == 2, said

    hs = loop.records.all()
    assert [h.status for h in hs] == ["done", "done"] and all(h.verdict for h in hs)
    assert hs[0].change != hs[1].change  # two different untried configurations
    # every run once, finished, in PostgreSQL; the baseline's runs shared by both challengers
    runs = loop.store.runs()
    keys = [(r.commit, r.task, r.seed) for r in runs]
    assert len(keys) == len(set(keys)) and {r.status for r in runs} == {"done"}
    base = {(r.task, r.seed) for r in runs if r.commit == hs[0].base_commit}
    assert base == {(t, s) for t in TASKS for s in (0, 1, 2)}  # the first baseline's block, seeds 0..
    assert hs[0].base_commit == hs[1].base_commit
    # the graphs' checkpoints went to PostgreSQL (the Postgres saver), one thread per hypothesis
    with psycopg.connect(pg_url.replace("postgresql+psycopg://", "postgresql://")) as c:
        threads = {row[0] for row in c.execute("select distinct thread_id from checkpoints")}
    assert threads == {str(h.id) for h in hs}
    assert not (lab / "runs" / "checkpoints.sqlite").exists()
    # status reads the same database
    st = cli_json(lab, "--db", pg_url, "status", "--json")
    assert [h["id"] for h in st["hypotheses"]] == [h.id for h in hs] and st["queue"]["queued"] == 0


def test_hours_budget_stops_the_loop_gracefully_and_a_restart_resumes(lab: Path) -> None:
    # a budget of ~4 s: reached in the middle of the first hypothesis's runs
    t0 = time.monotonic()
    run = RunProcess(lab, "--offline", "--forever", "--hours", "0.001", "--workers", "2", tag="hours")
    assert run.wait(120) == 0, run.stderr()[-4000:]
    assert time.monotonic() - t0 < 60
    err = run.stderr()
    assert "time budget of 0.001 h reached" in err and "loop stopped (time budget)" in err
    st = cli_json(lab, "status", "--json")
    assert st["queue"]["running"] == 0  # nothing left claimed by a dead loop
    assert any("time budget" in e["message"] for e in st["events"])
    (h,) = st["hypotheses"]
    assert h["status"] in ("measuring", "implementing", "proposing")  # not finished: resumed below

    run = RunProcess(lab, "--offline", "--max-hypotheses", "1", "--workers", "2", tag="resume")
    assert run.wait(240) == 0, run.stderr()[-4000:]
    assert f"#{h['id']} " in run.stderr() and "resuming" in run.stderr()
    (h2,) = cli_json(lab, "status", "--json")["hypotheses"]
    assert h2["id"] == h["id"] and h2["status"] == "done" and h2["verdict"]
