"""The local executor: N slots on this machine, stages forked from a warm worker.

slots = cores ÷ run.cpus (overridable), and no more than the GPUs hold: `run.gpus` is a share of one
GPU (0.25: four stages per GPU) or whole GPUs, handed out by the process's `gpus.GpuPool`, which the
smoke run shares; a stage whose GPUs are taken waits here (submitted, not yet started). A stage that
runs out of CUDA memory on a GPU it shared is run again with that GPU alone before its failure
counts (a neighbour must not fail a hypothesis). One warm worker (`zygote.py`) holds torch and peft in
memory and forks per stage; it enforces timeouts with a process-group kill and reports each
stage's CPU seconds from `wait4`. If the worker dies, every stage it was running is reported as an
infrastructure failure and a fresh worker starts on the next submit.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import pipeline
from pipeline.disk import read_tail
from pipeline.executors.base import InfrastructureFailure, JobResult, StageJob, UserError, scrub_env, thread_env
from pipeline.executors.gpus import GpuPool, capacity, is_cuda_oom, note_retry_alone

DEFAULT_PRELOAD = ("numpy", "torch", "peft")
READY_TIMEOUT_S = 180.0


def _package_root() -> str:
    return str(Path(pipeline.__file__).resolve().parent.parent)


_LISTED: list[str] = []  # what nvidia-smi listed, once per process (the pool is keyed by it)


def visible_gpus() -> list[str]:
    """GPU ids this process may use: CUDA_VISIBLE_DEVICES if set, else what nvidia-smi lists (asked
    once per process: a later answer that differs, or none after a timeout, would make a second
    pool of the same GPUs, and each `prepare`/`score` would wait for nvidia-smi)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g for g in env.split(",") if g.strip() and g.strip() != "-1"]
    if _LISTED:
        return list(_LISTED)
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    _LISTED[:] = [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]
    return list(_LISTED)


def inside_gpu_ids(gpu_ids: list[str], fallback: str) -> str:
    """CUDA_VISIBLE_DEVICES for a sandboxed stage assigned `gpu_ids` (see `sandbox.gpu_plan`);
    `fallback` where they cannot be mapped (the sandbox then refuses to start, in one line)."""
    from pipeline.executors.sandbox import gpu_devices

    try:
        return ",".join(gpu_devices(gpu_ids)[1])
    except OSError:  # the sandbox refuses a GPU it cannot map (ENODEV)
        return fallback


class LocalExecutor:
    """Run stages on this machine. Create once per driver; `close()` stops the warm worker."""

    name = "local"

    def __init__(self, *, cpus: int = 1, gpus: float = 0, slots: int | None = None,
                 preload: tuple[str, ...] | list[str] = DEFAULT_PRELOAD, worker_log: Path | None = None,
                 default_memory_mb: int | None = None, pool: GpuPool | None = None, reserve: float = 0.0,
                 priority: bool = False):
        self.cpus = cpus
        self.default_memory_mb = default_memory_mb  # a job's memory_mb when it names none (pipeline.memory.memory_plan)
        self.gpus = gpus
        self.gpu_ids = (pool.ids if pool is not None else visible_gpus()) if gpus else []
        by_cpu = max(1, (os.cpu_count() or 1) // cpus)
        self.pool: GpuPool | None = None
        # `reserve`: the GPU share the driver's own thread needs between stages (`prepare`, `score`),
        # kept free of stages; `priority`: a smoke run's executor, which the driver's yields to
        self.reserve, self.priority = (reserve if gpus else 0.0), priority
        if gpus:
            if capacity(gpus, len(self.gpu_ids)) < 1:
                raise InfrastructureFailure(f"run.gpus = {gpus:g} but {len(self.gpu_ids)} GPU(s) are visible")
            if capacity(gpus, len(self.gpu_ids), self.reserve) < 1:
                raise UserError(f"[run] gpus = {gpus:g} on {len(self.gpu_ids)} GPU(s) leaves no room for "
                                f"prepare_gpus/score_gpus = {self.reserve:g}, which the driver runs between its "
                                "stages; lower one of them")
            by_cpu = min(by_cpu, capacity(gpus, len(self.gpu_ids), self.reserve))
            self.pool = pool if pool is not None else GpuPool.shared(self.gpu_ids)
        self._slots = slots if slots is not None else by_cpu
        if self._slots < 1:
            raise InfrastructureFailure(f"slots must be at least 1, got {self._slots}")
        self.preload = list(preload)
        self.worker_log = worker_log
        self.host = socket.gethostname()
        # the stages' (and the warm worker's) environment: decided once, the allow-listed part of ours
        self.base_env = scrub_env(os.environ) | thread_env(cpus)
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_at = time.time()  # names this executor's GPU samples in the store, with host and pid
        self._usage_from: dict[str, float | int | None] | None = None  # the pool sampler's totals then
        self.worker_threads: list[str] = []  # the warm worker's threads when it was ready (one: fork-safe)
        self._buf = b""
        self._running: dict[str, StageJob] = {}  # submitted: sent to the worker, or waiting for GPUs
        self._waiting: list[tuple[StageJob, bool]] = []  # (job, alone) until the pool has their GPUs
        self._retried: dict[str, dict[str, object]] = {}  # a shared GPU's CUDA OOM, run again alone
        self._gpu_of: dict[str, list[str]] = {}
        self._done: list[JobResult] = []

    @property
    def slots(self) -> int:
        return self._slots

    # --- warm worker --------------------------------------------------------------------------

    def _start(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        env = self.base_env | thread_env(1)  # no thread pool started before a fork (zygote.py)
        # no GPU while it imports its preloads: a library that starts CUDA there would hold every GPU's
        # device open, inherited by each stage it forks (a stage sets its own GPUs before it starts CUDA)
        env["CUDA_VISIBLE_DEVICES"] = ""
        root = _package_root()
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        stderr = open(self.worker_log, "ab") if self.worker_log else None
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "pipeline.executors.zygote", json.dumps({"preload": self.preload})],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, env=env, cwd=root,
            )
        finally:
            if stderr is not None:
                stderr.close()
        self._proc, self._buf = proc, b""
        assert proc.stdout is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            msgs = self._read(max(0.0, deadline - time.monotonic()))
            ready = [m for m in msgs if m.get("event") == "ready"]
            if ready:
                self.worker_threads = list(ready[0].get("threads") or [])  # type: ignore[arg-type]
                return proc
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                self._proc = None
                raise InfrastructureFailure(
                    f"warm worker did not start (exit {proc.returncode}); preload {self.preload}"
                    + (f", see {self.worker_log}" if self.worker_log else "")
                )

    def _read(self, timeout: float) -> list[dict[str, object]]:
        """Read whatever protocol lines are available, waiting up to `timeout` for the first."""
        proc = self._proc
        if proc is None or proc.stdout is None:
            return []
        fd = proc.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], timeout)
        msgs: list[dict[str, object]] = []
        while ready:
            data = os.read(fd, 1 << 16)
            if not data:
                self._worker_died()
                break
            self._buf += data
            ready, _, _ = select.select([fd], [], [], 0)
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            if line.strip():
                msgs.append(json.loads(line))
        return msgs

    def _worker_died(self) -> None:
        proc = self._proc
        self._proc = None
        if proc is not None:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
        self._forget_waiting()
        for job_id in list(self._running):
            self._finish(JobResult(job_id, "infra", detail=f"warm worker died (exit {proc.returncode if proc else '?'})",
                                   host=self.host))

    def _finish(self, result: JobResult) -> None:
        self._running.pop(result.job_id, None)
        extra = dict(result.extra)
        if self._gpu_of.pop(result.job_id, None) is not None and self.pool is not None:
            held = self.pool.give_back(result.job_id)
            if held is not None:  # the GPUs it held: its share, or its GPU (but the reserve) when it ran alone
                extra["gpu_share"] = held.share * len(held.ids)
                if not result.wall_s:  # lost with the worker, or cancelled: it held them until now
                    result = JobResult(**{**result.__dict__, "wall_s": time.monotonic() - held.since})
            use = self.pool.sampler().stage_done(result.job_id)
            if use is not None and use.util is not None:
                extra["gpu_util"], extra["gpu_samples"] = use.util, use.samples
        if result.job_id in self._retried:
            extra["gpu_oom_retried_alone"] = self._retried.pop(result.job_id)
        if extra != result.extra:
            result = JobResult(**{**result.__dict__, "extra": extra})
        self._done.append(result)

    def warm(self) -> None:
        """Start the warm worker now (it imports torch and peft: seconds) rather than on first submit."""
        self._start()

    # --- Executor interface -------------------------------------------------------------------

    def submit(self, job: StageJob) -> None:
        if job.job_id in self._running:
            raise InfrastructureFailure(f"job {job.job_id} already submitted")
        self._start()
        self._running[job.job_id] = job
        self._waiting.append((job, False))
        self._dispatch()

    def _dispatch(self) -> None:
        """Send the worker every waiting job whose GPUs the pool can give now, in order."""
        waiting, self._waiting = self._waiting, []
        for i, (job, alone) in enumerate(waiting):
            if job.job_id not in self._running:  # finished meanwhile (the worker died under a send)
                continue
            if job.gpus:
                if self.pool is None:
                    self._finish(JobResult(job.job_id, "infra", detail="no GPU on this executor", host=self.host))
                    continue
                sampler = self.pool.sampler()  # sampling from the first GPU stage on (idle without NVML)
                if self._usage_from is None:  # ours are the samples from now on
                    self._usage_from = sampler.summary()
                # first come, first served: no GPU stage overtakes one that waits
                if self._waiting or self.pool.take(job.job_id, job.gpus, alone=alone, keep=self.reserve,
                                                   yield_to_waiters=not self.priority, wait=self.priority) is None:
                    self._waiting.append((job, alone))
                    continue
            try:
                self._send(job)
            except Exception as e:  # e.g. its log folder cannot be made: the job's infrastructure failure
                self._gpu_of.pop(job.job_id, None)
                if self.pool is not None:
                    self.pool.give_back(job.job_id)
                self._finish(JobResult(job.job_id, "infra", detail=f"cannot start the stage: {e}", host=self.host))
            if self._proc is None:  # the worker died under the send: every job it had is finished
                self._waiting += waiting[i + 1:]
                self._forget_waiting()
                return

    def _forget_waiting(self) -> None:
        if self.pool is not None:
            for job, _ in self._waiting:
                self.pool.forget(job.job_id)
        self._waiting = []

    def _send(self, job: StageJob) -> None:
        proc = self._start() if self._proc is None else self._proc
        spec = self.stage_spec(job)
        msg = json.dumps({"op": "run", "id": job.job_id, "spec": spec, "timeout_s": job.timeout_s}) + "\n"
        assert proc.stdin is not None
        try:
            proc.stdin.write(msg.encode())
            proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self._worker_died()

    def stage_spec(self, job: StageJob) -> dict[str, object]:
        """The child's spec for `job` (environment, limits, sandbox); assigns its GPUs. A sandboxed
        stage gets only its own GPUs' device nodes (`sandbox.gpu_plan`), so its
        CUDA_VISIBLE_DEVICES names them as the sandbox shows them."""
        env = self.base_env | job.env
        if job.cpus != self.cpus:
            env |= thread_env(job.cpus)
        if job.gpus:
            held = self.pool.holding(job.job_id) if self.pool is not None else None
            if held is None:
                raise InfrastructureFailure(f"no GPU taken for job {job.job_id}")
            self._gpu_of[job.job_id] = held.ids
            env["CUDA_VISIBLE_DEVICES"] = ",".join(held.ids)
            # indices as nvidia-smi, NVML and the pool number them (CUDA's own default puts the fastest first)
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        else:  # a CPU stage sees no GPU, whether the driver's environment names them or not
            env["CUDA_VISIBLE_DEVICES"] = ""
        sandbox = None
        if job.sandbox is not None:
            sandbox = {**job.sandbox, "gpus": job.gpus}
            if job.gpus:
                sandbox["gpu_ids"] = self._gpu_of[job.job_id]
                env["CUDA_VISIBLE_DEVICES"] = inside_gpu_ids(self._gpu_of[job.job_id], env["CUDA_VISIBLE_DEVICES"])
        job.log_path.parent.mkdir(parents=True, exist_ok=True)
        return {
            "argv": job.argv, "cwd": str(job.cwd), "env": env, "log": str(job.log_path),
            "cpus": job.cpus, "strip_sys_path": [_package_root()], "sandbox": sandbox,
            "memory_mb": job.memory_mb if job.memory_mb is not None else self.default_memory_mb,
        }

    def poll(self, timeout: float = 0.0) -> list[JobResult]:
        deadline = time.monotonic() + timeout
        while not self._done and self._running and self._proc is not None:
            if self._waiting:
                self._dispatch()
            wait = max(0.0, deadline - time.monotonic())
            for msg in self._read(min(wait, 0.1) if self._waiting else wait):  # another thread may free a GPU
                if msg.get("event") != "exit":
                    continue
                job_id = str(msg["id"])
                if job_id not in self._running:
                    continue
                if self._retry_alone(job_id, msg):
                    continue
                self._finish(JobResult(
                    job_id, msg["status"],  # type: ignore[arg-type]
                    exit_code=msg.get("exit_code"), signal=msg.get("signal"),  # type: ignore[arg-type]
                    cpu_s=float(msg["cpu_s"]), wall_s=float(msg["wall_s"]), host=self.host,  # type: ignore[arg-type]
                ))
            if time.monotonic() >= deadline:
                break
        if self._waiting:
            self._dispatch()
        if not self._done and timeout > 0 and not self._running:
            time.sleep(min(timeout, 0.05))
        done, self._done = self._done, []
        return done

    def _retry_alone(self, job_id: str, msg: dict[str, object]) -> bool:
        """A stage that ran out of CUDA memory on a GPU it shared goes back to wait for that GPU alone
        (once): the first attempt's compute is kept in the result's `extra`, as lost. The OOM is read
        from the stage's log, which branch code writes: a failing stage on a crowded GPU can buy one
        more attempt, on the same seed, by printing it; that attempt shows as lost in the goodput."""
        held = self.pool.holding(job_id) if self.pool is not None else None
        if msg.get("status") != "exit" or held is None or not held.crowded or held.alone or job_id in self._retried:
            return False
        job = self._running[job_id]
        if not is_cuda_oom(read_tail(job.log_path, 8000)[0]):
            return False
        self._gpu_of.pop(job_id, None)
        self.pool.give_back(job_id)  # type: ignore[union-attr]  (held: the pool exists)
        self.pool.sampler().stage_done(job_id)  # type: ignore[union-attr]
        self._retried[job_id] = {"cpu_s": float(msg["cpu_s"]), "wall_s": float(msg["wall_s"]),  # type: ignore[arg-type]
                                 "gpu_s": float(msg["wall_s"]) * held.share * len(held.ids)}  # type: ignore[arg-type]
        note_retry_alone(job.log_path)
        self._waiting.insert(0, (job, True))
        self._dispatch()
        return True

    def gpu_usage(self, wait: bool = False) -> dict[str, object] | None:
        """The GPU samples taken since this executor's first GPU stage (the pool's sampler serves the
        whole process: a second driver's executor must not book the first one's samples again)."""
        if self.pool is None or not self.pool.sampler().available:
            return None
        now = self.pool.sampler().summary()
        if self._usage_from is None:
            self._usage_from = now
        n, busy, util = (now[k] - self._usage_from[k] for k in ("samples", "busy", "util_sum"))  # type: ignore[operator]
        return {"samples": n, "busy": busy, "util_sum": util, "busy_share": busy / n if n else None,
                "mean_util": util / n if n else None,
                "holder": f"{self.host}:{os.getpid()}:{self._started_at:.3f}", "gpus": list(self.pool.ids)}

    def cancel(self, job_id: str) -> None:
        waiting = [w for w in self._waiting if w[0].job_id == job_id]
        if waiting:
            self._waiting.remove(waiting[0])
            if self.pool is not None:
                self.pool.forget(job_id)
            self._finish(JobResult(job_id, "cancelled", detail="cancelled while waiting for a GPU", host=self.host))
            return
        proc = self._proc
        if job_id not in self._running or proc is None or proc.stdin is None:
            return
        try:
            proc.stdin.write((json.dumps({"op": "cancel", "id": job_id}) + "\n").encode())
            proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self._worker_died()

    def close(self) -> None:
        """Stop the warm worker; it kills the process groups of stages still running."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=10)
        except (subprocess.TimeoutExpired, OSError):
            proc.kill()
            proc.wait()
        finally:
            if proc.stdout is not None:
                proc.stdout.close()
        self._forget_waiting()
        for job_id in list(self._running):
            self._finish(JobResult(job_id, "cancelled", detail="executor closed", host=self.host))

    def __enter__(self) -> "LocalExecutor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
