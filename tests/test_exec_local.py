"""The local executor at the process level: warm forks, timeouts, memory, threads, secrets."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest

from pipeline.executors import JobResult, StageJob, classify
from pipeline.executors.base import lab_env, scrub_env
from pipeline.executors.local import LocalExecutor

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROBE = """
import json, os, sys, time
mode = sys.argv[1]
out = sys.argv[-1]
if mode == "probe":
    import numpy
    json.dump({"preloaded": sorted(m for m in ("torch", "peft", "numpy") if m in sys.modules),
               "pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ),
               "threads": __import__("torch").get_num_threads() if "torch" in sys.modules else None,
               "pkg_on_path": any(os.path.isdir(os.path.join(p, "pipeline", "executors")) for p in sys.path)},
              open(os.path.join(out, "probe.json"), "w"))
elif mode == "blas":
    import ctypes, numpy
    libs = {l.split()[-1] for l in open("/proc/self/maps") if "openblas" in l.rsplit("/", 1)[-1].lower()}
    lib = ctypes.CDLL(sorted(libs)[0], mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    get = next(getattr(lib, n) for n in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_",
                                         "openblas_get_num_threads") if hasattr(lib, n))
    json.dump({"blas": get(), "torch": __import__("torch").get_num_threads()}, open(os.path.join(out, "blas.json"), "w"))
elif mode == "orphan":
    import subprocess
    child = subprocess.Popen(["sleep", "300"])
    open(os.path.join(out, "child.pid"), "w").write(str(child.pid))
    time.sleep(300)
elif mode == "hog":
    blocks = [bytearray(32 << 20) for _ in range(64)]   # 2 GiB
elif mode == "sleep":
    time.sleep(float(sys.argv[2]))
elif mode == "meet":
    # record this job's interval, holding it open until the peer job has started (or 20 s pass)
    me, peer = sys.argv[2], sys.argv[3]
    start = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process on the machine
    open(os.path.join(out, me + ".start"), "w").write(repr(start))
    deadline = time.monotonic() + 20
    while not os.path.exists(os.path.join(out, peer + ".start")) and time.monotonic() < deadline:
        time.sleep(0.01)
    json.dump({"start": start, "end": time.monotonic()}, open(os.path.join(out, me + ".span"), "w"))
"""


@pytest.fixture
def work(tmp_path: Path) -> Path:
    (tmp_path / "probe.py").write_text(PROBE)
    return tmp_path


def job(work: Path, *args: str, argv: list[str] | None = None, timeout_s: float = 30, **kw: object) -> StageJob:
    return StageJob(job_id=uuid.uuid4().hex, argv=argv or ["python", "probe.py", *args, str(work)], cwd=work,
                    commit="0" * 40, out=work, log_path=work / "logs" / "stage.log", timeout_s=timeout_s, **kw)  # type: ignore[arg-type]


def wait_all(ex: LocalExecutor, n: int, limit: float = 60) -> dict[str, JobResult]:
    got: dict[str, JobResult] = {}
    t_end = time.monotonic() + limit
    while len(got) < n and time.monotonic() < t_end:
        got.update({r.job_id: r for r in ex.poll(1.0)})
    assert len(got) == n, f"only {len(got)} of {n} jobs finished"
    return got


def test_warm_worker_runs_python_stages_in_a_fork_with_torch_already_imported(work: Path, monkeypatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-live-123")
    monkeypatch.setenv("HF_TOKEN", "hf_abc")
    monkeypatch.setenv("db_Password", "hunter2")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws")
    monkeypatch.setenv("AUTORESEARCH_DB", "postgresql://u:pw@h/db")
    monkeypatch.setenv("MIRROR", "https://user:pw@mirror.example/simple")
    monkeypatch.setenv("HARMLESS_SETTING", "kept")
    monkeypatch.setenv("UNLISTED_SETTING", "dropped")
    with LocalExecutor(cpus=1, slots=1, preload=("numpy", "torch", "peft")) as ex:
        j = job(work, "probe", env=lab_env(["HARMLESS_SETTING"]))  # a lab's `[run] env = ["HARMLESS_SETTING"]`
        ex.submit(j)
        (res,) = wait_all(ex, 1).values()
        assert res.status == "ok", (work / "logs" / "stage.log").read_text()
        # a second stage is forked from the same warm worker: no interpreter start, no torch import
        assert ex._proc is not None
        worker = ex._proc.pid
        ex.submit(job(work, "probe", env=j.env))
        (res2,) = wait_all(ex, 1).values()
        assert res2.status == "ok", (work / "logs" / "stage.log").read_text()
        assert ex._proc is not None and ex._proc.pid == worker  # the worker was not restarted
    probe = json.loads((work / "probe.json").read_text())
    assert probe["ppid"] == worker and probe["pid"] != worker  # a fork of the warm worker
    assert probe["preloaded"] == ["numpy", "peft", "torch"]
    assert probe["argv"] == [str(work / "probe.py"), "probe", str(work)] and probe["cwd"] == str(work)
    assert probe["threads"] == 1 and probe["env"]["OMP_NUM_THREADS"] == "1" and probe["env"]["MKL_NUM_THREADS"] == "1"
    assert not probe["pkg_on_path"]
    env = probe["env"]
    leaked = [k for k in env if any(w in k.upper() for w in ("KEY", "TOKEN", "SECRET", "PASSWORD"))]
    assert leaked == [] and "AUTORESEARCH_DB" not in env and "MIRROR" not in env
    assert env["HARMLESS_SETTING"] == "kept" and "UNLISTED_SETTING" not in env  # an allow-list, plus `[run] env`


def test_the_warm_worker_is_single_threaded_and_each_stage_sizes_its_own_pools(work: Path) -> None:
    """numpy's OpenBLAS starts its thread pool on import when told to use more than one thread: a
    worker with `cpus = 2` forked every stage from a multi-threaded process (Python 3.12 warns on
    each fork). It imports with one thread; the stage then gets its 2 threads, in BLAS and torch."""
    with LocalExecutor(cpus=2, slots=1, preload=("numpy", "torch")) as ex:
        ex.submit(job(work, "blas", cpus=2))
        (res,) = wait_all(ex, 1).values()
        assert res.status == "ok", (work / "logs" / "stage.log").read_text()
        assert ex.worker_threads == ["python"], ex.worker_threads
    assert json.loads((work / "blas.json").read_text()) == {"blas": 2, "torch": 2}


def test_exec_path_also_gets_a_scrubbed_environment(work: Path, monkeypatch) -> None:
    monkeypatch.setenv("GITHUB_TOKEN", "ghp_x")
    with LocalExecutor(preload=()) as ex:
        ex.submit(job(work, argv=["sh", "-c", f"env > {work}/env.txt; exit 3"]))
        (res,) = wait_all(ex, 1).values()
    assert (res.status, res.exit_code) == ("exit", 3)
    names = [line.split("=", 1)[0] for line in (work / "env.txt").read_text().splitlines() if "=" in line]
    assert "GITHUB_TOKEN" not in names and "PATH" in names
    assert scrub_env({"a_key_b": "1", "Secret": "2", "X": "3", "PATH": "/bin", "LC_ALL": "C"}, keep=["X"]) == {
        "X": "3", "PATH": "/bin", "LC_ALL": "C"}


def test_timeout_kills_the_whole_process_group(work: Path) -> None:
    with LocalExecutor(preload=()) as ex:
        ex.submit(job(work, "orphan", timeout_s=1.0))
        (res,) = wait_all(ex, 1).values()
    assert res.status == "timeout" and 0.9 < res.wall_s < 6
    assert classify(res) == ("timeout", "timeout")
    grandchild = int((work / "child.pid").read_text())

    def gone() -> bool:
        try:
            return "Z" in Path(f"/proc/{grandchild}/stat").read_text().split()[2]
        except FileNotFoundError:
            return True

    deadline = time.monotonic() + 5
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone()


def test_memory_limit_turns_a_hog_into_a_method_failure(work: Path) -> None:
    with LocalExecutor(preload=("numpy",)) as ex:
        ex.submit(job(work, "hog", memory_mb=256))
        (res,) = wait_all(ex, 1).values()
    assert res.status == "exit" and classify(res) == ("method", "crash")
    assert "MemoryError" in (work / "logs" / "stage.log").read_text()


def test_slots_run_concurrently_and_cancel_works(work: Path) -> None:
    with LocalExecutor(preload=(), slots=2) as ex:
        assert ex.slots == 2
        a, b, c = job(work, "meet", "a", "b"), job(work, "meet", "b", "a"), job(work, "sleep", "30")
        for j in (a, b, c):
            ex.submit(j)
        ex.cancel(c.job_id)
        got = wait_all(ex, 3)
    assert got[a.job_id].status == got[b.job_id].status == "ok"
    # the two ran at once: each started before the other ended
    span_a, span_b = (json.loads((work / f"{n}.span").read_text()) for n in ("a", "b"))
    assert span_a["start"] < span_b["end"] and span_b["start"] < span_a["end"], (span_a, span_b)
    assert got[c.job_id].status == "cancelled" and classify(got[c.job_id])[0] == "cancelled"


def test_a_dead_worker_is_an_infrastructure_failure_and_is_replaced(work: Path) -> None:
    with LocalExecutor(preload=()) as ex:
        j = job(work, "sleep", "30")
        ex.submit(j)
        time.sleep(0.3)
        assert ex._proc is not None
        os.kill(ex._proc.pid, signal.SIGKILL)
        (res,) = wait_all(ex, 1).values()
        assert res.status == "infra" and classify(res) == ("infra", "infra")
        ex.submit(job(work, "sleep", "0"))
        (res2,) = wait_all(ex, 1).values()
        assert res2.status == "ok"


def test_crash_signals_are_method_failures_and_kills_are_infrastructure() -> None:
    assert classify(JobResult("x", "signal", signal=signal.SIGSEGV)) == ("method", "signal")
    assert classify(JobResult("x", "signal", signal=signal.SIGKILL)) == ("infra", "signal")
    assert classify(JobResult("x", "exit", exit_code=1)) == ("method", "crash")
    assert sys.platform.startswith("linux")
