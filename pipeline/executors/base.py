"""The executor interface: submit a stage, poll for finished stages, cancel one. Nothing more.

An executor knows nothing about runs, caches or stores; the driver (`pipeline.runner`) does. That
keeps a new executor (Slurm, Kubernetes...) to one small class: turn a `StageJob` into a
`JobResult`, reporting *what happened to the process*. Whether that is the method's fault or the
machinery's is decided in one place, `classify`.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from pipeline.errors import InfrastructureFailure, UserError  # noqa: F401 (re-exported: the executors raise them)
from pipeline.executors.child import THREAD_VARS
from pipeline.outcomes import StageOutcome

JobStatus = Literal["ok", "exit", "signal", "timeout", "cancelled", "infra"]

# The only variables a stage inherits from the driver, plus the lab's `[run] env` names: an allow-list,
# since no deny-list knows every way a secret is spelled (MYSQL_PWD, PGPASS, REDIS_URL=redis://:pw@host).
# HOME and TMPDIR are the sandbox's own inside it (child.run); the thread counts are set by thread_env.
STAGE_ENV = frozenset({
    "PATH", "LANG", "LANGUAGE", "TZ", "HOME", "TMPDIR", "TERM", *THREAD_VARS,
    "CUDA_VISIBLE_DEVICES",  # the executor's (or Ray's) choice of GPUs for the stage
    # the interpreter's own switches (PYTHONPATH: how the warm worker imports the harness)
    "PYTHONPATH", "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONIOENCODING",
    "PYTHONUTF8", "PYTHONNOUSERSITE", "PYTHONWARNINGS", "PYTHONFAULTHANDLER",
})
STAGE_ENV_PREFIXES = ("LC_",)  # locale
# signals the machinery sends (OOM killer, node shutdown, a human's kill): not the method's fault
INFRA_SIGNALS = {signal.SIGKILL, signal.SIGTERM, signal.SIGHUP, signal.SIGINT}

# The stage environment's version. Raise it with any change to what a stage process sees or may do
# (the sandbox's binds, limits, /dev/shm, GPU variables, thread pools) that can make the same code
# fail where it passed or pass where it failed. Each execution records it (`StageExec.env`), and a
# method failure recorded under another version is not trusted (`Store.method_failures`): after an
# upgrade that fixed a crash of the tool's own making, the stage runs again instead of failing every
# run that needs its key. It is part of the measurement environment (`pipeline.environment`) too:
# raising it changes every cache key, and the loop re-measures its baseline at its next start.
# 2026-12-07: GPU stages without RLIMIT_AS, /dev/shm by share, /sys for multi-GPU stages, a Ray CUDA OOM retried.
STAGE_ENV_VERSION = "stage-env-2026-12-07"


def scrub_env(env: dict[str, str] | os._Environ[str], keep: Iterable[str] = ()) -> dict[str, str]:
    """The part of `env` a stage may see: the allow-list `STAGE_ENV` (and `LC_*`), plus the names in
    `keep`. Branch code is written by an LLM: it gets nothing else to leak."""
    allowed = STAGE_ENV | set(keep)
    return {k: v for k, v in env.items() if k in allowed or k.startswith(STAGE_ENV_PREFIXES)}


def lab_env(names: Iterable[str]) -> dict[str, str]:
    """The values, in the driver's environment, of the names a lab's `[run] env` lets its stages see."""
    return {k: os.environ[k] for k in names if k in os.environ}


def thread_env(cpus: int) -> dict[str, str]:
    return {name: str(cpus) for name in THREAD_VARS}


@dataclass(frozen=True)
class StageJob:
    """One stage process to run.

    `argv` is already rendered with this machine's paths; `cwd` is the stage's code view (the
    files it may see); `inputs` lists the folders it reads (the dataset, upstream outputs) so that
    an executor on other machines can ship them, and `out` is where its output must end up (an
    empty private folder). `sandbox` names the same paths for the sandbox the process runs in.
    """

    job_id: str
    argv: list[str]
    cwd: Path
    commit: str
    out: Path
    log_path: Path
    timeout_s: float
    cpus: int = 1
    gpus: float = 0  # a share of one GPU (< 1) or whole GPUs
    memory_mb: int | None = None
    inputs: tuple[Path, ...] = ()
    sandbox: dict[str, object] | None = None  # the mounts and limits of sandbox.enter; None: opted out
    env: dict[str, str] = field(default_factory=dict)  # the lab's `[run] env` (lab_env), over the allow-list


@dataclass(frozen=True)
class JobResult:
    """What happened to a stage process. `cpu_s` counts the stage and the children it waited for."""

    job_id: str
    status: JobStatus
    exit_code: int | None = None
    signal: int | None = None
    cpu_s: float = 0.0
    wall_s: float = 0.0
    detail: str | None = None
    host: str | None = None
    extra: dict[str, object] = field(default_factory=dict)


def classify(result: JobResult) -> tuple[StageOutcome, str | None]:
    """Method failure or infrastructure failure? (the stage's outcome, `pipeline.outcomes`, and the
    result's kind).

    Non-zero exit, a crash signal (segfault, abort) and a timeout are the branch's code: recorded
    as results the gate sees. A killed worker or a signal from outside is the machinery: retried
    with the same seed.
    """
    if result.status == "ok":
        return StageOutcome.OK, None
    if result.status == "exit":
        return StageOutcome.METHOD, "crash"
    if result.status == "timeout":
        return StageOutcome.TIMEOUT, "timeout"
    if result.status == "cancelled":
        return StageOutcome.CANCELLED, None
    if result.status == "signal":
        if result.signal in INFRA_SIGNALS:
            return StageOutcome.INFRA, "signal"
        return StageOutcome.METHOD, "signal"
    return StageOutcome.INFRA, "infra"


class Executor(Protocol):
    """Runs stage jobs. `slots` is how many it runs at once; the driver never submits more. An
    executor whose stages run on other machines may have `facts`: what they measure with
    (`environment.node_facts`); without it, the driver's own machine is."""

    name: str

    @property
    def slots(self) -> int: ...

    def submit(self, job: StageJob) -> None: ...

    def poll(self, timeout: float = 0.0) -> list[JobResult]:
        """Results of jobs finished since the last call; waits up to `timeout` for the first."""
        ...

    def cancel(self, job_id: str) -> None: ...

    def gpu_usage(self, wait: bool = False) -> dict[str, object] | None:
        """The GPU sampler's running totals (`gpus.GpuSampler.summary`, with `holder` and `gpus`), or
        None where nothing samples the GPUs this executor gives out. `wait`: the driver's last call
        (it closes): an executor whose samples come from elsewhere may wait a moment for the latest."""
        ...

    def close(self) -> None: ...


