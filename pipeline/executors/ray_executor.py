"""The Ray executor: the same stage jobs on a Ray cluster (`--executor ray --ray-address ...`).

Each slot is a warm worker actor (`ray_task.WarmWorker`, holding `run.cpus` CPUs and `run.gpus`
GPUs): it starts the local executor's warm worker on its node once — torch and peft imported once
— and forks one child per stage, so dispatch costs what it costs locally, not a cold interpreter.
The stage's code view (the commit's files it may see) and each input folder (dataset, upstream
outputs) travel as tars put in the object store once per folder; a node unpacks each at most
once, with the driver's link-safe extraction (`safefs.extract_tar`, shipped as source), and the
driver unpacks a stage's output with it too. The stage runs in the same sandbox as locally (child.py, sandbox.py and zygote.py shipped as
source), over the node's local copies. The stage's output comes back as a tar and is unpacked into the
driver's private output folder, so publishing to the cache is the same as for local runs.

Failures Ray reports (actor died, node died, object lost) are infrastructure failures, and the slot
gets a fresh actor; the stage's own exit status is classified exactly as locally. Ray's own retries are off: the driver
retries with the same seed and counts it.
"""

from __future__ import annotations

import hashlib
import inspect
import io
import os
import shutil
import tarfile
from collections import OrderedDict, deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline import safefs
from pipeline.errors import InfrastructureFailure
from pipeline.executors import child, ray_task, sandbox, zygote
from pipeline.executors.base import (
    STAGE_ENV,
    STAGE_ENV_PREFIXES,
    JobResult,
    StageJob,
    thread_env,
)
from pipeline.executors.gpus import capacity
from pipeline.executors.local import DEFAULT_PRELOAD

if TYPE_CHECKING:
    from pipeline.worktrees import Worktrees


MAX_PINNED_INPUTS = 256  # input folders kept in the object store for reuse by later stages
WARM_TIMEOUT_S = 300.0  # a node importing torch and peft takes seconds; a worker Ray cannot place, for ever
AUTH_HINT = ("Ray 2.60 turns token authentication on: start the cluster and run the loop with "
             "RAY_AUTH_MODE=disabled, or give both the same token")


def node_sources() -> dict[str, str]:
    """The modules a node's warm worker runs from, as source (`ray_task.WarmWorker`'s `sources`)."""
    return {"child": inspect.getsource(child), "sandbox": inspect.getsource(sandbox),
            "zygote": inspect.getsource(zygote), "safefs": inspect.getsource(safefs)}


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail in one line, at once, when nothing listens at a `host:port` or `ray://host:port`
    address (Ray itself retries a wrong address for minutes)."""
    import socket

    if address == "auto" or address.startswith("local"):
        return
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise InfrastructureFailure(f"Ray address {address!r}: expected host:port (or ray://host:port)")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise InfrastructureFailure(f"cannot connect to Ray at {address}: {e.strerror or e} "
                             "(is the cluster up? `ray start --head` prints its address)") from None


class RayExecutor:
    """Run stages as Ray tasks. Connects to `address` (or RAY_ADDRESS), or starts a local Ray."""

    name = "ray"

    def __init__(self, worktrees: "Worktrees", *, address: str | None = None, cpus: int = 1, gpus: float = 0,
                 slots: int | None = None, init_kwargs: dict[str, Any] | None = None,
                 preload: tuple[str, ...] | list[str] = DEFAULT_PRELOAD, memory_mb: int | None = None):
        try:
            import ray
        except ImportError:
            raise InfrastructureFailure("the ray executor needs Ray: pip install 'ray[default]'") from None
        self.ray = ray
        self.worktrees = worktrees
        self.cpus, self.gpus, self.memory_mb = cpus, gpus, memory_mb
        self._owns_ray = False
        if not ray.is_initialized():
            address = address or os.environ.get("RAY_ADDRESS") or None
            if address:
                check_reachable(address)
            kwargs = {"include_dashboard": False, "log_to_driver": False, **(init_kwargs or {})}
            try:
                ray.init(address=address, **kwargs)
            except (ConnectionError, RuntimeError, ValueError) as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise InfrastructureFailure(f"cannot connect to Ray at {address or 'a new local instance'}: {first}"
                                     + (f" ({AUTH_HINT})" if "auth" in str(e).lower() else "")) from None
            self._owns_ray = True
        ray.cloudpickle.register_pickle_by_value(ray_task)  # nodes need Ray, not our package
        resources = ray.cluster_resources()
        by_cpu = int(resources.get("CPU", 1)) // cpus
        if gpus:  # a share (num_gpus = 0.25: Ray packs four on a GPU) or whole GPUs
            by_cpu = min(by_cpu, capacity(gpus, int(resources.get("GPU", 0) + 1e-6)))
        self._slots = slots if slots is not None else max(1, by_cpu)
        self._sources = node_sources()
        self._preload = list(preload)
        self._actor_cls = ray.remote(ray_task.WarmWorker)
        # input folder → (id, object ref), least recently used first: a loop that runs for weeks must
        # not pin every checkpoint it ever shipped in the object store
        self._inputs: OrderedDict[str, tuple[str, Any]] = OrderedDict()
        self._refs: dict[str, tuple[Any, StageJob, Any]] = {}  # job id → (ref, job, its worker)
        self._waiting: deque[tuple[StageJob, dict[str, Any], list[Any], list[Any]]] = deque()
        self._cancelled: list[JobResult] = []
        self._idle: deque[Any] = deque(self._new_worker() for _ in range(self._slots))
        try:  # each imports torch and peft once, in parallel; an actor Ray cannot place never starts
            ray.get([w.warm.remote() for w in self._idle], timeout=WARM_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            self.close()
            raise InfrastructureFailure(
                f"the cluster did not start {self._slots} warm worker(s) of {cpus} CPU / {gpus:g} GPU each in "
                f"{WARM_TIMEOUT_S:.0f} s (resources: {dict(resources)}); lower --workers or [run] cpus/gpus") from None

    def _new_worker(self) -> Any:
        """A warm worker actor: it holds `run.cpus` CPUs and `run.gpus` GPUs of a node (Ray sets the
        actor's CUDA_VISIBLE_DEVICES, which its stages inherit) for as long as the executor lives."""
        options: dict[str, Any] = {"num_cpus": self.cpus, "num_gpus": self.gpus, "max_restarts": 0,
                                   "max_concurrency": 2}  # a cancel may arrive while a stage runs
        if self.memory_mb:
            options["memory"] = self.memory_mb * 2**20
        return self._actor_cls.options(**options).remote(self._sources, self._preload, sorted(STAGE_ENV),
                                                          list(STAGE_ENV_PREFIXES))

    @property
    def slots(self) -> int:
        return self._slots

    def _input(self, folder: Path) -> tuple[str, Any]:
        """(id, ref) for an input folder. Folders the driver hands out (dataset by id, cache entries
        by key) never change once written; the id still hashes names, sizes and mtimes, so a node's
        unpacked copy can never stand for different content at a reused path."""
        key = str(folder.resolve())
        if key in self._inputs:
            self._inputs.move_to_end(key)
        else:
            h = hashlib.sha256(key.encode())
            for p in sorted(folder.rglob("*")):
                st = p.lstat()  # a symlink (even a dangling one) counts as itself
                h.update(f"{p.relative_to(folder)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
            self._inputs[key] = (h.hexdigest()[:24], self.ray.put(ray_task.pack(key)))
            while len(self._inputs) > MAX_PINNED_INPUTS:  # a job in flight holds its own refs
                self._inputs.popitem(last=False)
        return self._inputs[key]

    def submit(self, job: StageJob) -> None:
        if job.job_id in self._refs or any(w[0].job_id == job.job_id for w in self._waiting):
            raise InfrastructureFailure(f"job {job.job_id} already submitted")
        mounts = []
        for folder in job.inputs:
            ident, ref = self._input(folder)
            mounts.append((str(folder), ident, [ref]))
        tree_id, tree_ref = self._input(job.cwd)  # the stage's code view, not the whole commit
        spec = {
            "job_id": job.job_id, "tree_id": tree_id, "argv": job.argv, "cwd": str(job.cwd),
            "sandbox": job.sandbox, "gpus": job.gpus,
            "out": str(job.out), "timeout_s": job.timeout_s, "cpus": job.cpus, "memory_mb": job.memory_mb,
            "env": thread_env(job.cpus) | job.env,  # the lab's `[run] env`: the driver's values
            "env_allow": sorted(STAGE_ENV), "env_prefixes": list(STAGE_ENV_PREFIXES),
        }
        self._waiting.append((job, spec, [tree_ref], mounts))
        self._dispatch()

    def _dispatch(self) -> None:
        while self._waiting and self._idle:
            job, spec, tree, mounts = self._waiting.popleft()
            worker = self._idle.popleft()
            self._refs[job.job_id] = (worker.run.remote(spec, tree, mounts), job, worker)

    def poll(self, timeout: float = 0.0) -> list[JobResult]:
        done, self._cancelled = self._cancelled, []
        if not self._refs:
            return done
        ray = self.ray
        by_ref = {ref: job_id for job_id, (ref, _, _) in self._refs.items()}
        ready, rest = ray.wait(list(by_ref), num_returns=1, timeout=0 if done else timeout)
        if ready and rest:
            more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
            ready += more
        done += [self._collect(by_ref[ref]) for ref in ready]
        self._dispatch()
        return done

    def _collect(self, job_id: str) -> JobResult:
        ref, job, worker = self._refs.pop(job_id)
        ray = self.ray
        try:
            res: dict[str, Any] = ray.get(ref)
        except ray.exceptions.RayError as e:  # the actor or its node died, an object was lost
            try:
                ray.kill(worker)
            except (ray.exceptions.RayError, ValueError):  # already gone with its node
                pass
            self._idle.append(self._new_worker())  # the slot gets a fresh warm worker
            return JobResult(job_id, "infra", detail=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
        self._idle.append(worker)
        job.log_path.parent.mkdir(parents=True, exist_ok=True)
        job.log_path.write_bytes(res["log"])
        if res["status"] == "ok":
            job.out.mkdir(parents=True, exist_ok=True)
            try:  # no entry written through a link; a link, hard link or device refused
                safefs.extract_tar(io.BytesIO(res["out"]), job.out, what="the stage's output")
            except (tarfile.TarError, OSError) as e:  # the stage's doing: nothing of it is kept (its links neither)
                shutil.rmtree(job.out, ignore_errors=True)  # rmtree never follows a link
                with open(job.log_path, "ab") as log:
                    log.write(f"\nray executor: output not kept: {e}\n".encode())
                return JobResult(job_id, "exit", exit_code=1, cpu_s=float(res["cpu_s"]), wall_s=float(res["wall_s"]),
                                 host=res["host"], detail=f"output not kept: {str(e)[:200]}")
        return JobResult(job_id, res["status"], exit_code=res["exit_code"], signal=res["signal"],
                         cpu_s=float(res["cpu_s"]), wall_s=float(res["wall_s"]), host=res["host"],
                         detail=res.get("detail"))

    def gpu_usage(self) -> dict[str, object] | None:
        return None  # nothing samples the GPUs of Ray's nodes (NVML runs where the stage does)

    def cancel(self, job_id: str) -> None:
        for i, (job, *_rest) in enumerate(self._waiting):
            if job.job_id == job_id:
                del self._waiting[i]
                self._cancelled.append(JobResult(job_id, "cancelled", detail="cancelled"))
                return
        entry = self._refs.get(job_id)
        if entry is not None:
            entry[2].cancel.remote(job_id)  # its warm worker kills the stage; run() then returns

    def close(self) -> None:
        for job_id in list(self._refs):
            self.cancel(job_id)
        if self._refs:
            self.ray.wait([r for r, _, _ in self._refs.values()], num_returns=len(self._refs), timeout=10)
        for worker in [*self._idle, *(w for _, _, w in self._refs.values())]:
            try:
                self.ray.kill(worker)
            except (self.ray.exceptions.RayError, ValueError):  # its node is gone
                pass
        self._refs.clear()
        self._idle.clear()
        self._waiting.clear()
        self._inputs.clear()
        if self._owns_ray:
            self.ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> "RayExecutor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
