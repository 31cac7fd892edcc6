"""Executors: where stage processes run. To add one, implement `Executor` (base.py) in a module and
register a factory in `EXECUTORS` (one line below; a plugin or a test: `EXECUTORS.register(name, factory)`).
A factory takes the lab and one `ExecutorOptions`; an executor's own settings (a Slurm partition, a
queue) travel in its `extra`, so no caller between the CLI and the factory knows them.

- `local` (default): warm forked workers on this machine (local.py).
- `ray`: tasks on a Ray cluster (ray_executor.py); Ray is imported only when chosen.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.executors.base import (
    Executor,
    InfrastructureFailure,
    JobResult,
    StageJob,
    UserError,
    classify,
    scrub_env,
)
from pipeline.registry import Registry

if TYPE_CHECKING:
    from pipeline.lab import Lab



@dataclass(frozen=True)
class ExecutorOptions:
    """What the caller chooses of the executor (`--executor`, `--workers`, `--address`); the rest
    comes from the lab's `[run]`. `extra`: an executor's own options, by name, for its factory only."""

    kind: str = "local"  # a name in EXECUTORS
    workers: int | None = None  # run slots (default: the executor's, from `[run]` and the machine)
    address: str | None = None  # the cluster to join (Ray: `ray://…` or `host:port`; None: the executor's default)
    preload: tuple[str, ...] | None = None  # what a warm worker imports once (default: `[run] preload`)
    extra: Mapping[str, str] = field(default_factory=dict)

    def with_(self, **changes: object) -> "ExecutorOptions":
        return replace(self, **changes)  # type: ignore[arg-type]


ExecutorFactory = Callable[["Lab", ExecutorOptions], Executor]
"""(lab, options) → an executor sized from the lab's `[run]`."""


def _preload(run: Any, asked: tuple[str, ...] | None, default: tuple[str, ...]) -> tuple[str, ...]:
    """What the warm worker imports once: the caller's list, else `[run] preload`, else torch and peft."""
    if asked is not None:
        return asked
    return default if run.preload is None else tuple(run.preload)


def _no_extra(opts: ExecutorOptions) -> None:
    """The built-in executors take no option of their own: one named is a mistake, said in one line."""
    if opts.extra:
        raise UserError(f"executor {opts.kind}: unknown option {sorted(opts.extra)[0]!r}; it takes none")


def _local(lab: "Lab", opts: ExecutorOptions) -> Executor:
    from pipeline.executors.local import DEFAULT_PRELOAD, LocalExecutor

    _no_extra(opts)
    run = lab.config.run
    logs = lab.state / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    from pipeline.memory import local_slots, memory_plan

    # with [run] memory_mb unset: the machine's share per slot, less the slot's tmpfs (pipeline.memory.MemoryPlan)
    plan = memory_plan(run, opts.workers if opts.workers is not None else local_slots(run))
    return LocalExecutor(cpus=run.cpus, gpus=run.gpus, slots=opts.workers,
                         preload=_preload(run, opts.preload, DEFAULT_PRELOAD), worker_log=Path(logs) / "worker.log",
                         default_memory_mb=plan.memory_mb, reserve=max(run.prepare_gpus, run.score_gpus))


def _ray(lab: "Lab", opts: ExecutorOptions) -> Executor:
    from pipeline.executors.ray_executor import RayExecutor

    _no_extra(opts)
    run = lab.config.run
    from pipeline.executors.local import DEFAULT_PRELOAD

    return RayExecutor(address=opts.address, cpus=run.cpus, gpus=run.gpus,
                       slots=opts.workers, preload=_preload(run, opts.preload, DEFAULT_PRELOAD),
                       memory_mb=run.memory_mb, harness_gpus=max(run.prepare_gpus, run.score_gpus))


# name → factory: `--executor NAME`. A new executor is one module and one line here.
EXECUTORS: Registry[ExecutorFactory] = Registry("executor", {"local": _local, "ray": _ray}, error=UserError)


def check_executor(name: str) -> None:
    """`UserError` naming the executors if `name` is none of them (nothing is built or imported)."""
    if name not in EXECUTORS:
        EXECUTORS.get(name)


def make_executor(opts: ExecutorOptions | str, lab: "Lab", **changes: object) -> Executor:
    """The executor `opts` asks for (or `ExecutorOptions(kind=opts, **changes)` for a name), sized from `[run]`."""
    opts = ExecutorOptions(kind=opts) if isinstance(opts, str) else opts
    opts = opts.with_(**changes) if changes else opts
    return EXECUTORS.get(opts.kind)(lab, opts)


__all__ = ["Executor", "InfrastructureFailure", "UserError", "JobResult", "StageJob", "classify", "scrub_env",
           "make_executor", "check_executor", "EXECUTORS", "ExecutorOptions", "ExecutorFactory"]
