"""A loop that stops (a signal, `--hours`, a lost lease) does not wait for a command run once.

`isolation.run_once` runs the harness's `prepare` and `score` and a smoke stage without a warm
worker: each may take the lab's whole `timeout_s` (900 s by default), or wait that long for a GPU
share. Inside `isolation.stopping(stop)` it ends when `stop` is set: it stops waiting, or kills its
process group, and raises `Interrupted`; what it spent is still metered. The driver runs its steps
inside such a block, so its claimed runs go back to the queue at once. Real processes, a real
driver on the command template lab (its `prepare` replaced by a sleep).
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import pytest

from pipeline import isolation
from pipeline.errors import Interrupted
from pipeline.executors.gpus import GpuPool

pytestmark = pytest.mark.integration

SLEEPER = "import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\ntime.sleep(120)\n"


def command_lab(root: Path, prepare: str | None = None, extra: str = "") -> object:
    from agent.labinit import init_lab
    from pipeline.lab import load_lab

    root = init_lab(root, harness="command")
    research = root / "research.toml"
    text = research.read_text().replace('sandbox = "auto"', f'sandbox = "off"{extra}')
    if prepare is not None:
        text = re.sub(r"^prepare = .*$", f"prepare = {prepare!r}", text, flags=re.M)
    research.write_text(text)
    return load_lab(root)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_a_command_run_once_ends_when_the_stop_is_set_and_its_processes_die(tmp_path: Path) -> None:
    lab = command_lab(tmp_path / "lab")
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    pid_file = tmp_path / "pid"
    stop = threading.Event()
    threading.Timer(1.0, stop.set).start()
    t0 = time.monotonic()
    with isolation.metered() as meter, isolation.stopping(stop), pytest.raises(Interrupted, match="abandoned"):
        isolation.run_once(lab, ["python", "sleeper.py", str(pid_file)], cwd=tmp_path, log=tmp_path / "log",
                           timeout_s=300, ro=[])
    assert time.monotonic() - t0 < 10  # not the sleeper's 120 s, nor the 300 s timeout
    assert meter.processes == 1 and meter.wall_s >= 0.9  # what it spent is still on the books
    assert gone(int(pid_file.read_text()))
    with pytest.raises(Interrupted):  # set already: nothing starts
        with isolation.stopping(stop):
            isolation.run_once(lab, ["python", "sleeper.py", str(pid_file)], cwd=tmp_path, log=tmp_path / "log",
                               timeout_s=300, ro=[])
    # outside the block the same call is not stopped by that event
    done = isolation.run_once(lab, ["python", "-c", "pass"], cwd=tmp_path, log=tmp_path / "log", timeout_s=60, ro=[])
    assert done.returncode == 0 and not done.interrupted


def test_a_wait_for_a_gpu_share_ends_when_the_stop_is_set(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4")
    lab = command_lab(tmp_path / "lab")
    pool = GpuPool.shared(["4"])
    assert pool.take("a-whole-gpu-stage", 1) == ["4"]
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    t0 = time.monotonic()
    try:
        with isolation.stopping(stop), pytest.raises(Interrupted):
            isolation.run_once(lab, ["python", "-c", "pass"], cwd=tmp_path, log=tmp_path / "log", timeout_s=300,
                               ro=[], gpus=0.5)
        assert time.monotonic() - t0 < 5  # it stopped waiting: no "no GPU came free" after 300 s
    finally:
        pool.give_back("a-whole-gpu-stage")
    assert pool.used() == {"4": 0.0}


def test_a_stopping_driver_leaves_a_long_prepare_and_gives_its_runs_back(tmp_path: Path) -> None:
    from sqlmodel import select

    from pipeline import experiment, runner
    from pipeline.executors import make_executor
    from pipeline.store.tables import HarnessExec

    lab = command_lab(tmp_path / "lab", prepare="python -c 'import time; time.sleep(120)' {data} {sealed}")
    store = experiment.open_store(lab)
    ids = experiment.ensure_runs(store, lab, "autoresearch/baseline", lab.tasks()[:1], [0, 1])
    stop = threading.Event()
    threading.Timer(1.5, stop.set).start()
    t0 = time.monotonic()
    with runner.Driver(lab, store, make_executor("local", lab)) as d:
        d.drive(until=ids, stop=stop, timeout_s=200)
    assert time.monotonic() - t0 < 20
    assert {r.status for r in store.runs(ids)} == {"queued"}  # given back, not failed
    assert not [p.name for p in (lab.state / "data").iterdir() if not p.name.endswith(".lock")]  # nothing half made
    assert not list((lab.state / "sealed").iterdir())
    with store.session() as s:
        (call,) = s.exec(select(HarnessExec))
    assert (call.kind, call.outcome) == ("prepare", "failed") and call.wall_s >= 1.0  # booked for what it spent


def test_a_stopping_driver_leaves_a_slow_scorer_and_gives_the_claimed_run_back(tmp_path: Path) -> None:
    """A claimed run whose stages are done and whose scorer hangs: the stop ends the scorer, the run
    goes back to the queue (not failed: the scorer is not the method), close scores nothing more, and
    the scorer's time is booked. Its stage's output stays in the cache for the next driver."""
    from sqlmodel import select

    from pipeline import experiment, runner
    from pipeline.executors import make_executor
    from pipeline.store.tables import HarnessExec

    marker = tmp_path / "scoring"
    lab = command_lab(tmp_path / "lab", prepare=None)
    research = Path(lab.root) / "research.toml"  # type: ignore[attr-defined]
    score = f"""python -c 'import time; open("{marker}", "w"); time.sleep(120)' {{predictions}} {{sealed}}"""
    text = research.read_text()
    research.write_text(re.sub(r"^score = .*$", lambda _: f"score = '''{score}'''", text, flags=re.M))
    from pipeline.lab import load_lab

    lab = load_lab(lab.root)  # type: ignore[attr-defined]
    store = experiment.open_store(lab)
    ids = experiment.ensure_runs(store, lab, "autoresearch/baseline", lab.tasks()[:1], [0, 1])
    stop = threading.Event()

    def watch() -> None:
        while not marker.exists() and not stop.is_set():
            time.sleep(0.05)
        time.sleep(0.3)
        stop.set()

    threading.Thread(target=watch, daemon=True).start()
    with runner.Driver(lab, store, make_executor("local", lab)) as d:
        d.drive(until=ids, stop=stop, timeout_s=200)
        t_stop = time.monotonic()
    assert marker.exists() and time.monotonic() - t_stop < 10  # closed without scoring the other run
    assert {r.status for r in store.runs(ids)} == {"queued"}
    assert all(r.requeues == 0 for r in store.runs(ids))  # given back, not counted as lost
    with store.session() as s:
        scores = [c for c in s.exec(select(HarnessExec)) if c.kind == "score"]
    assert scores and all(c.outcome == "failed" for c in scores) and scores[0].wall_s >= 0.2


def test_a_scorer_lost_to_the_machinery_is_run_again_then_failed_as_infrastructure(tmp_path: Path) -> None:
    """A scorer that fails for the machinery's reason (`InfrastructureFailure`: a node lost, no GPU
    came free) is not the method's failure nor final at once: the run is scored again, up to
    `[run] retries` times, then recorded as the infrastructure's."""
    from pipeline import experiment, runner
    from pipeline.errors import InfrastructureFailure
    from pipeline.executors.local import LocalExecutor
    from support.tiny import TASKS, TinyHarness, make_lab, open_tiny_lab

    class Flaky(TinyHarness):
        def __init__(self, fail: int) -> None:
            super().__init__()
            self.fail, self.calls = fail, 0

        def score(self, *a, **kw):  # type: ignore[no-untyped-def]
            self.calls += 1
            if self.calls <= self.fail:
                raise InfrastructureFailure("the scorer's node was lost")
            return super().score(*a, **kw)

    make_lab(tmp_path / "lab")
    lab = open_tiny_lab(tmp_path / "lab")
    store = experiment.open_store(lab)
    retries = lab.config.run.retries
    for fail, outcome in ((retries, "ok"), (10, "infra_failure")):
        harness = Flaky(fail)
        ids = experiment.ensure_runs(store, lab, "autoresearch/baseline", TASKS[:1], [fail], harness=harness)
        with runner.Driver(lab, store, LocalExecutor(slots=1, preload=()), harness=harness) as d:
            d.drive(until=ids, timeout_s=120)
        (row,) = [r for r in store.results_for(experiment.resolve_commit(lab, "autoresearch/baseline"), TASKS[:1])
                  if r.seed == fail]
        assert row.outcome == outcome and harness.calls == retries + 1, (row.outcome, row.detail, harness.calls)
        if outcome == "infra_failure":
            assert row.kind == "scorer" and "retries exhausted" in (row.detail or "")
