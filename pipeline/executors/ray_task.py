"""What runs on a Ray node: a warm worker actor per slot. Standard library only, shipped by value.

The Ray executor registers this module with cloudpickle's pickle-by-value, so a cluster node needs
Ray and Python, not our package. Each `WarmWorker` actor starts, once, the same warm worker the
local executor uses (`zygote.py`, with `child.py` and `sandbox.py`, shipped as source files into a
node-local folder): it imports torch and peft once and forks one child per stage, so a Ray stage
starts in milliseconds instead of a cold interpreter's seconds. For each stage the actor unpacks
the stage's code view and input folders into a node-local cache (once per node) with the driver's
own link-safe extraction (`pipeline/safefs.py`, shipped as source too: no entry is written through
a link, whatever order the entries come in, and then the links are checked as a whole; a tree with
a link whose final target leaves it is refused and the stage fails with the reason), rewrites the
driver's paths in argv to the local copies, hands the stage to its warm worker (same sandbox, same
scrubbed environment as locally), and returns the output folder and the log as tar bytes.

An actor that holds GPUs samples them through NVML (`nvidia-ml-py`, where the node has it) every
half second from its start, as the local executor's `gpus.GpuSampler` does: each stage's mean
utilisation comes back with its result, and `take_usage` hands the executor each GPU's samples since
its last call (the executor counts one actor per GPU; the others on a shared GPU saw the same).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from typing import Any

NODE_CACHE = os.path.join(tempfile.gettempdir(), f"autoresearch-ray-{os.getuid()}")


def _own_cache() -> None:
    """The node cache is ours alone (0700, owned by us): in a shared /tmp another user must not be
    able to plant the warm worker's sources or a stage's inputs."""
    os.makedirs(NODE_CACHE, mode=0o700, exist_ok=True)
    st = os.lstat(NODE_CACHE)
    if st.st_uid != os.getuid() or (st.st_mode & 0o077) or os.path.islink(NODE_CACHE):
        raise RuntimeError(f"{NODE_CACHE} is not ours alone (owner {st.st_uid}, mode {oct(st.st_mode)}): refusing it")


MAX_LOG_BYTES = 8 << 20
MAX_STDOUT_BYTES = 64 << 10  # a harness command's stdout: its last line is its answer
SAMPLE_S = 0.5  # gpus.SAMPLE_S: how often an actor's GPUs are sampled
# pipeline.lab's MEMORY_SHARE and SHM_MB (a sandbox spec names its own shm_max_mb): this module is standard library only, shipped by value
MEMORY_SHARE = 0.8
SHM_MB = 64


# child.THREAD_VARS (this file is shipped alone): the warm worker imports with one thread each, and
# each stage sizes its pools to its own cpus after the fork
WORKER_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
                      "VECLIB_MAXIMUM_THREADS", "TORCH_NUM_THREADS")


def node_memory_mb(cpus: int, gpus: int, sandbox: dict[str, Any] | None, meminfo: str = "/proc/meminfo") -> int | None:
    """A CPU stage's RLIMIT_AS on this node when the lab sets no `[run] memory_mb`: the local
    executor's default (`pipeline.memory.memory_plan`) from this node's memory and cores, not the
    driver's. MEMORY_SHARE of MemTotal ÷ the stages of `cpus` the node holds at once, less the
    stage's tmpfs, never under 1 GB. None for a GPU stage (CUDA maps a huge address space) or
    where MemTotal cannot be read."""
    if gpus:
        return None
    try:
        with open(meminfo) as fh:
            total = next(int(ln.split()[1]) // 1024 for ln in fh if ln.startswith("MemTotal:"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    slots = max(1, (os.cpu_count() or 1) // max(1, int(cpus)))
    tmpfs = (int(sandbox.get("tmp_max_mb", 0)) + int(sandbox.get("shm_max_mb", SHM_MB))
             + int(sandbox.get("out_max_mb", 0))) if sandbox else 0
    return max(1024, int(total * MEMORY_SHARE / slots) - tmpfs)


def unpack(data: bytes, dest: str, safefs: Any, what: str = "the tree") -> str:
    """Lay out the tar archive `data` at `dest` unless a previous stage on this node already did.

    `safefs` is the node's copy of pipeline/safefs.py (`WarmWorker.safefs`): `extract_tar` writes
    no entry through a link and then checks the links as a whole, so a chain of links, or one whose
    target leaves the tree, is refused (`safefs.UnsafeTree`, one line) and nothing is left at `dest`."""
    if os.path.isdir(dest):
        return dest
    tmp = f"{dest}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        safefs.extract_tar(io.BytesIO(data), tmp, what=what)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # rmtree never follows a link
        raise
    try:
        os.rename(tmp, dest)
    except OSError:  # another stage on this node won the race: use theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _materialise(kind: str, ident: str, ref_box: list[Any], safefs: Any, under: str | None = None) -> str:
    """Unpack an archive into the node cache unless a previous stage on this node already did; with
    `under` (a harness job's own folder, removed at its end), there, afresh: the sealed data and the
    trusted files are never left on a node, nor taken from what another process there could edit."""
    import ray

    dest = os.path.join(under or NODE_CACHE, kind, ident)
    if under is None and os.path.isdir(dest):
        return dest
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    return unpack(ray.get(ref_box[0]), dest, safefs, what=f"the {'code view' if kind == 'tree' else 'input'} {ident}")


def pack(folder: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in sorted(os.listdir(folder)):
            tar.add(os.path.join(folder, name), arcname=name)
    return buf.getvalue()


def scrub(env: dict[str, str], allow: list[str], prefixes: list[str]) -> dict[str, str]:
    """The allow-listed part of this node's environment (base.scrub_env's list, sent with the job)."""
    names = set(allow)
    return {k: v for k, v in env.items() if k in names or k.startswith(tuple(prefixes))}


class GpuWatch:
    """This actor's GPUs (`ids`: its CUDA_VISIBLE_DEVICES, Ray's choice), sampled through NVML every
    `interval` s in a thread: per GPU, samples / busy (utilisation > 0) / utilisation sum since the
    last `take`, and what the stage running now was charged (a sample per GPU it holds). Without
    NVML on this node (or for a CPU actor) it samples nothing and `take` returns {}. The node's twin
    of `gpus.GpuSampler` (same handle lookup, same counts): this module ships alone, standard library only."""

    def __init__(self, ids: list[str], interval: float = SAMPLE_S):
        self.nvml, self.handles = None, {}
        if ids:
            try:
                import pynvml  # nvidia-ml-py: optional on a node

                pynvml.nvmlInit()
                self.nvml = pynvml
            except Exception:  # not installed, or no driver here
                self.nvml = None
        for g in ids if self.nvml is not None else []:
            try:
                self.handles[g] = (self.nvml.nvmlDeviceGetHandleByUUID(g) if g.startswith(("GPU-", "MIG-"))
                                   else self.nvml.nvmlDeviceGetHandleByIndex(int(g)))
            except Exception:
                continue
        self.lock = threading.Lock()
        self.totals: dict[str, list[float]] = {}
        self.stage: list[float] | None = None  # [samples, util_sum] of the stage running now
        self.interval = interval
        if self.handles:
            threading.Thread(target=self._run, name="gpu-watch", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(self.interval)
            self.sample()

    def sample(self) -> None:
        utils = {}
        for g, h in self.handles.items():
            try:
                utils[g] = float(self.nvml.nvmlDeviceGetUtilizationRates(h).gpu)
            except Exception:
                continue
        with self.lock:
            for g, u in utils.items():
                t = self.totals.setdefault(g, [0, 0, 0.0])
                t[0] += 1
                t[1] += u > 0
                t[2] += u
                if self.stage is not None:
                    self.stage[0] += 1
                    self.stage[1] += u

    def stage_start(self) -> None:
        with self.lock:
            self.stage = [0, 0.0]

    def stage_end(self) -> tuple[float | None, int]:
        """The stage's mean utilisation over its samples (None if none were taken) and their count."""
        with self.lock:
            n, total = self.stage or (0, 0.0)
            self.stage = None
        return (total / n if n else None), int(n)

    def take(self) -> dict[str, list[float]]:
        with self.lock:
            got, self.totals = self.totals, {}
        return got


class WarmWorker:
    """One slot of the cluster: a warm worker process on this node, fed one stage at a time.

    `sources`: {"child", "sandbox", "zygote", "safefs", "environment"} → module source, written once per node and version;
    `preload`: modules the warm worker imports (those missing on this node are skipped)."""

    def __init__(self, sources: dict[str, str], preload: list[str], env_allow: list[str] | None = None,
                 env_prefixes: list[str] = ()):
        import hashlib

        _own_cache()
        digest = hashlib.sha256("".join(sources[k] for k in sorted(sources)).encode()).hexdigest()[:16]
        self.pkg = os.path.join(NODE_CACHE, f"worker-{digest}")
        if not os.path.isdir(self.pkg):
            tmp = f"{self.pkg}.tmp-{uuid.uuid4().hex[:8]}"
            os.makedirs(tmp)
            for name, src in sources.items():
                with open(os.path.join(tmp, f"_ar_{name}.py"), "w") as fh:
                    fh.write(_standalone(src))
            try:
                os.rename(tmp, self.pkg)
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)
        self.safefs = _load(self.pkg, "safefs")  # the driver's link-safe extraction, on this node
        self.facts = _load(self.pkg, "environment").node_facts()  # what this node measures with, sent with each result
        self.preload = preload
        self.env_allow = None if env_allow is None else (list(env_allow), list(env_prefixes))
        self.lock = threading.Lock()
        self.start_lock = threading.Lock()
        self.proc: subprocess.Popen[bytes] | None = None
        self.buf = b""
        self.current: str | None = None
        self.gpu_ids = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
        self.gpu_keys = [f"{_host()}:{g}" for g in self.gpu_ids]  # this node's GPUs, as the executor names them
        self.watch = GpuWatch(self.gpu_ids)
        _sweep_harness_jobs()

    def _start(self) -> subprocess.Popen[bytes]:
        """The warm worker, started (and waited for: its "ready") unless it runs. The actor is threaded
        (`warm` may still be waiting when `run` comes): one thread starts it, the others wait for it."""
        with self.start_lock:
            return self._start_locked()

    def _start_locked(self) -> subprocess.Popen[bytes]:
        if self.proc is not None and self.proc.poll() is None:
            return self.proc
        # a stage forked from the worker could read the worker's own environment: allow-listed too
        env = dict(os.environ) if self.env_allow is None else scrub(dict(os.environ), *self.env_allow)
        env.pop("PYTHONPATH", None)  # the worker's own modules come from self.pkg, nothing else of ours
        env.update(dict.fromkeys(WORKER_THREAD_VARS, "1"))  # no thread pool before a fork (zygote.py)
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(self.pkg, "_ar_zygote.py"),
             json.dumps({"preload": self.preload, "optional": True})],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=self.pkg)
        self.buf = b""
        while True:
            msg = self._next()
            if msg is None:
                raise RuntimeError("the warm worker did not start on this node")
            if msg.get("event") == "ready":
                return self.proc

    def _inside_gpu_ids(self, gpu_ids: list[str], fallback: str) -> str:
        """CUDA_VISIBLE_DEVICES inside the sandbox, which binds only these GPUs' nodes (the node's
        copy of sandbox.py decides, as the local executor's does); `fallback` where it cannot."""
        import importlib.util

        spec = importlib.util.spec_from_file_location("_ar_sandbox_gpu", os.path.join(self.pkg, "_ar_sandbox.py"))
        try:
            mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
            spec.loader.exec_module(mod)  # type: ignore[union-attr]
            return ",".join(mod.gpu_devices(gpu_ids)[1])
        except (OSError, AttributeError):
            return fallback

    def _next(self) -> dict[str, Any] | None:
        assert self.proc is not None and self.proc.stdout is not None
        while b"\n" not in self.buf:
            data = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not data:
                return None
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def _send(self, msg: dict[str, Any]) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        with self.lock:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()

    def warm(self) -> dict[str, Any]:
        """Start the warm worker now (it imports torch and peft): its pid, this actor's GPUs and what
        this node measures with (`environment.node_facts`)."""
        return {"pid": self._start().pid, "gpus": self.gpu_keys, "env": self.facts, "node": _node_id()}

    def take_usage(self) -> dict[str, list[float]]:
        """Each of this actor's GPUs' [samples, busy, utilisation sum] since the last call, by its key."""
        got = self.watch.take()
        return {f"{_host()}:{g}": v for g, v in got.items()}

    def run(self, job: dict[str, Any], tree: list[Any], mounts: list[tuple[str, str, list[Any]]]) -> dict[str, Any]:
        """Run one stage on this node. `tree` and each mount carry an ObjectRef in a one-item list,
        so Ray does not fetch archives this node already unpacked. A harness job (`private`) leaves
        nothing on the node, whatever ends it (its folder holds the sealed data)."""
        try:
            return self._run(job, tree, mounts)
        finally:
            if job.get("private"):
                shutil.rmtree(_job_dir(job["job_id"]), ignore_errors=True)

    def _run(self, job: dict[str, Any], tree: list[Any], mounts: list[tuple[str, str, list[Any]]]) -> dict[str, Any]:
        started = time.monotonic()
        proc = self._start()
        work = _job_dir(job["job_id"])
        private = os.path.join(work, "in") if job.get("private") else None
        try:
            cwd = _materialise("tree", job["tree_id"], tree, self.safefs, private)
            path_map = {job["cwd"]: cwd}
            for driver_path, ident, box in mounts:
                path_map[driver_path] = _materialise("input", ident, box, self.safefs, private)
        except self.safefs.UnsafeTree as e:  # never run: the stage's failure, said in its log
            why = f"ray node: {e}"
            return {"cpu_s": 0.0, "wall_s": time.monotonic() - started, "exit_code": 1, "signal": None,
                    "host": _host(), "status": "exit", "detail": why[:300], "out": b"", "log": f"{why}\n".encode()}
        out = os.path.join(work, "out")
        os.makedirs(out)
        path_map[job["out"]] = out
        for driver_path, name in (job.get("outs") or {}).items():  # a harness command's folders to write
            path_map[driver_path] = os.path.join(out, name)
            os.makedirs(path_map[driver_path])
            os.chmod(path_map[driver_path], 0o777)  # a sandboxed command runs as an unprivileged uid
        log = os.path.join(work, "stage.log")
        stdout = os.path.join(work, "stdout") if job.get("stdout") else None

        def local(arg: str) -> str:
            for src in sorted(path_map, key=len, reverse=True):  # longest first: nested paths map right
                arg = arg.replace(src, path_map[src])
            return arg

        env = scrub(dict(os.environ), job["env_allow"], job["env_prefixes"])
        env.pop("PYTHONPATH", None)
        env.update(job["env"])
        if job.get("gpus", 0):  # Ray numbers a node's GPUs as NVML and nvidia-smi do, in PCI bus order;
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA's own default would put the fastest first
        sandbox = job.get("sandbox")
        if sandbox is not None:  # the same mounts, at this node's copies
            sandbox = {**sandbox, "ro": [local(p) for p in sandbox["ro"]], "rw": [local(p) for p in sandbox["rw"]],
                       "out": local(sandbox["out"]) if sandbox.get("out") else None, "gpus": job.get("gpus", 0)}
            if sandbox["gpus"]:  # Ray's choice for this actor: only those GPUs' nodes are bound
                sandbox["gpu_ids"] = [g for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
                env["CUDA_VISIBLE_DEVICES"] = self._inside_gpu_ids(sandbox["gpu_ids"], env.get("CUDA_VISIBLE_DEVICES", ""))
        spec = {"argv": [local(a) for a in job["argv"]], "cwd": cwd, "env": env, "log": log,
                "cpus": job["cpus"], "strip_sys_path": [self.pkg],
                "memory_mb": job["memory_mb"] if job["memory_mb"] is not None
                else node_memory_mb(job["cpus"], job.get("gpus", 0), job.get("sandbox")),
                "sandbox": sandbox, "stdout": stdout}
        self.current = job["job_id"]
        result: dict[str, Any] = {"cpu_s": 0.0, "wall_s": 0.0, "exit_code": None, "signal": None,
                                  "host": _host(), "status": "infra", "gpus": self.gpu_keys, "env": self.facts}
        self.watch.stage_start()
        try:
            self._send({"op": "run", "id": job["job_id"], "spec": spec, "timeout_s": float(job["timeout_s"])})
            while True:
                msg = self._next()
                if msg is None:  # the warm worker died under the stage: infrastructure
                    proc.kill()
                    result["detail"] = "the warm worker on this node died"
                    break
                if msg.get("event") == "exit" and msg.get("id") == job["job_id"]:
                    result.update({k: msg[k] for k in ("cpu_s", "wall_s", "exit_code", "signal", "status")})
                    break
        finally:
            self.current = None
            result["gpu_util"], result["gpu_samples"] = self.watch.stage_end()
        result["wall_s"] = result["wall_s"] or time.monotonic() - started
        result["out"] = pack(out) if result["status"] == "ok" else b""
        result["log"] = b""
        for key, path, limit in (("log", log, MAX_LOG_BYTES), ("stdout", stdout, MAX_STDOUT_BYTES)):
            if path is not None and os.path.exists(path):
                with open(path, "rb") as fh:
                    fh.seek(max(0, os.path.getsize(path) - limit))
                    result[key] = fh.read()
        shutil.rmtree(work, ignore_errors=True)
        return result

    def cancel(self, job_id: str) -> None:
        if self.current == job_id and self.proc is not None and self.proc.poll() is None:
            self._send({"op": "cancel", "id": job_id})


HARNESS_JOB_MAX_AGE_S = 86400.0


def _job_dir(job_id: str) -> str:
    """A job's own folder on this node: its output, log and stdout (and a harness job's inputs)."""
    return os.path.join(NODE_CACHE, "jobs", job_id)


def _sweep_harness_jobs() -> None:
    """Remove harness job folders a killed actor left on this node (older than a day: none runs so long)."""
    jobs = os.path.join(NODE_CACHE, "jobs")  # where `_job_dir` puts them
    try:
        names = [n for n in os.listdir(jobs) if n.startswith("harness-")]
    except OSError:
        return
    for name in names:
        path = os.path.join(jobs, name)
        try:
            if time.time() - os.stat(path).st_mtime > HARNESS_JOB_MAX_AGE_S:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue


def _node_id() -> str | None:
    """The Ray node this actor runs on (the executor places replacements by it), None outside Ray."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:
        return None


def _host() -> str:
    """This node, as the store records it: the host name and Ray's node id (nodes may share a host)."""
    try:
        import ray

        return f"{socket.gethostname()}/ray-{ray.get_runtime_context().get_node_id()[:8]}"
    except Exception:  # outside a Ray worker
        return socket.gethostname()


def _load(pkg: str, name: str) -> Any:
    """The node's copy of one of our shipped modules (`_ar_<name>.py` in `pkg`), imported by path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_ar_{name}", os.path.join(pkg, f"_ar_{name}.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # as an import does: a dataclass looks its module up there
    spec.loader.exec_module(mod)
    return mod


def _standalone(src: str) -> str:
    """A module of ours made to import its siblings from its own folder (no package on the node)."""
    return (src.replace("from pipeline.executors import child, sandbox", "import _ar_child as child, _ar_sandbox as sandbox")
            .replace("from pipeline.executors import sandbox as _sandbox", "import _ar_sandbox as _sandbox"))
