"""One heartbeat per process (`pipeline.lease.Heartbeat`), on a real SQLite store: each beat refreshes
the lab's lease and every run the process claimed; a lease taken over is said once, and the runs go
on beating; a driver handed the process's heartbeat starts no thread of its own."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import update

from pipeline import lease
from pipeline.store import Owner, Run, Store
from pipeline import experiment

pytestmark = pytest.mark.integration


def _beats(store: Store, run_id: int) -> tuple[float, float]:
    with store.session() as s:
        return s.get(lease.Lease, lease.KEY).heartbeat_at, s.get(Run, run_id).heartbeat_at


def _beating() -> int:
    """Heartbeat threads alive in this process (a test run's other tests may have left some)."""
    return sum(t.name == "autoresearch-heartbeat" for t in threading.enumerate())


def _wait(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_one_beat_refreshes_the_lease_and_the_runs_and_a_lost_lease_is_said_once(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    me = Owner.current()
    assert lease.acquire(store, me) is None
    store.ensure_arm("a" * 40)
    store.enqueue("a" * 40, [("t", 0)])
    (claim,) = store.claim(me, 1)
    lease_at, run_at = _beats(store, claim.run.id)
    before = _beating()
    lost: list[float] = []
    hb = lease.Heartbeat(store, me, 0.05, holds_lease=True, on_lost=lambda: lost.append(time.time())).start()
    try:
        _wait(lambda: all(b > a for b, a in zip(_beats(store, claim.run.id), (lease_at, run_at))))
        assert _beating() == before + 1  # one thread beats for both
        with store.session() as s:  # another driver took the lease over (this one stalled)
            s.exec(update(lease.Lease).values(pid=me.pid + 1, heartbeat_at=0.0))
            s.commit()
        _wait(lambda: lost)
        _, run_at = _beats(store, claim.run.id)
        _wait(lambda: _beats(store, claim.run.id)[1] > run_at)  # its runs still beat, for their results
        time.sleep(0.2)
        assert len(lost) == 1 and hb.lost
        with store.session() as s:
            assert s.get(lease.Lease, lease.KEY).heartbeat_at == 0.0  # the other holder's row untouched
    finally:
        hb.stop()
    assert _beating() == before


def test_a_driver_given_the_process_heartbeat_starts_none_and_stops_only_its_own(tmp_path: Path) -> None:
    from support.tiny import TinyHarness, make_lab

    from pipeline import runner

    lab = make_lab(tmp_path / "lab")
    store = experiment.open_store(lab)
    before = _beating()
    shared = lease.Heartbeat(store, Owner.current(), 0.05).start()
    try:
        with runner.Driver(lab, store, runner.make_executor("local", lab, workers=1), harness=TinyHarness(),
                           heartbeat=shared) as d:
            assert d.heartbeat is shared and _beating() == before + 1
        assert shared._thread is not None and shared._thread.is_alive()  # the process's: not the driver's to stop
        with runner.Driver(lab, store, runner.make_executor("local", lab, workers=1), harness=TinyHarness()) as own:
            assert own.heartbeat is not shared and _beating() == before + 2
        assert _beating() == before + 1
    finally:
        shared.stop()
