"""What runs inside a Ray worker for one stage. Standard library only, shipped by value.

The Ray executor registers this module with cloudpickle's pickle-by-value, so a cluster node needs
Ray and Python, not our package. The function unpacks the commit's tree and the stage's input
folders into a node-local cache (once per node), rewrites the driver's paths in argv to the local
copies, runs the stage through `child.py`'s source (the same setup as the local executor), and
returns the output folder and the log as tar bytes.
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from typing import Any

NODE_CACHE = os.path.join(tempfile.gettempdir(), "autoresearch-ray")
MAX_LOG_BYTES = 8 << 20


def _materialise(kind: str, ident: str, ref_box: list[Any]) -> str:
    """Unpack an archive into the node cache unless a previous stage on this node already did."""
    import ray

    dest = os.path.join(NODE_CACHE, kind, ident)
    if os.path.isdir(dest):
        return dest
    data: bytes = ray.get(ref_box[0])
    tmp = f"{dest}.tmp-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(tmp, filter="data")
    try:
        os.rename(tmp, dest)
    except OSError:  # another stage on this node won the race: use theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def pack(folder: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in sorted(os.listdir(folder)):
            tar.add(os.path.join(folder, name), arcname=name)
    return buf.getvalue()


def scrub(env: dict[str, str], names: list[str], extra: list[str], value_pattern: str) -> dict[str, str]:
    import re

    rx = re.compile("|".join(names), re.IGNORECASE)
    vx = re.compile(value_pattern)
    return {k: v for k, v in env.items() if not rx.search(k) and k not in extra and not vx.search(v)}


def run_stage(job: dict[str, Any], tree: list[Any], mounts: list[tuple[str, str, list[Any]]]) -> dict[str, Any]:
    """Run one stage on this node. `tree` and each mount carry an ObjectRef in a one-item list,
    so Ray does not fetch archives this node already unpacked."""
    started = time.monotonic()
    cwd = _materialise("tree", job["tree_id"], tree)
    path_map = {job["cwd"]: cwd}
    for driver_path, ident, box in mounts:
        path_map[driver_path] = _materialise("input", ident, box)
    work = os.path.join(NODE_CACHE, "jobs", job["job_id"])
    out = os.path.join(work, "out")
    os.makedirs(out)
    path_map[job["out"]] = out
    log = os.path.join(work, "stage.log")

    def local(arg: str) -> str:
        for src in sorted(path_map, key=len, reverse=True):  # longest first: nested paths map right
            arg = arg.replace(src, path_map[src])
        return arg

    env = scrub(dict(os.environ), job["secret_names"], job["secret_extra"], job["secret_value"])
    env.update(job["env"])
    sandbox = job.get("sandbox")
    if sandbox is not None:  # the same mounts, at this node's copies
        sandbox = {**sandbox, "ro": [local(p) for p in sandbox["ro"]], "rw": [local(p) for p in sandbox["rw"]],
                   "out": local(sandbox["out"]) if sandbox.get("out") else None, "gpus": job.get("gpus", 0)}
    spec = {"argv": [local(a) for a in job["argv"]], "cwd": cwd, "env": env, "log": log,
            "cpus": job["cpus"], "memory_mb": job["memory_mb"], "strip_sys_path": [],
            "sandbox": sandbox, "sandbox_src": job.get("sandbox_src")}
    import json

    proc = subprocess.Popen([sys.executable, "-c", job["child_src"], json.dumps(spec)],
                            start_new_session=True, env=env, cwd=cwd,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = started + float(job["timeout_s"])
    reason = None
    status_code = 0
    rusage = None
    try:
        while True:
            pid, status_code, rusage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if reason is None and time.monotonic() > deadline:
                reason = "timeout"
                os.killpg(proc.pid, signal.SIGTERM)
                deadline = time.monotonic() + 2.0
            elif reason is not None and time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
            time.sleep(0.02)
    except BaseException:  # ray.cancel raises KeyboardInterrupt here: take the stage down with us
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        raise
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.returncode = 0  # reaped by wait4 above; keep Popen from waiting again
    result: dict[str, Any] = {
        "cpu_s": (rusage.ru_utime + rusage.ru_stime) if rusage else 0.0,
        "wall_s": time.monotonic() - started, "exit_code": None, "signal": None, "host": socket.gethostname(),
    }
    if os.WIFEXITED(status_code):
        result["exit_code"] = os.WEXITSTATUS(status_code)
        result["status"] = "ok" if result["exit_code"] == 0 else "exit"
    else:
        result["signal"] = os.WTERMSIG(status_code)
        result["status"] = "signal"
    if reason:
        result["status"] = reason
    result["out"] = pack(out) if result["status"] == "ok" else b""
    result["log"] = b""
    if os.path.exists(log):
        with open(log, "rb") as fh:
            fh.seek(max(0, os.path.getsize(log) - MAX_LOG_BYTES))
            result["log"] = fh.read()
    shutil.rmtree(work, ignore_errors=True)
    return result
