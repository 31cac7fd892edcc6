"""A real Ray cluster started as separate processes: `ray start --head --port P`, plus a second node
with `ray start --address` and a temp dir of its own. Stopped by the pids of the processes these
commands started (found by their temp dirs, with their children), never by `ray stop`, which
would end every Ray on the machine.

Ray 2.60 turns token authentication on: the cluster and every driver here run with
`RAY_AUTH_MODE=disabled` (the README says the same to users).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from support import free_port

RAY = str(Path(sys.executable).with_name("ray"))
ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def require_ray():
    """Ray, imported, for a Ray test module (`ray = require_ray()` at its top); the module is skipped
    where Ray cannot be imported, and never in CI (CI=1 turns a missing Ray into a failure)."""
    try:
        import ray
    except ImportError:  # pragma: no cover - depends on the machine
        if os.environ.get("CI"):
            raise RuntimeError("Ray is required in CI: pip install -e '.[dev]'") from None
        import pytest

        # platform limit: Ray has no wheel for this Python/OS; CI raises above instead of skipping
        pytest.skip("Ray is not installed", allow_module_level=True)
    return ray


@contextlib.contextmanager
def ray_exclusive():
    """Hold the machine's Ray for this test module: `make test` runs modules on two xdist workers,
    and two Ray instances started side by side contend for the ports Ray picks by default (its
    dashboard agent's among them). A file lock, so a second Ray module waits for the first."""
    import fcntl

    path = Path(tempfile.gettempdir()) / "autoresearch-tests-ray.lock"
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


class RayCluster:
    def __init__(self, head_cpus: int = 1, worker_cpus: int = 1, head_gpus: int = 0, env: dict[str, str] | None = None,
                 worker_env: dict[str, str] | None = None):
        """`head_gpus`: logical GPUs of the head node (Ray hands its GPU actors CUDA_VISIBLE_DEVICES as
        on a GPU node, with no device behind it); `env`: more of the nodes' environment; `worker_env`:
        more of the second node's alone."""
        self.dirs: list[str] = []
        self.env = {**os.environ, **ENV, **(env or {})}
        port = free_port()
        out = self._start(["--head", f"--port={port}", f"--num-cpus={head_cpus}", f"--num-gpus={head_gpus}",
                           "--include-dashboard=false"])
        m = re.search(r"ray start --address='([^']+)'", out)
        if m is None:
            self.stop()
            raise RuntimeError(f"`ray start --head` printed no address:\n{out[-2000:]}")
        self.address = m.group(1)  # the node's address, not 127.0.0.1
        if worker_cpus:
            self._start([f"--address={self.address}", f"--num-cpus={worker_cpus}"], worker_env)

    def _start(self, args: list[str], env: dict[str, str] | None = None) -> str:
        tmp = tempfile.mkdtemp(prefix="ar-ray-")
        self.dirs.append(tmp)
        proc = subprocess.run([RAY, "start", *args, f"--temp-dir={tmp}", "--disable-usage-stats"],
                              env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=180)
        if proc.returncode != 0:
            self.stop()
            raise RuntimeError(f"ray start {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        return proc.stdout + proc.stderr

    def processes(self) -> list:
        import psutil

        found = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                cmd = " ".join(p.info["cmdline"] or [])
            except psutil.Error:
                continue
            if any(d in cmd for d in self.dirs):
                found.append(p)
        for p in list(found):
            try:
                found += p.children(recursive=True)
            except psutil.Error:
                pass
        return list({p.pid: p for p in found}.values())

    def stop(self) -> None:
        import psutil

        procs = self.processes()
        for p in procs:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=20)
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)

    @contextlib.contextmanager
    def connected(self):
        """This process connected to the cluster as its driver (`ray.init`, with ENV set while it is),
        disconnected and ENV restored after."""
        import ray

        saved = {k: os.environ.get(k) for k in ENV}
        os.environ.update(ENV)
        ray.init(address=self.address, include_dashboard=False, log_to_driver=False)
        try:
            yield self
        finally:
            ray.shutdown()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def __enter__(self) -> "RayCluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
