"""The smoke run: a candidate implementation runs its whole stage DAG on a tiny dataset first.

Minutes of benchmark compute are not spent on code that crashes in its first second. The smoke run
uses the same stage commands, a scrubbed environment, the sealed scorer, and a throwaway copy of
the files (the baseline's tree plus the edited files), so it needs no worktree and no commit.

Stages run in a warm worker of the smoke run's own (`SmokeRunner`: the local executor with one
slot, torch and peft imported once), so a smoke run costs a second, not two interpreter start-ups.
It is not the driver's executor: that one's results are polled by the driver. If the worker cannot
be used, a stage runs as a plain subprocess with the same guarantees.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from io import BytesIO
from pathlib import Path
from typing import Any

from pipeline.dag import render
from pipeline.executors.base import scrub_env
from pipeline.harness import PredictionsError, get_harness
from pipeline.lab import Lab

SMOKE_CUSTOMERS = 300
PR_SET_PDEATHSIG = 1


class SmokeFailed(Exception):
    """The candidate's pipeline failed on tiny data; the message is fed back to the implementer."""


class Interrupted(Exception):
    """The loop was asked to stop during a smoke run: nothing is recorded, the next start redoes it."""


def _die_with_parent_hook():
    """A preexec function asking Linux to kill the stage when the loop dies (kill -9 of
    `autoresearch run` leaves no orphan). Resolved before the fork: the child only calls it."""
    try:
        import ctypes

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _run_stage(argv: list[str], cwd: Path, env: dict[str, str], timeout_s: float,
               stop: threading.Event | None) -> subprocess.CompletedProcess[str]:
    """Run one stage in its own process group; kill the group on timeout or stop."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=err, text=True,
                                start_new_session=True, preexec_fn=_die_with_parent_hook())
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    code = proc.wait(timeout=0.2)
                    break
                except subprocess.TimeoutExpired:
                    if stop is not None and stop.is_set():
                        raise Interrupted("stopping: smoke run abandoned") from None
                    if time.monotonic() > deadline:
                        raise
        finally:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(argv, code, out.read(), err.read())


def materialize(repo_git, base: str, files: dict[str, str], dst: Path) -> None:
    """The tree of `base` with `files` overwritten, written to `dst`."""
    data = repo_git.archive(base, format="tar", output_stream=None, as_process=False, stdout_as_string=False)
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(dst, filter="data")
    for path, text in files.items():
        target = dst / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)


class SmokeRunner:
    """Runs smoke stages in a warm worker, started on first use; `close()` stops it."""

    def __init__(self, lab: Lab):
        self.lab = lab
        self._executor: Any = None

    def executor(self) -> Any:
        if self._executor is None:
            from pipeline.executors.local import LocalExecutor

            logs = self.lab.state / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            self._executor = LocalExecutor(cpus=self.lab.config.run.cpus, slots=1, worker_log=logs / "smoke-worker.log")
        return self._executor

    def run_stage(self, argv: list[str], cwd: Path, out: Path, log: Path, timeout_s: float,
                  stop: threading.Event | None) -> tuple[int, str]:
        """(exit code, output tail) of one stage; raises SmokeFailed on timeout or signal, Interrupted on stop."""
        from pipeline.executors import ExecutorError, StageJob

        job = StageJob(job_id=uuid.uuid4().hex, argv=argv, cwd=cwd, commit="smoke", out=out, log_path=log,
                       timeout_s=timeout_s, cpus=self.lab.config.run.cpus, memory_mb=self.lab.config.run.memory_mb)
        try:
            ex = self.executor()
            ex.submit(job)
        except ExecutorError as e:
            log.write_text(f"(smoke worker unavailable: {e}; running as a subprocess)\n")
            return self._subprocess(argv, cwd, timeout_s, stop)
        while True:
            for res in ex.poll(0.2):
                if res.job_id != job.job_id:
                    continue
                tail = log.read_text(errors="replace")[-3000:] if log.is_file() else ""
                if res.status == "timeout":
                    raise SmokeFailed(f"timed out after {timeout_s:.0f} s on tiny data:\n{tail}")
                if res.status == "signal":
                    raise SmokeFailed(f"killed by signal {res.signal}:\n{tail}")
                if res.status == "cancelled":
                    raise Interrupted("stopping: smoke run abandoned")
                if res.status == "infra":  # the worker died, not the candidate: run it on its own
                    return self._subprocess(argv, cwd, timeout_s, stop)
                return int(res.exit_code or 0), tail
            if stop is not None and stop.is_set():
                ex.cancel(job.job_id)
                ex.poll(2.0)
                raise Interrupted("stopping: smoke run abandoned")

    def _subprocess(self, argv: list[str], cwd: Path, timeout_s: float,
                    stop: threading.Event | None) -> tuple[int, str]:
        from pipeline.executors.base import thread_env

        env = scrub_env(os.environ) | thread_env(self.lab.config.run.cpus)
        argv = list(argv)
        if argv and argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        try:
            proc = _run_stage(argv, cwd, env, timeout_s, stop)
        except subprocess.TimeoutExpired:
            raise SmokeFailed(f"timed out after {timeout_s:.0f} s on tiny data") from None
        except OSError as e:
            raise SmokeFailed(f"could not start: {e}") from None
        return proc.returncode, (proc.stdout + proc.stderr)[-3000:]

    def close(self) -> None:
        if self._executor is not None:
            self._executor.close()
            self._executor = None


def smoke_run(lab: Lab, repo_git, base: str, files: dict[str, str], timeout_s: float = 300.0,
              stop: threading.Event | None = None, runner: SmokeRunner | None = None) -> float:
    """Run every stage once (first task, seed 0) on tiny data; return the metric or raise SmokeFailed."""
    bench = lab.config.benchmark
    harness = get_harness(bench.harness)
    prepared = harness.prepare(lab.state, bench.suite, bench.data_seed, SMOKE_CUSTOMERS)
    task = lab.tasks()[0]
    own = runner is None
    runner = runner or SmokeRunner(lab)
    try:
        with tempfile.TemporaryDirectory(prefix="smoke-", dir=lab.state) as tmp:
            code, outs, logs = Path(tmp) / "code", Path(tmp) / "out", Path(tmp) / "logs"
            materialize(repo_git, base, files, code)
            logs.mkdir()
            values = {"data": str(prepared.public), "task": task, "seed": "0"}
            for stage in lab.stages_in_order():
                out = outs / stage.name
                out.mkdir(parents=True)
                argv = render(stage.run, values | {"out": str(out)})
                try:
                    exit_code, tail = runner.run_stage(argv, code, out, logs / f"{stage.name}.log", timeout_s, stop)
                except SmokeFailed as e:
                    raise SmokeFailed(f"stage {stage.name} {e}") from None
                if exit_code != 0:
                    raise SmokeFailed(f"stage {stage.name} exited with {exit_code}:\n{tail}")
                values[stage.name] = str(out)
            try:
                return harness.score(prepared, task, outs / lab.stages_in_order()[-1].name / "predictions.csv")
            except PredictionsError as e:
                raise SmokeFailed(f"predictions.csv on tiny data: {e}") from None
    finally:
        if own:
            runner.close()
