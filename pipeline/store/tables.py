"""The store's rows and value types (`pipeline.store` says why a database, and how it is split).

- `Arm`: a commit under measurement (baseline or challenger).
- `Run`: one (commit, task, seed), unique; also the queue: `status` moves queued → running →
  done | failed, claimed atomically by a conditional UPDATE that carries an owner (host, pid, process
  start time) and a claim token. Only the holder of the current token can finish or requeue it, so a
  driver presumed dead that wakes up cannot write a second result.
- `StageExec`: one stage of one run, executed or served from the cache: CPU, GPU and wall seconds,
  outcome. Goodput is computed from these rows.
- `Result`: the run's metric, or the reason it has none; unique per run and per (commit, task, seed).
- `HarnessExec`: one call of the harness in the driver (`prepare` a dataset, `score` a run on the gate
  split or the holdout): what it spent.
- `SmokeExec`: one smoke run (a candidate on tiny data before it is measured): what it spent, how it ended.
- `CacheEntry`: what a cached stage output cost to compute, so a cache hit knows what it saved.
- `GateRecord`: the gate's records (any JSON payload) keyed by hypothesis, look and kind.
- `StoreLab`: the lab the store belongs to (a store holds one lab's state).

Times are UNIX seconds (floats): comparable across SQLite and PostgreSQL and plain in JSON.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import JSON, Column, Index, Text, UniqueConstraint
from sqlmodel import Field, SQLModel


# the words of Run.status, StageExec.outcome and Result.outcome, and what each means: pipeline/outcomes.py
from pipeline.outcomes import METHOD_OUTCOMES, ResultOutcome, RunStatus, StageOutcome  # noqa: F401 (re-exported)


def now() -> float:
    return time.time()


class Arm(SQLModel, table=True):
    """A commit under measurement. `label` is a human name (branch or tag) at the time it was queued."""

    __tablename__ = "arm"
    commit: str = Field(primary_key=True, max_length=64)
    label: str | None = None
    created_at: float = Field(default_factory=now)


class Run(SQLModel, table=True):
    """One (commit, task, seed) measurement and its place in the queue."""

    __tablename__ = "run"
    __table_args__ = (UniqueConstraint("commit", "task", "seed", name="uq_run_commit_task_seed"),
                      # `goodput`'s retry counts, summed from this index, not from a year's rows
                      Index("ix_run_retries", "infra_failures", "requeues"))
    id: int | None = Field(default=None, primary_key=True)
    commit: str = Field(foreign_key="arm.commit", index=True, max_length=64)
    task: str
    seed: int
    status: str = Field(default="queued", index=True)
    priority: int = 0
    infra_failures: int = 0  # stage attempts lost to the machinery, retried with the same seed
    requeues: int = 0  # times a dead driver's claim was taken back
    owner_host: str | None = None
    owner_pid: int | None = None
    owner_started: float | None = None
    claim_token: str | None = None
    heartbeat_at: float | None = None
    queued_at: float = Field(default_factory=now)
    started_at: float | None = None
    finished_at: float | None = None
    dataset_id: str | None = None


class StageExec(SQLModel, table=True):
    """One stage of one run: executed, served from the cache, or failed; with the compute it used."""

    __tablename__ = "stage_exec"
    # `goodput` (every `status`) sums a year's 730,000 rows by outcome from this covering index: 0.13 s
    # instead of 0.63 s (SQLite; the table's rows are 5× wider and were sorted by outcome first)
    __table_args__ = (Index("ix_stage_exec_goodput", "outcome", "cpu_s", "saved_cpu_s", "gpu_s", "started_at"),)
    id: int | None = Field(default=None, primary_key=True)
    run_id: int = Field(foreign_key="run.id", index=True)
    stage: str
    key: str = Field(index=True)
    outcome: str = StageOutcome.RUNNING  # a StageOutcome
    executor: str = "local"
    host: str | None = None
    cpu_s: float = 0.0
    gpu_s: float = 0.0
    wall_s: float = 0.0
    saved_cpu_s: float = 0.0  # for cache_hit/shared: the compute the original execution took
    exit_code: int | None = None
    signal: int | None = None
    detail: str | None = None
    log_path: str | None = None
    started_at: float = Field(default_factory=now)
    finished_at: float | None = None
    env: str | None = None  # its stage environment (executors.base.STAGE_ENV_VERSION); None: not kept then
    gpu_share: float | None = None  # the GPU share it was launched with (what a dead driver's loss is charged)


class StageGpu(SQLModel, table=True):
    """How busy its GPUs were while one stage execution held them (NVML samples; none without NVML)."""

    __tablename__ = "stage_gpu"
    exec_id: int = Field(foreign_key="stage_exec.id", primary_key=True)
    util: float  # mean utilisation, %, of the samples charged to the stage
    samples: int


class FdrTest(SQLModel, table=True):
    """One comparison as a test of the lab's stream (`[gate] online_fdr`, pipeline.gate.online_fdr):
    its index, the level it was given once and for all, and whether its gate made a discovery."""

    __tablename__ = "fdr_test"
    __table_args__ = (UniqueConstraint("challenger", "baseline", name="uq_fdr_test_pair"),)
    id: int | None = Field(default=None, primary_key=True)
    challenger: str = Field(max_length=64)
    baseline: str = Field(max_length=64)
    index: int = Field(unique=True)  # 1, 2, ... in the order the comparisons were first judged
    alpha: float
    discoveries_before: int
    assigned_at: float = Field(default_factory=now)
    discovered_at: float | None = None  # when a look of it said `improvement`


class GpuUsage(SQLModel, table=True):
    """What one process's GPU sampler (`pipeline.executors.gpus.GpuSampler`) saw over one interval
    (written every `runner.GPU_USAGE_EVERY_S`, added to one row for `gpu_accounting.GPU_USAGE_ROW_S`):
    its samples, taken every half second from its first GPU stage on, and how many found a GPU busy."""

    __tablename__ = "gpu_usage"
    __table_args__ = (Index("ix_gpu_usage_sums", "updated_at", "samples", "busy", "util_sum"),)  # `goodput`'s
    id: int | None = Field(default=None, primary_key=True)
    holder: str = Field(index=True)  # host:pid:start of the sampling executor
    gpus: str  # the GPUs it sampled, comma-separated
    started_at: float  # the interval's start (the previous row's end)
    updated_at: float = Field(default_factory=now, index=True)  # its end
    samples: int = 0
    busy: int = 0  # samples at which any of its GPUs was busy (utilisation > 0)
    util_sum: float = 0.0  # of the GPUs' mean utilisation at each sample


class SmokeExec(SQLModel, table=True):
    """One smoke run (`pipeline.smoke`): a candidate's whole pipeline on tiny data before a run of it
    is queued. The CPU seconds and GPU-seconds (share × wall) of its stages and of the harness's calls
    for it (its dataset's `prepare`, its `score`), its wall time from start to end, the span in which
    its stages held a GPU, and how it ended: `ok`, `method` (rejected: the candidate's code failed),
    `infra` (anything else failed: the machinery, the lab's own configuration; nothing is recorded
    against the hypothesis) or `interrupted`."""

    __tablename__ = "smoke_exec"
    id: int | None = Field(default=None, primary_key=True)
    hypothesis: str | None = Field(default=None, index=True)  # the agent's hypothesis id, if it said
    base: str = Field(max_length=64)  # the commit the candidate's files apply to
    outcome: str
    executor: str = "here"  # this machine, or the executor that lent it a slot (`ray`)
    stages: int = 0  # stage attempts: one lost to the machinery and run again counts twice
    cpu_s: float = 0.0
    gpu_s: float = 0.0
    wall_s: float = 0.0
    started_at: float = Field(default_factory=now, index=True)
    gpu_from: float | None = None  # its first GPU stage's start and its last one's end (a GPU lab)
    gpu_to: float | None = None


SMOKE_OUTCOMES = ("ok", "method", "infra", "interrupted")


class HarnessExec(SQLModel, table=True):
    """One call of the harness by a driver: `prepare` (a dataset, once per data seed), `score` (a run's
    predictions on the gate split) or `holdout` (a baseline run's on the holdout; a `prepare` that found its
    dataset made is not a row). The CPU seconds of
    the processes it ran (and of the driver's own thread: an in-process scorer), their GPU-seconds
    (`prepare_gpus`/`score_gpus` × wall), its wall time, and whether it gave an answer (`ok`) or not
    (`failed`: the predictions were refused, the command failed)."""

    __tablename__ = "harness_exec"
    id: int | None = Field(default=None, primary_key=True)
    kind: str  # prepare | score | holdout
    run_id: int | None = Field(default=None, index=True)  # the run scored (None for prepare)
    outcome: str = "ok"
    cpu_s: float = 0.0
    gpu_s: float = 0.0
    wall_s: float = 0.0
    started_at: float = Field(default_factory=now, index=True)


class Result(SQLModel, table=True):
    """A run's metric (`value`), or why it has none (`outcome`, `kind`, `detail`). Written once."""

    __tablename__ = "result"
    __table_args__ = (UniqueConstraint("commit", "task", "seed", name="uq_result_commit_task_seed"),)
    id: int | None = Field(default=None, primary_key=True)
    run_id: int = Field(foreign_key="run.id", unique=True)
    commit: str = Field(index=True, max_length=64)
    task: str
    seed: int
    value: float | None = None
    outcome: str = ResultOutcome.OK  # a ResultOutcome
    kind: str | None = None  # crash, timeout, signal, predictions, nan, memory, infra
    detail: str | None = None
    dataset_id: str | None = None
    env_id: str | None = Field(default=None, max_length=32)  # its measurement environment (MeasureEnv); None: unknown
    cpu_s: float = 0.0  # compute executed for this run (cache hits excluded)
    created_at: float = Field(default_factory=now)


class MeasureEnv(SQLModel, table=True):
    """A measurement environment (`pipeline.environment`): the Python, the distributions that count
    and the GPU models a result was measured with (`doc`, JSON), by its id."""

    __tablename__ = "measure_env"
    id: str = Field(primary_key=True, max_length=32)
    doc: str = Field(sa_column=Column(Text, nullable=False))
    first_seen: float = Field(default_factory=now)


class BaselineCommit(SQLModel, table=True):
    """A commit measured as a baseline (its own runs, re-verification, variance study): only its runs
    are scored on a harness's sealed holdout."""

    __tablename__ = "baseline_commit"
    commit: str = Field(primary_key=True, max_length=64)
    marked_at: float = Field(default_factory=now)


class Comparison(SQLModel, table=True):
    """A challenger commit measured against a baseline commit on the baseline's seed block: the
    lab's history of paired differences (the `paired` protocol's prior, `variance --pair`)."""

    challenger: str = Field(primary_key=True, max_length=64)
    baseline: str = Field(primary_key=True, max_length=64)
    created_at: float = Field(default_factory=now)


class HoldoutScore(SQLModel, table=True):
    """A baseline run's score on the sealed holdout split (`Harness` in harness/base.py). Only the runs of commits in
    `baseline_commit` (the first baseline, the champions) are scored on it; it is read by status,
    the digest and the progress chart, never by the gate, the agent or a prompt."""

    __tablename__ = "holdout_score"
    run_id: int = Field(foreign_key="run.id", primary_key=True)
    commit: str = Field(index=True, max_length=64)
    task: str
    seed: int
    value: float
    created_at: float = Field(default_factory=now)


class CacheEntry(SQLModel, table=True):
    """A published stage output: what it cost, so later hits can count the compute they saved."""

    __tablename__ = "cache_entry"
    key: str = Field(primary_key=True)
    stage: str
    commit: str
    cpu_s: float = 0.0
    wall_s: float = 0.0
    created_at: float = Field(default_factory=now)
    env_id: str | None = Field(default=None, max_length=32)  # where it was made (MeasureEnv); None: unknown


class CacheUse(SQLModel, table=True):
    """A cache entry's size on disk and when it was last used: what LRU eviction reads."""

    __tablename__ = "cache_use"
    key: str = Field(primary_key=True)
    size_bytes: int = 0
    used_at: float = Field(default_factory=now, index=True)
    evicted_at: float | None = None


class StoreLab(SQLModel, table=True):
    """The lab whose state the store holds (one row): its repository's first commit, the same in every
    clone of it, and its name and folder when the store was first opened, for the message that refuses
    another lab. Two labs in one database would mix hypotheses, baselines and the one-driver lease."""

    __tablename__ = "store_lab"
    id: int = Field(default=1, primary_key=True)
    root_commit: str = Field(max_length=64)
    name: str
    path: str
    claimed_at: float = Field(default_factory=now)


class GateRecord(SQLModel, table=True):
    """The gate's output at one look of one hypothesis; `payload` is the gate's own JSON record."""

    __tablename__ = "gate_record"
    __table_args__ = (UniqueConstraint("hypothesis", "look", "kind", name="uq_gate_record"),)
    id: int | None = Field(default=None, primary_key=True)
    hypothesis: str = Field(index=True)
    look: int
    kind: str = "verdict"
    payload: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    created_at: float = Field(default_factory=now)


@dataclass(frozen=True)
class Owner:
    """Who holds a claim: enough to tell, from the same host, whether that process still exists.

    The process start time guards against a recycled pid looking alive.
    """

    host: str
    pid: int
    started: float

    @classmethod
    def current(cls) -> "Owner":
        import psutil

        return cls(socket.gethostname(), os.getpid(), psutil.Process().create_time())

    def same(self, other: "Owner | None") -> bool:
        return other is not None and (self.host, self.pid) == (other.host, other.pid) and abs(
            self.started - other.started) < 1.0

    def alive(self) -> bool | None:
        """True/False on this host; None when the owner is on another host (use the heartbeat)."""
        if self.host != socket.gethostname():
            return None
        import psutil

        try:
            proc = psutil.Process(self.pid)
            return abs(proc.create_time() - self.started) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False


@dataclass(frozen=True)
class Claim:
    """A claimed run: its row as it was claimed and the token that proves ownership."""

    run: Run
    token: str


@dataclass(frozen=True)
class Goodput:
    """Where the compute went. Seconds are CPU seconds unless named otherwise.

    useful: stages that ran to completion (their outputs are cached and feed results);
    method_failed: stages whose branch code failed (the measurement of a bad idea; not waste of the
    machinery but not progress either); infra_lost: attempts lost to the machinery (killed workers,
    dead drivers) that had to be retried; saved_by_cache: what cache hits would have cost;
    smoke: what the smoke runs that screened candidates spent; harness: what preparing the datasets
    and scoring the runs spent in the drivers (both counted apart).
    """

    useful_cpu_s: float
    method_failed_cpu_s: float
    infra_lost_cpu_s: float
    saved_by_cache_cpu_s: float
    gpu_s: float
    stages_executed: int
    cache_hits: int
    infra_retries: int
    requeues: int
    # GPU-seconds (a stage's share of its GPUs × its wall time) by what the stage came to
    useful_gpu_s: float = 0.0
    method_failed_gpu_s: float = 0.0
    infra_lost_gpu_s: float = 0.0
    # the GPU samplers' (NVML): samples taken and the share of them that found a GPU busy
    gpu_samples: int = 0
    gpu_busy_share: float | None = None
    gpu_mean_util: float | None = None
    # smoke runs (`SmokeExec`): screening, before anything is measured; beside the figures above,
    # not in them (goodput is of the measuring runs' stages)
    smoke_runs: int = 0
    smoke_rejected: int = 0  # ended `method`: the candidate's code failed on tiny data
    smoke_cpu_s: float = 0.0
    smoke_gpu_s: float = 0.0
    smoke_wall_s: float = 0.0
    # the harness's calls in the drivers (`HarnessExec`): preparing datasets, scoring runs; apart too
    harness_calls: int = 0
    harness_cpu_s: float = 0.0
    harness_gpu_s: float = 0.0

    @property
    def goodput(self) -> float:
        """Fraction of spent compute that was useful (1.0 when nothing ran)."""
        spent = self.useful_cpu_s + self.method_failed_cpu_s + self.infra_lost_cpu_s
        return self.useful_cpu_s / spent if spent > 0 else 1.0

    def as_dict(self) -> dict[str, float | int]:
        out: dict[str, float | int] = dict(self.__dict__)
        out["goodput"] = self.goodput
        return out
