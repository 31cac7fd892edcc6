"""What bounds a stage's memory on this machine: `[run]`'s keys and the machine's MemTotal and
cores, turned into one `MemoryPlan` (the RLIMIT_AS in force and the tmpfs sizes beside it) that the
local executor, `prepare`/`score` and `status` share."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.lab import RunSection

MEMORY_SHARE = 0.8  # of the machine's memory, split between the local executor's slots


def mem_total_mb(meminfo: str = "/proc/meminfo") -> int | None:
    try:
        with open(meminfo) as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def local_slots(run: "RunSection") -> int:
    """The local executor's default slots (cores ÷ `cpus`; `--workers` may say otherwise)."""
    return max(1, (os.cpu_count() or 1) // run.cpus)


@dataclass(frozen=True)
class MemoryPlan:
    """What bounds one stage's memory. No cgroup v2 is used (not delegated everywhere): `memory_mb`
    is an RLIMIT_AS on the stage's processes, and its tmpfs (/tmp, /dev/shm, {out}: RAM the rlimit
    does not count) have fixed sizes, so one slot holds at most `memory_mb` + `tmpfs_mb`; with
    `memory_mb` unset (and no GPU) the default makes that MEMORY_SHARE of the machine ÷ slots."""

    memory_mb: int | None  # the RLIMIT_AS in force; None: none (GPU stages: CUDA maps huge address space)
    source: str  # "set" ([run] memory_mb), "default" (from the machine), "none"
    tmp_mb: int
    shm_mb: int
    out_mb: int
    slots: int
    budget_mb: int | None  # MEMORY_SHARE of MemTotal ÷ slots

    @property
    def tmpfs_mb(self) -> int:
        return self.tmp_mb + self.shm_mb + self.out_mb

    @property
    def within_budget(self) -> bool | None:
        if self.budget_mb is None or self.memory_mb is None:
            return None
        return self.memory_mb + self.tmpfs_mb <= self.budget_mb

    def describe(self) -> str:
        tmpfs = f"tmpfs /tmp {self.tmp_mb} MB, /dev/shm {self.shm_mb} MB, out {self.out_mb} MB"
        if self.memory_mb is None:
            head = "no rlimit (a GPU stage: CUDA needs the address space)"
        else:
            head = f"rlimit {self.memory_mb} MB per stage ({'[run] memory_mb' if self.source == 'set' else 'default'})"
        tail = "no cgroup v2 delegation"
        if self.budget_mb is not None:
            tail += f"; bound {self.budget_mb} MB per slot, {self.slots} slot(s)"
            if self.within_budget is False:
                tail += f", EXCEEDED by {self.memory_mb + self.tmpfs_mb - self.budget_mb} MB"
        return f"memory: {head} + {tmpfs} ({tail})"

    def to_json(self) -> dict[str, Any]:
        return {"mode": "rlimit+tmpfs" if self.memory_mb is not None else "tmpfs", "cgroup": False,
                "memory_mb": self.memory_mb, "source": self.source, "tmp_mb": self.tmp_mb,
                "shm_mb": self.shm_mb, "out_mb": self.out_mb, "slots": self.slots, "budget_mb": self.budget_mb,
                "within_budget": self.within_budget, "text": self.describe()}


def memory_plan(run: "RunSection", slots: int | None = None, total_mb: int | None = None,
                with_out: bool = True) -> MemoryPlan:
    """The memory bound of a stage under `run` on this machine (`total_mb`: MemTotal, read if None);
    `with_out` False: a process with no `{out}` tmpfs (`prepare`, `score`), whose share keeps that part."""
    slots = slots if slots is not None else local_slots(run)
    total = total_mb if total_mb is not None else mem_total_mb()
    budget = int(total * MEMORY_SHARE / slots) if total else None
    out_mb = run.out_max_mb if with_out else 0
    tmpfs = run.tmp_max_mb + run.shm_size_mb() + out_mb
    if run.gpus or (run.memory_mb is None and budget is None):  # CUDA cannot start under an RLIMIT_AS
        mem, source = None, "none"
    elif run.memory_mb is not None:
        mem, source = run.memory_mb, "set"
    else:  # what the slot's share leaves after its tmpfs, never under 1 GB (status then says EXCEEDED)
        mem, source = max(1024, budget - tmpfs), "default"
    return MemoryPlan(mem, source, run.tmp_max_mb, run.shm_size_mb(), out_mb, slots, budget)
