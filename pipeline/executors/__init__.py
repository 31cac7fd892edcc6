"""Executors: where stage processes run. To add one, implement `Executor` (base.py) and list it here.

- `local` (default): warm forked workers on this machine (local.py).
- `ray`: tasks on a Ray cluster (ray_executor.py); Ray is imported only when chosen.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pipeline.executors.base import (
    ExecutorError,
    Executor,
    JobResult,
    StageJob,
    UnknownExecutorError,
    classify,
    scrub_env,
)

if TYPE_CHECKING:
    from pipeline.lab import Lab

EXECUTORS = ("local", "ray")


def make_executor(kind: Literal["local", "ray"] | str, lab: "Lab", *, workers: int | None = None,
                  ray_address: str | None = None, preload: tuple[str, ...] | None = None) -> Executor:
    """The executor the CLI's `--executor/--workers/--ray-address` ask for, sized from `[run]`."""
    run = lab.config.run
    if kind == "local":
        from pipeline.executors.local import DEFAULT_PRELOAD, LocalExecutor

        logs = lab.state / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        return LocalExecutor(cpus=run.cpus, gpus=run.gpus, slots=workers,
                             preload=DEFAULT_PRELOAD if preload is None else preload,
                             worker_log=Path(logs) / "worker.log")
    if kind == "ray":
        from pipeline.executors.ray_executor import RayExecutor
        from pipeline.worktrees import Worktrees

        return RayExecutor(Worktrees(lab.root, lab.state), address=ray_address, cpus=run.cpus, gpus=run.gpus,
                           slots=workers)
    raise UnknownExecutorError(f"unknown executor {kind!r}; expected one of {list(EXECUTORS)}")


__all__ = ["Executor", "ExecutorError", "UnknownExecutorError", "JobResult", "StageJob", "classify", "scrub_env", "make_executor", "EXECUTORS"]
