"""What each sandboxed process may see, and running one process in the sandbox to completion.

`pipeline.executors.sandbox` is the mechanism (namespaces, mounts, limits); this module is the
policy for a lab: the `[run]` limits, what stays hidden even inside mounted folders (our own
package: the harness code would tell how the sealed labels were made), and the check that the
kernel allows the sandbox at all. Stages reach the sandbox through their executor; the harness's
`prepare` and `score` and anything else run once go through `run_once`, whose cost a caller can
read (`metered`: the driver books its harness calls, a smoke run its own).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import pipeline
from pipeline.errors import InfrastructureFailure, UserError
from pipeline.executors import sandbox
from pipeline.executors.base import scrub_env, thread_env

UNSANDBOXED = "UNSANDBOXED"
PROBE_TIMEOUT_S = 30.0
KERNEL_REFUSALS = {  # what the kernel's answer to unshare() usually means
    "unshare: No space left on device": "user namespaces are limited to 0 here (sysctl user.max_user_namespaces)",
    "unshare: Operation not permitted": "user namespaces are not permitted here (container seccomp profile, "
                                        "kernel.unprivileged_userns_clone = 0 or "
                                        "kernel.apparmor_restrict_unprivileged_userns = 1)",
}


def package_dirs() -> list[str]:
    """Our own packages, wherever they are installed (a source tree or site-packages)."""
    return list(_package_dirs())


@lru_cache(maxsize=1)
def _package_dirs() -> tuple[str, ...]:
    # `agent` is found, not imported: the pipeline never imports the agent
    found = importlib.util.find_spec("agent")
    agent_dirs = found.submodule_search_locations if found is not None else None
    return tuple(str(Path(d).resolve()) for d in [Path(pipeline.__file__).parent, *(agent_dirs or [])])


def spec_for(lab: Any, *, ro: list[Path | str], out: Path | str | None = None,
             rw: list[Path | str] = ()) -> dict[str, Any] | None:
    """The sandbox of one process of `lab`, or None when the lab opted out (`[run] sandbox = "off"`)."""
    run = lab.config.run
    if run.sandbox == "off":
        return None
    return {
        "ro": [str(p) for p in ro], "rw": [str(p) for p in rw], "out": str(out) if out is not None else None,
        "network": run.network, "out_max_mb": run.out_max_mb, "tmp_max_mb": run.tmp_max_mb,
        "shm_max_mb": run.shm_size_mb(),
        # the lab itself (its working tree and runs/): only the views and folders above are the stage's
        "max_procs": run.max_procs, "hidden": [*package_dirs(), str(lab.root), str(lab.state)],
    }


def is_sandboxed(lab: Any) -> bool:
    return lab.config.run.sandbox != "off"


def require(lab: Any) -> None:
    """Raise `UserError` (one line) unless the lab opted out or the sandbox works here."""
    if not is_sandboxed(lab):
        return
    problem = _probe(sysfs=sandbox.needs_sysfs({"gpus": lab.config.run.gpus}))
    if problem:
        raise UserError(f"the Linux sandbox cannot start here ({problem}); {sandbox.OFF_HINT}")


@lru_cache(maxsize=2)
def _probe(sysfs: bool = False) -> str | None:
    """None if a sandboxed `true` runs here (with the device tree a multi-GPU stage sees: `sysfs`),
    else the reason (once per process)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="autoresearch-probe-") as tmp:
        log = Path(tmp) / "probe.log"
        spec = {"ro": [], "rw": [], "out": None, "hidden": package_dirs(), "sysfs": sysfs}
        result = _run_child({"argv": ["true"], "cwd": "/", "env": {"PATH": "/usr/bin:/bin"}, "log": str(log),
                             "cpus": 1, "memory_mb": None, "sandbox": spec}, PROBE_TIMEOUT_S)
        if result.returncode == 0:
            return None
        text = log.read_text(errors="replace").strip() if log.is_file() else ""
        line = next((ln for ln in reversed(text.splitlines()) if ln.startswith("sandbox:")), text[-200:])
        reason = line.removeprefix("sandbox: cannot set up (").split("); set [run]")[0]
        for needle, why in KERNEL_REFUSALS.items():
            if needle in reason:
                return f"{reason}: {why}"
        return reason or f"exit status {result.returncode}"


@dataclass(frozen=True)
class Completed:
    returncode: int | None  # None when it was killed by a signal
    signal: int | None
    timed_out: bool
    cpu_s: float
    wall_s: float
    interrupted: bool = False  # ended early: a `stopping` event was set (its process group killed)


@dataclass(eq=False)  # each block's own: found on the stack by identity
class Meter:
    """What the calls in a `metered` block spent: CPU seconds (the processes `run_once` ran, and this
    thread's own work: an in-process scorer), GPU-seconds (each process's GPUs × its wall time), and
    the block's wall time."""

    cpu_s: float = 0.0
    gpu_s: float = 0.0
    wall_s: float = 0.0
    processes: int = 0  # `run_once` calls


_metering = threading.local()  # this thread's open `metered` blocks, innermost last


@contextmanager
def metered() -> Iterator[Meter]:
    """Count what this thread spends inside the block (`Meter`; read it after the block). A block
    inside another counts in both."""
    meter = Meter()
    stack = _metering.__dict__.setdefault("stack", [])
    cpu0, wall0 = time.thread_time(), time.monotonic()
    try:
        stack.append(meter)
        yield meter
    finally:
        if meter in stack:
            stack.remove(meter)
        meter.cpu_s += time.thread_time() - cpu0
        meter.wall_s = time.monotonic() - wall0


_stopping = threading.local()  # this thread's open `stopping` blocks' events


class _AnySet:
    """Set when any of `events` is (what `GpuPool.wait_take` reads as its `stop`)."""

    def __init__(self, events: list[threading.Event]):
        self.events = events

    def is_set(self) -> bool:
        return any(e.is_set() for e in self.events)


@contextmanager
def _pushed(blocks: threading.local, item: Any) -> Iterator[None]:
    """`item` on this thread's stack of `blocks` for the block's duration."""
    stack = blocks.__dict__.setdefault("stack", [])
    stack.append(item)
    try:
        yield
    finally:
        stack.pop()


def stopping(stop: threading.Event | None) -> Any:
    """Inside the block, a `run_once` of this thread ends when `stop` is set: it stops waiting for a
    GPU, or kills its process group, and raises `Interrupted` (what the call spent is still metered).
    So a loop that stops (a signal, `--hours`, a lost lease) does not wait for a long `prepare`, a
    scorer or a smoke stage run once. None: no change."""
    return _pushed(_stopping, stop)


_gpu_runners = threading.local()  # this thread's open `gpu_runner` blocks


def gpu_runner(runner: Any) -> Any:
    """Inside the block, a `run_once` of this thread for `prepare` or `score` (`reserved`) given a GPU
    runs through `runner` (the Ray executor's `run_harness`: on the cluster, on a share held for
    them) instead of on this machine. None: no change (a block that needs no runner)."""
    return _pushed(_gpu_runners, runner)


def _gpu_runner() -> Any:
    stack = getattr(_gpu_runners, "stack", ())
    return next((r for r in reversed(stack) if r is not None), None)


def _stop_now() -> _AnySet:
    return _AnySet([e for e in getattr(_stopping, "stack", ()) if e is not None])


def _spent(done: "Completed", gpus: float) -> None:
    for meter in getattr(_metering, "stack", ()):
        meter.processes += 1
        meter.cpu_s += done.cpu_s
        meter.gpu_s += gpus * done.wall_s


def _ended(done: "Completed", gpus: float, abandoned: str) -> "Completed":
    """`done`, booked (`_spent`); `Interrupted` if a stop ended it."""
    from pipeline.errors import Interrupted

    _spent(done, gpus)
    if done.interrupted:
        raise Interrupted(abandoned)
    return done


def once_memory_mb(lab: Any, with_out: bool = True, gpus: float = 0) -> int | None:
    """The RLIMIT_AS of a process run once (`prepare`, `score`, a smoke run's stage in a fresh
    interpreter): `[run] memory_mb`, else the default a local stage gets (`pipeline.memory.memory_plan`: the
    slot's share of the machine less its tmpfs, of which `{out}` only `with_out`): none for a process
    given a GPU, whose CUDA maps far more address space than it uses (whatever `memory_mb` says)."""
    from pipeline.memory import local_slots, memory_plan

    run = lab.config.run
    if gpus:
        return None
    if run.memory_mb is not None:
        return run.memory_mb
    return memory_plan(run.model_copy(update={"gpus": gpus}), local_slots(run), with_out=with_out).memory_mb


def run_once(lab: Any, argv: list[str], *, cwd: Path, log: Path, timeout_s: float,
             ro: list[Path | str], out: Path | None = None, rw: list[Path | str] = (),
             stdout: Path | None = None, gpus: float = 0, reserved: bool = False) -> Completed:
    """Run one command of the lab in its sandbox (or unsandboxed if the lab opted out), to the end.

    Output goes to `log` (stdout to `stdout` if given). The environment is the allow-listed part of
    ours (`scrub_env`, with the lab's `[run] env`); its address space is bounded (`once_memory_mb`);
    no process outlives it. With `gpus` (a share or whole GPUs) it waits for them in this process's
    GPU pool, the one the executor's slots take from, and sees only them; `reserved`: it is the
    driver's `prepare` or `score`, for which the executor keeps room (`GpuPool.take`).
    """
    from pipeline.executors import gpus as gpu_pool
    from pipeline.errors import Interrupted
    from pipeline.executors.local import inside_gpu_ids, visible_gpus

    cpus = lab.config.run.cpus
    env = scrub_env(os.environ, lab.config.run.env) | thread_env(cpus)
    sandbox = spec_for(lab, ro=[cwd, *ro], out=out, rw=rw)
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU unless given one below
    stop = _stop_now()
    abandoned = f"stopping: {Path(argv[0]).name} abandoned"
    if stop.is_set():
        raise Interrupted(abandoned)
    if not gpus:
        return _ended(_run_child(_once_spec(lab, argv, cwd, env, log, out, stdout, sandbox, 0), timeout_s, stop),
                      0, abandoned)
    remote = _gpu_runner() if reserved else None
    if remote is not None:  # `prepare`/`score` on the cluster's share for them (`gpu_runner`); never branch code
        from pipeline.executors.base import lab_env

        if sandbox is not None:
            sandbox |= {"gpus": gpus}  # the node binds the GPUs Ray gave its actor
        # as a Ray stage's: the node's own allow-listed environment (its CUDA_VISIBLE_DEVICES, Ray's
        # choice), the thread counts and the lab's `[run] env`
        began = time.monotonic()
        try:
            done = Completed(**remote(argv, cwd=cwd, ro=list(ro), rw=list(rw), out=out, stdout=stdout, log=log,
                                      timeout_s=timeout_s, sandbox=sandbox,
                                      env=thread_env(cpus) | lab_env(lab.config.run.env), gpus=gpus, stop=stop,
                                      cpus=cpus, memory_mb=once_memory_mb(lab, with_out=out is not None, gpus=gpus)))
        except (Interrupted, InfrastructureFailure) as e:  # abandoned or lost there: it held its share until now
            if getattr(e, "started", True):
                _spent(Completed(None, None, False, 0.0, time.monotonic() - began, interrupted=True), gpus)
            raise
        return _ended(done, gpus, abandoned)
    ids = visible_gpus()
    if gpu_pool.capacity(gpus, len(ids)) < 1:
        raise UserError(f"{argv[0]} is given {gpus:g} GPU(s) ([run]) but {len(ids)} are visible here")
    pool, holder = gpu_pool.GpuPool.shared(ids), f"once-{os.getpid()}-{time.monotonic_ns()}"
    held = pool.wait_take(holder, gpus, timeout=timeout_s, reserved=reserved, stop=stop)  # type: ignore[arg-type]
    if held is None:
        if stop.is_set():
            raise Interrupted(abandoned)
        raise InfrastructureFailure(f"no GPU came free for {argv[0]} in {timeout_s:.0f} s")
    try:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(held)
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # indices as nvidia-smi and the pool number them
        if sandbox is not None:
            sandbox |= {"gpus": gpus, "gpu_ids": held}
            env["CUDA_VISIBLE_DEVICES"] = inside_gpu_ids(held, env["CUDA_VISIBLE_DEVICES"])
        return _ended(_run_child(_once_spec(lab, argv, cwd, env, log, out, stdout, sandbox, gpus), timeout_s, stop),
                      gpus, abandoned)
    finally:
        pool.give_back(holder)
        pool.sampler().stage_done(holder)


def _once_spec(lab: Any, argv: list[str], cwd: Path, env: dict[str, str], log: Path, out: Path | None,
               stdout: Path | None, sandbox: dict[str, Any] | None, gpus: float) -> dict[str, Any]:
    return {"argv": argv, "cwd": str(cwd), "env": env, "log": str(log), "cpus": lab.config.run.cpus,
            "memory_mb": once_memory_mb(lab, with_out=out is not None, gpus=gpus),
            "stdout": str(stdout) if stdout else None, "sandbox": sandbox}


def _run_child(spec: dict[str, Any], timeout_s: float, stop: _AnySet | None = None) -> Completed:
    """`python -m pipeline.executors.child SPEC`: the same set-up the executors use, in a fresh process."""
    from pipeline.executors.child import _die_with_parent
    from pipeline.executors.zygote import group_cpu_s

    root = str(Path(pipeline.__file__).resolve().parent.parent)
    spec = {**spec, "strip_sys_path": [root]}
    env = scrub_env(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.executors.child", json.dumps(spec)],
                            start_new_session=True, env=env, cwd=root, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    timed_out = interrupted = False
    cpu_at_kill = 0.0  # a killed process's time is never reaped: read it (all it started) first, once
    killed_at = 0.0
    try:
        while True:
            pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            now = time.monotonic()
            if not (timed_out or interrupted):
                timed_out = now - started > timeout_s
                interrupted = not timed_out and stop is not None and stop.is_set()
                if timed_out or interrupted:
                    cpu_at_kill = group_cpu_s(proc.pid)
            if (timed_out or interrupted) and now - killed_at >= 1.0:  # the kill again each second, never the scan
                killed_at = now
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.005)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.returncode = 0  # reaped by wait4 above
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    return Completed(code, sig, timed_out, max(ru.ru_utime + ru.ru_stime, cpu_at_kill), time.monotonic() - started,
                     interrupted=interrupted)
