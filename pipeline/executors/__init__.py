"""Executors: where stage processes run. To add one, implement `Executor` (base.py) in a module and
register a factory in `EXECUTORS` (one line below; a plugin or a test: `EXECUTORS.register(name, factory)`).

- `local` (default): warm forked workers on this machine (local.py).
- `ray`: tasks on a Ray cluster (ray_executor.py); Ray is imported only when chosen.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.executors.base import (
    ExecutorError,
    Executor,
    JobResult,
    StageJob,
    UserError,
    classify,
    scrub_env,
)
from pipeline.registry import Registry

if TYPE_CHECKING:
    from pipeline.lab import Lab

ExecutorFactory = Callable[..., Executor]
"""(lab, *, workers, ray_address, preload) → an executor sized from the lab's `[run]`."""


def _preload(run: Any, asked: tuple[str, ...] | None, default: tuple[str, ...]) -> tuple[str, ...]:
    """What the warm worker imports once: the caller's list, else `[run] preload`, else torch and peft."""
    if asked is not None:
        return asked
    return default if run.preload is None else tuple(run.preload)


def _local(lab: "Lab", *, workers: int | None, ray_address: str | None, preload: tuple[str, ...] | None) -> Executor:
    from pipeline.executors.local import DEFAULT_PRELOAD, LocalExecutor

    run = lab.config.run
    logs = lab.state / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    from pipeline.lab import local_slots, memory_plan

    # with [run] memory_mb unset: the machine's share per slot, less the slot's tmpfs (lab.MemoryPlan)
    plan = memory_plan(run, workers if workers is not None else local_slots(run))
    return LocalExecutor(cpus=run.cpus, gpus=run.gpus, slots=workers,
                         preload=_preload(run, preload, DEFAULT_PRELOAD), worker_log=Path(logs) / "worker.log",
                         default_memory_mb=plan.memory_mb, reserve=max(run.prepare_gpus, run.score_gpus))


def _ray(lab: "Lab", *, workers: int | None, ray_address: str | None, preload: tuple[str, ...] | None) -> Executor:
    from pipeline.executors.ray_executor import RayExecutor
    from pipeline.worktrees import Worktrees

    run = lab.config.run
    from pipeline.executors.local import DEFAULT_PRELOAD

    return RayExecutor(Worktrees(lab.root, lab.state), address=ray_address, cpus=run.cpus, gpus=run.gpus,
                       slots=workers, preload=_preload(run, preload, DEFAULT_PRELOAD),
                       memory_mb=run.memory_mb)


# name → factory: `--executor NAME`. A new executor is one module and one line here.
EXECUTORS: Registry[ExecutorFactory] = Registry("executor", {"local": _local, "ray": _ray}, error=UserError)


def make_executor(kind: str, lab: "Lab", *, workers: int | None = None,
                  ray_address: str | None = None, preload: tuple[str, ...] | None = None) -> Executor:
    """The executor the CLI's `--executor/--workers/--ray-address` ask for, sized from `[run]`."""
    return EXECUTORS.get(kind)(lab, workers=workers, ray_address=ray_address, preload=preload)


__all__ = ["Executor", "ExecutorError", "UserError", "JobResult", "StageJob", "classify", "scrub_env",
           "make_executor", "EXECUTORS"]
