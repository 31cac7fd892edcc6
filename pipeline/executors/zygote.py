"""The warm worker: imports the heavy libraries once, then forks one child per stage.

Why: a fresh interpreter importing torch and peft costs seconds; a fork of a process that already
has them costs milliseconds, and the branch's `python train.py ...` then runs in the child
through runpy. The worker stays single-threaded (forking a threaded process is unsafe): it is
started with every thread count at 1 (`thread_env(1)`), so numpy's OpenBLAS and torch start no pool
on import, and each stage sizes its pools to its own `cpus` after the fork (`child._set_threads`).
The ready event names the worker's threads; more than one is written to its log.

Protocol: JSON lines. stdin receives {"op": "run", "id", "spec", "timeout_s"} and
{"op": "cancel", "id"}; stdout (a private copy of fd 1; stray prints go to stderr) sends
{"event": "ready"}, {"event": "started", "id", "pid"} and
{"event": "exit", "id", "status", "exit_code", "signal", "cpu_s", "wall_s"}.
EOF on stdin, SIGTERM, or the death of the driver (PDEATHSIG) kill every stage's process group.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import select
import signal
import sys
import time
from typing import Any

from pipeline.executors import child, sandbox

KILL_GRACE_S = 2.0
WORKER_OOM_SCORE_ADJ = -500
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float] | None:
    """(session id, CPU seconds of the process and the children it reaped) of a live process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            text = fh.read().decode("ascii", "replace")
    except OSError:
        return None
    f = text[text.rindex(")") + 2:].split()
    return int(f[3]), sum(int(x) for x in f[11:15]) / CLK_TCK


def _pid_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def group_cpu_s(sid: int) -> float:
    """CPU seconds, now, of every process a stage started: its session (`sid`, the stage's own pid)
    and, with the sandbox, every process of the pid namespaces they are in, whether or not anyone
    waited for them. Each live process counts its own time and that of the children it reaped,
    so nothing is counted twice. Read before a kill: the killed stage's time is never reaped."""
    procs = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                procs[int(name)] = st
    ours = {pid for pid, (s, _) in procs.items() if s == sid}
    own_ns = _pid_ns(os.getpid())
    spaces = {ns for ns in map(_pid_ns, ours) if ns is not None and ns != own_ns}
    if spaces:
        ours |= {pid for pid in procs if pid not in ours and _pid_ns(pid) in spaces}
    return sum(procs[pid][1] for pid in ours)


def thread_names() -> list[str]:
    """The names of this process's threads (one, "python", when a fork is safe)."""
    names = []
    for tid in sorted(os.listdir("/proc/self/task")):
        try:
            with open(f"/proc/self/task/{tid}/comm") as fh:
                names.append(fh.read().strip())
        except OSError:
            continue
    return names


class _Job:
    def __init__(self, job_id: str, pid: int, timeout_s: float):
        self.id = job_id
        self.pid = pid
        self.started = time.monotonic()
        self.deadline = self.started + timeout_s
        self.reason: str | None = None  # "timeout" | "cancelled" once we kill it
        self.kill_at: float | None = None
        self.cpu_at_kill = 0.0  # what its processes had used when we last sent a kill


class Zygote:
    def __init__(self, out_fd: int):
        self.out = os.fdopen(out_fd, "w", buffering=1)
        self.jobs: dict[int, _Job] = {}
        self.by_id: dict[str, _Job] = {}
        self.buf = b""
        self.private_fds: list[int] = [out_fd]

    def send(self, msg: dict[str, Any]) -> None:
        self.out.write(json.dumps(msg) + "\n")

    def start(self, msg: dict[str, Any]) -> None:
        spec = msg["spec"]
        pipes = (*os.pipe(), *os.pipe()) if spec.get("sandbox") is not None else None
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            for fd in self.private_fds:
                os.close(fd)
            handshake = None
            if pipes is not None:
                ready_r, ready_w, go_r, go_w = pipes
                os.close(ready_r)
                os.close(go_w)
                handshake = (ready_w, go_r)
            child.run(spec, new_session=True, handshake=handshake)
        if pipes is not None:  # we map the child's user namespace: it saves the child a fork
            ready_r, ready_w, go_r, go_w = pipes
            os.close(ready_w)
            os.close(go_r)
            sandbox.map_child(pid, ready_r, go_w)
        job = _Job(msg["id"], pid, float(msg["timeout_s"]))
        self.jobs[pid] = job
        self.by_id[job.id] = job
        self.send({"event": "started", "id": job.id, "pid": pid})

    def kill(self, job: _Job, reason: str, sig: int = signal.SIGTERM) -> None:
        job.reason = job.reason or reason
        job.kill_at = job.kill_at or time.monotonic() + KILL_GRACE_S
        job.cpu_at_kill = max(job.cpu_at_kill, group_cpu_s(job.pid))
        for target in (lambda: os.killpg(job.pid, sig), lambda: os.kill(job.pid, sig)):
            try:
                target()
                return
            except ProcessLookupError:
                continue

    def reap(self) -> None:
        while self.jobs:
            try:
                pid, status, ru = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            job = self.jobs.pop(pid, None)
            if job is None:
                continue
            self.by_id.pop(job.id, None)
            try:  # processes nobody waited for, left in its group: their time is counted too
                os.killpg(pid, 0)
                stragglers = group_cpu_s(pid)
            except (ProcessLookupError, PermissionError):
                stragglers = 0.0
            # what it reaped plus what is left, or what all of it had used at the kill (which counted
            # the stragglers of then already), whichever is more: never the stragglers twice
            try:  # stragglers the stage left in its group
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            msg: dict[str, Any] = {
                "event": "exit", "id": job.id,
                "cpu_s": max(ru.ru_utime + ru.ru_stime + stragglers, job.cpu_at_kill),
                "wall_s": time.monotonic() - job.started, "exit_code": None, "signal": None,
            }
            if os.WIFEXITED(status):
                msg["exit_code"] = os.WEXITSTATUS(status)
                msg["status"] = "ok" if msg["exit_code"] == 0 else "exit"
            else:
                msg["signal"] = os.WTERMSIG(status)
                msg["status"] = "signal"
            if job.reason:
                msg["status"] = job.reason
            self.send(msg)

    def enforce(self) -> float:
        """Kill overdue jobs; return seconds until the next deadline (for select)."""
        t = time.monotonic()
        wait = 1.0
        for job in list(self.jobs.values()):
            if job.reason is None and t >= job.deadline:
                self.kill(job, "timeout")
            if job.kill_at is not None and t >= job.kill_at:
                self.kill(job, job.reason or "timeout", signal.SIGKILL)
                job.kill_at = t + KILL_GRACE_S
            nxt = job.kill_at if job.reason else job.deadline
            wait = min(wait, max(0.0, (nxt or t + 1) - t))
        return wait

    def kill_all(self) -> None:
        for job in list(self.jobs.values()):
            self.kill(job, "cancelled", signal.SIGKILL)

    def handle(self, line: bytes) -> None:
        msg = json.loads(line)
        if msg["op"] == "run":
            self.start(msg)
        elif msg["op"] == "cancel":
            job = self.by_id.get(msg["id"])
            if job is not None:
                self.kill(job, "cancelled", signal.SIGKILL)

    def loop(self) -> None:
        rpipe, wpipe = os.pipe()
        os.set_blocking(wpipe, False)
        self.private_fds += [rpipe, wpipe]
        signal.set_wakeup_fd(wpipe)  # SIGCHLD wakes select at once: no polling latency
        signal.signal(signal.SIGCHLD, lambda *_: None)
        stdin = sys.stdin.fileno()
        # the warm worker holds torch for every slot: the OOM killer takes a stage first (each stage
        # raises its own score to child.STAGE_OOM_SCORE_ADJ), and this one last where we may lower it
        oom = WORKER_OOM_SCORE_ADJ if child.set_oom_score_adj(WORKER_OOM_SCORE_ADJ) else None
        self.send({"event": "ready", "pid": os.getpid(), "oom_score_adj": oom, "threads": thread_names()})
        while True:
            timeout = self.enforce()
            ready, _, _ = select.select([stdin, rpipe], [], [], timeout)
            if rpipe in ready:
                os.read(rpipe, 4096)
            if stdin in ready:
                data = os.read(stdin, 1 << 16)
                if not data:
                    self.kill_all()
                    deadline = time.monotonic() + 5
                    while self.jobs and time.monotonic() < deadline:
                        self.reap()
                        time.sleep(0.01)
                    return
                self.buf += data
                while b"\n" in self.buf:
                    line, self.buf = self.buf.split(b"\n", 1)
                    if line.strip():
                        self.handle(line)
            self.reap()


def main() -> None:
    config = json.loads(sys.argv[1])
    out_fd = os.dup(1)
    os.dup2(2, 1)
    child._die_with_parent(signal.SIGTERM)  # so that on_term cleans up the stages' groups
    zygote = Zygote(out_fd)

    def on_term(*_: object) -> None:
        zygote.kill_all()
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    # Ctrl-C reaches the whole foreground group; the driver decides what stops (and re-queues),
    # so the worker must not die under a stage that is about to finish.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for name in config.get("preload", []):
        try:
            importlib.import_module(name)
        except ImportError:
            if not config.get("optional"):  # on a Ray node, a library it lacks is the stage's to need
                raise
            print(f"warm worker: {name} is not installed here; stages import what they need", file=sys.stderr)
    threads = thread_names()
    if len(threads) > 1:  # a preloaded library started threads: fork is unsafe, say which
        print(f"warm worker: {len(threads)} threads after preload ({', '.join(threads)}); "
              "stages are forked from a multi-threaded process", file=sys.stderr)
    child.prepare_fork()
    # Objects imported so far live for ever: keep the children's garbage collector from walking
    # them, which would touch (and so copy) every page shared with this process.
    gc.collect()
    gc.freeze()
    zygote.loop()


if __name__ == "__main__":
    main()
