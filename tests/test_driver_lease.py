"""One driver per lab: a lease in the store (holder host, pid, heartbeat).

Seen before the lease: two `autoresearch run` on one lab drove the same hypotheses (a real gain
abandoned, a tag conflict), and two started at the same instant died in schema creation. Now a
second `run` refuses with one line naming the holder (exit 2), and takes over when the holder is
dead. Real processes, real SQLite file and PostgreSQL server, the tiny lab.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from support.lab import RunProcess, assert_runs_exactly_once, cli, cli_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def lease_of(lab: Path, *db: str) -> dict | None:
    out = cli(lab, *db, "status", "--json")
    return json.loads(out.stdout)["driver"] if out.returncode == 0 else None


def decided_once(lab: Path, *db: str) -> None:
    """Every hypothesis has at most one decision record per look: nothing was decided twice."""
    from support.lab import open_lab

    from agent.records import Records
    from pipeline import experiment

    store = experiment.open_store(open_lab(lab), db[1] if db else None)
    hyps = json.loads(cli(lab, *db, "status", "--json").stdout)["hypotheses"]
    for h in hyps:
        looks = [d.look for d in Records(store).decisions(h["id"])]
        assert len(looks) == len(set(looks)), (h, looks)


def test_a_second_run_ten_seconds_later_refuses_and_a_dead_holders_lease_is_taken_over(lab: Path) -> None:
    # --forever: the first holds the lease until killed (a count could let it finish before the check)
    first = RunProcess(lab, "--offline", "--forever", tag="first")
    try:
        holder = first.wait_until("the lease", lambda: lease_of(lab), timeout=120)
        assert holder["pid"] == first.pid and holder["alive"] is True
        time.sleep(max(0.0, 10.0 - (time.monotonic() - first.t0)))
        assert first.alive()
        second = cli(lab, "run", "--offline", "--max-hypotheses", "1")
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in second.stderr
        assert f"pid {first.pid}" in lines[0] and "already driven" in lines[0]
        first.kill9()  # the holder dies with its lease in the store
    finally:
        first.cleanup()
    assert lease_of(lab)["alive"] is False
    third = RunProcess(lab, "--offline", "--max-hypotheses", "2", tag="third")
    try:
        assert third.wait(timeout=600) == 0, third.stderr()
    finally:
        third.cleanup()
    assert f"took over the lab from pid {first.pid}" in third.stderr()
    assert lease_of(lab) is None  # released on a clean stop
    assert_runs_exactly_once(lab)
    decided_once(lab)


@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_two_runs_started_together_one_drives_the_other_refuses(lab: Path, store: str, request) -> None:
    db = ("--db", request.getfixturevalue("pg_url")) if store == "postgresql" else ()
    env = cli_env()
    runs = [RunProcess(lab, *db, "--offline", "--max-hypotheses", "1", env=env, tag=f"run{i}") for i in range(2)]
    try:
        codes = sorted(r.wait(timeout=600) for r in runs)
    finally:
        for r in runs:
            r.cleanup()
    assert codes == [0, 2], [r.stderr()[-2000:] for r in runs]
    loser = next(r for r in runs if r.proc.returncode == 2)
    winner = next(r for r in runs if r.proc.returncode == 0)
    assert "Traceback" not in loser.stderr() + winner.stderr()
    assert len(loser.stderr().strip().splitlines()) == 1
    assert f"pid {winner.pid}" in loser.stderr()
    decided_once(lab, *db)
