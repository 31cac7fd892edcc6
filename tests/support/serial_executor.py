"""A toy executor from outside the pipeline, in one file: one stage at a time, each in a fresh
interpreter through child.py (so in the same sandbox), run to the end inside `submit`. Its own
option (`ExecutorOptions.extra`, `--executor-option interpreter=PATH` on the CLI): the Python that
runs each stage. Registered by a test with `EXECUTORS.register("serial", make)`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.errors import UserError
from pipeline.executors import ExecutorOptions, JobResult, StageJob

REPO = Path(__file__).resolve().parents[2]
OPTIONS = ("interpreter",)


def make(lab: Any, opts: ExecutorOptions) -> "SerialExecutor":
    """The registry's factory: the lab and one options object, as every executor's."""
    unknown = sorted(set(opts.extra) - set(OPTIONS))
    if unknown:
        raise UserError(f"executor serial: unknown option {unknown[0]!r}; expected one of {list(OPTIONS)}")
    return SerialExecutor(opts.extra.get("interpreter", sys.executable))


class SerialExecutor:
    """A toy executor: one stage at a time, each in a fresh interpreter through child.py (so in the
    same sandbox), run to the end inside `submit`."""

    name = "serial"

    def __init__(self, interpreter: str = sys.executable) -> None:
        self.interpreter = interpreter
        self.done: list[JobResult] = []
        self.submitted = 0

    @property
    def slots(self) -> int:
        return 1

    def submit(self, job: StageJob) -> None:
        self.submitted += 1
        spec = {"argv": job.argv, "cwd": str(job.cwd), "env": {"PATH": "/usr/bin:/bin"}, "log": str(job.log_path),
                "cpus": job.cpus, "memory_mb": job.memory_mb, "sandbox": job.sandbox}
        t0 = time.monotonic()
        proc = subprocess.run([self.interpreter, "-m", "pipeline.executors.child", json.dumps(spec)], cwd=REPO,
                              timeout=job.timeout_s)
        status = "ok" if proc.returncode == 0 else "exit"
        self.done.append(JobResult(job.job_id, status, exit_code=proc.returncode, wall_s=time.monotonic() - t0))

    def poll(self, timeout: float = 0.0) -> list[JobResult]:
        done, self.done = self.done, []
        return done

    def cancel(self, job_id: str) -> None:
        pass

    def close(self) -> None:
        pass
