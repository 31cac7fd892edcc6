"""The GPUs of this machine, shared by share: who holds which GPU, and how busy each one is.

`[run] gpus` is a share of one GPU (0.25: four stages on one GPU) or a count of whole GPUs (1..8).
One `GpuPool` per process (`GpuPool.shared()`) hands out the visible GPUs to every stage that runs
here: the local executor's slots, the smoke run's stages, and `prepare`/`score` when the lab gives
them a GPU; a stage that finds no room waits for it, so nothing oversubscribes a GPU. Fractions are
placed on the least-loaded GPU that fits them (or the next, where that one would break a rule
below); whole GPUs are taken only when nobody holds them.

Two rules keep everyone served. A waiter from outside the driver's executor (a smoke stage, a
`prepare`) is *wanted*: the driver's executor, which takes a freed share back at once, yields while
that share would no longer fit (`yield_to_waiters`), so the next freed share goes to the waiter, not
to the queue's next run. And the driver's executor keeps `keep` placeable (the share of `prepare` and
`score`, which the driver's own thread runs between its stages: it must not wait for shares only it
can give back). A stage retried alone after a CUDA out-of-memory closes its GPU to other stages;
where the driver's share has no other place, it leaves that share free on it.

`GpuSampler` asks NVML (the `nvidia-ml-py` package, `pynvml`; optional) every half second how busy
each GPU is, and charges each sample to the stages holding that GPU: a stage's mean utilisation, and
the GPUs' busy share of the loop's wall time. Without NVML it samples nothing and says so.

Standard library only (NVML is imported where it is used).
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

EPS = 1e-6
SAMPLE_S = 0.5
# what CUDA, PyTorch and cuBLAS/cuDNN print when a GPU's memory runs out
CUDA_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory|CUBLAS_STATUS_ALLOC_FAILED"
                      r"|CUDNN_STATUS_ALLOC_FAILED|cudaErrorMemoryAllocation")
MPS_PROCESSES = ("nvidia-cuda-mps-control", "nvidia-cuda-mps-server")


def _candidates(used: dict[str, float], share: float, alone: bool = False,
                closed: frozenset[str] | set[str] = frozenset()) -> list[tuple[list[str], float]]:
    """Where a stage of `share` may go given `used` (GPU → share held), most preferred first, with
    what it holds of each GPU: a fraction on the least-loaded GPU that fits it (spread: a stage runs
    fastest with the fewest neighbours), then on the others in order of load; whole GPUs (or a
    fraction run alone) on GPUs nobody holds. `closed` GPUs (held by a stage run alone) take no fraction."""
    ids = list(used)
    if share >= 1 or alone:
        free = [g for g in ids if used[g] <= EPS]
        need = max(1, int(round(share)))
        return [(free[:need], 1.0)] if len(free) >= need else []
    fits = [g for g in ids if g not in closed and used[g] + share <= 1 + EPS]
    return [([g], share) for g in sorted(fits, key=lambda g: (used[g], ids.index(g)))]


def _place(used: dict[str, float], share: float, alone: bool = False,
           closed: frozenset[str] | set[str] = frozenset()) -> tuple[list[str], float] | None:
    """The preferred place of a stage of `share` (`_candidates`), or None if none fits."""
    found = _candidates(used, share, alone, closed)
    return found[0] if found else None


def _after(used: dict[str, float], placed: tuple[list[str], float]) -> dict[str, float]:
    after = dict(used)
    for g in placed[0]:
        after[g] += placed[1]
    return after


def _fits(used: dict[str, float], shares: list[float], closed: frozenset[str] | set[str] = frozenset()) -> bool:
    """Whether every share in `shares` can still be placed, largest first."""
    for share in sorted(shares, reverse=True):
        placed = _place(used, share, closed=closed)
        if placed is None:
            return False
        used = _after(used, placed)
    return True


def capacity(share: float, n_gpus: int, keep: float = 0.0) -> int:
    """How many stages of `share` run at once on `n_gpus` GPUs while `keep` stays placeable (each
    placed where `GpuPool.take` would place it: the preferred GPU that leaves room for `keep`)."""
    used = {str(i): 0.0 for i in range(n_gpus)}
    count = 0
    while share > 0:
        ok = [p for p in _candidates(used, share) if not keep or _fits(_after(used, p), [keep])]
        if not ok:
            break
        used, count = _after(used, ok[0]), count + 1
    return count


@dataclass
class Holding:
    ids: list[str]
    share: float  # of each GPU in `ids`
    alone: bool  # holds its GPU whole, whatever its share (a retry after a CUDA out-of-memory)
    crowded: bool = False  # shared a GPU with another holder at some point
    since: float = field(default_factory=time.monotonic)


class GpuPool:
    """Shares of the GPUs `ids` (CUDA_VISIBLE_DEVICES names), thread-safe."""

    _shared: dict[tuple[str, ...], "GpuPool"] = {}
    _shared_lock = threading.Lock()

    def __init__(self, ids: list[str]):
        self.ids = list(ids)
        self._used = {g: 0.0 for g in self.ids}
        self._holdings: dict[str, Holding] = {}
        self._wanted: dict[str, float] = {}  # holders waiting from outside the driver's executor
        self._closed: dict[str, str] = {}  # GPU → the stage that runs alone on it
        self._lock = threading.Lock()
        self.changed = threading.Condition(self._lock)
        self._sampler: GpuSampler | None = None

    @classmethod
    def shared(cls, ids: list[str]) -> "GpuPool":
        """The one pool of this process for these GPUs: the driver's executor and the smoke run share it."""
        key = tuple(ids)
        with cls._shared_lock:
            if key not in cls._shared:
                cls._shared[key] = cls(ids)
            return cls._shared[key]

    def take(self, holder: str, share: float, *, alone: bool = False, keep: float = 0.0,
             yield_to_waiters: bool = False, wait: bool = False, reserved: bool = False) -> list[str] | None:
        """The GPUs given to `holder` for a stage of `share`, or None if they are not free now.

        `keep`: a share that must stay placeable after this one (the driver's `prepare`/`score`);
        `yield_to_waiters`: so must every other holder's wanted share; `wait`: a None makes `holder`
        wanted (until it takes, or `forget`). `alone` (a retry after a CUDA out-of-memory): a GPU
        nobody holds, closed to every other stage while it runs; where `keep` has no other place,
        it holds that GPU but `keep`, which only a `reserved` taker (`prepare`, `score`) may use."""
        with self._lock:
            if holder in self._holdings:
                return list(self._holdings[holder].ids)
            closed = frozenset() if reserved else frozenset(self._closed)
            needs = [w for h, w in self._wanted.items() if h != holder] if yield_to_waiters else []
            options = _candidates(self._used, share, alone, closed)
            if alone and keep and 0 < keep < 1:
                options += [(ids, 1.0 - keep) for ids, _ in options]
            placed = None
            for ids, each in options:
                after = _after(self._used, (ids, each))
                shut = set(self._closed) | (set(ids) if alone else set())
                if keep:  # placed first (`prepare`/`score` may use a closed GPU's room), then the waiters
                    kept = _place(after, keep)
                    if kept is None:
                        continue
                    after = _after(after, kept)
                if needs and not _fits(after, needs, shut):
                    continue
                placed = (ids, each)
                break
            if placed is None:
                if wait:
                    self._wanted.setdefault(holder, share)
                return None
            self._wanted.pop(holder, None)
            ids, used = placed
            holding = Holding(ids, used, alone)
            for other in self._holdings.values():
                if set(other.ids) & set(ids):
                    other.crowded = holding.crowded = True
            for g in ids:
                self._used[g] += used
                if alone:
                    self._closed[g] = holder
            self._holdings[holder] = holding
            return list(ids)

    def wait_take(self, holder: str, share: float, *, alone: bool = False, stop: threading.Event | None = None,
                  timeout: float | None = None, reserved: bool = False) -> list[str] | None:
        """`take`, wanted until the GPUs are free (None if `stop` is set or `timeout` passes first)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                got = self.take(holder, share, alone=alone, wait=True, reserved=reserved)
                if got is not None or (stop is not None and stop.is_set()):
                    return got
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                with self._lock:
                    self.changed.wait(0.2)
        finally:
            self.forget(holder)

    def forget(self, holder: str) -> None:
        """`holder` no longer waits (it took its GPUs, gave up, or was cancelled)."""
        with self._lock:
            self._wanted.pop(holder, None)

    def give_back(self, holder: str) -> Holding | None:
        with self._lock:
            self._wanted.pop(holder, None)
            holding = self._holdings.pop(holder, None)
            if holding is not None:
                for g in holding.ids:
                    self._used[g] = max(0.0, self._used[g] - holding.share)
                    if self._closed.get(g) == holder:
                        del self._closed[g]
                self.changed.notify_all()
            return holding

    def holding(self, holder: str) -> Holding | None:
        with self._lock:
            return self._holdings.get(holder)

    def holders_of(self, gpu: str) -> list[str]:
        with self._lock:
            return [h for h, held in self._holdings.items() if gpu in held.ids]

    def used(self) -> dict[str, float]:
        with self._lock:
            return dict(self._used)

    def sampler(self) -> "GpuSampler":
        """This pool's one utilisation sampler, started on first use (idle without NVML)."""
        with self._lock:
            if self._sampler is None:
                self._sampler = GpuSampler(self)
        return self._sampler.start()


def is_cuda_oom(log_tail: str) -> bool:
    return bool(CUDA_OOM.search(log_tail))


def note_retry_alone(log_path: Any) -> None:
    """Say in a stage's log that its CUDA OOM on a shared GPU is run again with the GPU alone."""
    with open(log_path, "a") as fh:
        fh.write("\nautoresearch: CUDA out of memory on a GPU shared with other stages; "
                 "running this stage again with the GPU alone\n")


def mps_running(proc: str = "/proc") -> bool:
    """Whether the CUDA Multi-Process Service runs on this machine (its control daemon or server)."""
    try:
        names = [n for n in os.listdir(proc) if n.isdigit()]
    except OSError:
        return False
    for pid in names:
        try:
            with open(f"{proc}/{pid}/comm") as fh:
                if fh.read().strip() in MPS_PROCESSES:
                    return True
        except OSError:
            continue
    return False


def _nvml() -> Any:
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver here (pynvml.NVMLError and friends)
        return None
    return pynvml


@dataclass
class StageUse:
    samples: int = 0
    util_sum: float = 0.0

    @property
    def util(self) -> float | None:
        return self.util_sum / self.samples if self.samples else None


class GpuSampler:
    """A thread sampling each GPU's utilisation every `interval` s through NVML, charging each sample
    to the pool's holders of that GPU. `available` is False (and nothing is sampled) without NVML."""

    def __init__(self, pool: GpuPool, interval: float = SAMPLE_S):
        self.pool = pool
        self.interval = interval
        self.nvml = _nvml()
        self._handles: dict[str, Any] = {}
        if self.nvml is not None:
            for g in pool.ids:
                try:
                    self._handles[g] = (self.nvml.nvmlDeviceGetHandleByUUID(g) if g.startswith(("GPU-", "MIG-"))
                                        else self.nvml.nvmlDeviceGetHandleByIndex(int(g)))
                except Exception:
                    continue
        # per GPU, as a Ray node counts them (`ray_task.GpuWatch`): one of 8 GPUs busy is 12.5 % busy
        self.samples = 0  # GPU samples (a GPU's utilisation read at one instant)
        self.busy = 0  # of them, with the GPU busy (utilisation > 0)
        self.util_sum = 0.0  # of their utilisation
        self._stages: dict[str, StageUse] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return bool(self._handles)

    def start(self) -> "GpuSampler":
        if self.available and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        utils: dict[str, float] = {}
        for g, handle in self._handles.items():
            try:
                utils[g] = float(self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except Exception:
                continue
        if not utils:
            return
        with self._lock:
            self.samples += len(utils)
            self.busy += sum(u > 0 for u in utils.values())
            self.util_sum += sum(utils.values())
            for g, u in utils.items():
                for holder in self.pool.holders_of(g):
                    use = self._stages.setdefault(holder, StageUse())
                    use.samples += 1
                    use.util_sum += u

    def stage_done(self, holder: str) -> StageUse | None:
        """The samples charged to `holder` (forgotten here)."""
        with self._lock:
            return self._stages.pop(holder, None)

    def summary(self) -> dict[str, float | int | None]:
        with self._lock:
            n = self.samples
            return {"samples": n, "busy": self.busy, "util_sum": self.util_sum,
                    "busy_share": self.busy / n if n else None, "mean_util": self.util_sum / n if n else None}

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
