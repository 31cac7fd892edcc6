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

GPUs, as locally (`executors/gpus.py`): Ray packs shares (`num_gpus = 0.25`) onto its GPUs, and each
actor tells which GPUs of which node it holds. A stage that runs out of CUDA memory on a GPU another
of our stages used meanwhile runs once more with that GPU alone (no other slot on it gets a stage
until it ends; its first attempt is booked as lost to infrastructure). Each actor samples its GPUs
through NVML where the node has it: a stage's mean utilisation comes back with its result, and
`gpu_usage` counts each GPU once however many slots share it. `borrow` lends the next slot to come
free to another thread, ahead of everything queued, and `run_ahead` runs a job there (a GPU lab's
smoke stages, when the driver's machine has no GPU: one slot for the whole smoke run). It waits for
the first stage running now to end; queued stages wait while it does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import io
import json
import os
import shutil
import socket
import tarfile
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pipeline import environment, safefs
from pipeline.disk import read_tail
from pipeline.errors import InfrastructureFailure, Interrupted
from pipeline.executors import child, ray_task, sandbox, zygote
from pipeline.executors.base import (
    STAGE_ENV,
    STAGE_ENV_PREFIXES,
    JobResult,
    StageJob,
    thread_env,
)
from pipeline.executors.gpus import capacity, is_cuda_oom, note_retry_alone
from pipeline.executors.local import DEFAULT_PRELOAD


MAX_PINNED_INPUTS = 256  # input folders kept in the object store for reuse by later stages
USAGE_GIVE_UP_S = 60.0  # an actor that has not answered `take_usage` in this long is asked no more
HARNESS_GRACE_S = 30.0  # past its timeout (or a stop), a harness call the node does not end is lost
NODES_TTL_S = 1.0  # the cluster's node list is asked of the GCS no more often than this
NODE_RETRY_S = 600.0  # a node where a worker died warming is tried again after this long
ENV_GONE_S = 240.0  # every live node found to measure otherwise this long: the cluster's environment moved
WARM_TIMEOUT_S = 300.0  # a node importing torch and peft takes seconds; a worker Ray cannot place, for ever
AUTH_HINT = ("Ray 2.60 turns token authentication on: start the cluster and run the loop with "
             "RAY_AUTH_MODE=disabled, or give both the same token")


def _oom(res: JobResult, job: StageJob) -> bool:
    """The stage failed with a CUDA out-of-memory (read from its log, which branch code writes)."""
    return res.status == "exit" and is_cuda_oom(read_tail(job.log_path, 8000)[0])


@dataclass(eq=False)
class _Slot:
    """One warm worker actor, and the GPUs it holds (`node:gpu` keys, known once it answered its
    `warm`: `pending` until then)."""

    actor: Any
    gpus: list[str] = field(default_factory=list)
    pending: Any = None  # the ref of its `warm` call, not yet read
    born: float = field(default_factory=time.monotonic)
    facts: dict[str, Any] | None = None  # what its node measures with (`environment.node_facts`), from `warm`
    fits: bool | None = None  # whether that is the driver's environment (`measure_in`); None: not asked yet
    node: str | None = None  # the Ray node it runs on, from `warm` (or the one it was placed on)

    def heard(self, ready: dict[str, Any]) -> None:
        """Its `warm`'s answer: its GPUs, its node's facts, its node."""
        self.gpus = list(ready.get("gpus") or [])
        self.facts = ready["env"] if isinstance(ready.get("env"), dict) else None
        self.node = ready.get("node") if isinstance(ready.get("node"), str) else None


def node_sources() -> dict[str, str]:
    """The modules a node's warm worker runs from, as source (`ray_task.WarmWorker`'s `sources`)."""
    return {"child": inspect.getsource(child), "sandbox": inspect.getsource(sandbox),
            "zygote": inspect.getsource(zygote), "safefs": inspect.getsource(safefs),
            "environment": inspect.getsource(environment)}


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

    def __init__(self, *, address: str | None = None, cpus: int = 1, gpus: float = 0,
                 slots: int | None = None, init_kwargs: dict[str, Any] | None = None,
                 preload: tuple[str, ...] | list[str] = DEFAULT_PRELOAD, memory_mb: int | None = None,
                 harness_gpus: float = 0.0):
        try:
            import ray
        except ImportError:
            raise InfrastructureFailure("the ray executor needs Ray: pip install 'ray[default]'") from None
        self.ray = ray
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
        self.harness_gpus = harness_gpus
        n_gpus = int(resources.get("GPU", 0) + 1e-6)
        no_room = None
        if harness_gpus and not capacity(harness_gpus, n_gpus):
            no_room = f"prepare_gpus/score_gpus = {harness_gpus:g} but the cluster has {n_gpus} GPU(s)"
        elif harness_gpus and gpus and capacity(gpus, n_gpus) >= 1 > capacity(gpus, n_gpus, keep=harness_gpus):
            no_room = (f"[run] gpus = {gpus:g} on the cluster's {n_gpus} GPU(s) leaves no room for "
                       f"prepare_gpus/score_gpus = {harness_gpus:g}; lower one of them")
        if no_room:
            from pipeline.errors import UserError

            if self._owns_ray:
                ray.shutdown()
            raise UserError(no_room)
        if gpus:  # a share (num_gpus = 0.25: Ray packs four on a GPU) or whole GPUs
            by_cpu = min(by_cpu, capacity(gpus, n_gpus, keep=harness_gpus))
        self._slots = slots if slots is not None else max(1, by_cpu)
        self._sources = node_sources()
        self._preload = list(preload)
        self._actor_cls = ray.remote(ray_task.WarmWorker)
        # input folder → (id, object ref), least recently used first: a loop that runs for weeks must
        # not pin every checkpoint it ever shipped in the object store
        self._inputs: OrderedDict[str, tuple[str, Any]] = OrderedDict()
        self._refs: dict[str, tuple[Any, StageJob, _Slot]] = {}  # job id → (ref, job, its slot)
        self._waiting: deque[tuple[StageJob, dict[str, Any], list[Any], list[Any]]] = deque()
        self._cancelled: list[JobResult] = []
        # `_idle`, `_refs`, `_lent`, `_alone`, `_borrowers` and `_closed` are shared with the thread of
        # `borrow`/`run_ahead`: changed under `_lock` (re-entrant: `_give_back` runs inside `_dispatch`)
        self._lock = threading.Condition(threading.RLock())
        self._lent: dict[_Slot, str | None] = {}  # slots lent by `borrow` → the job running on it now
        self._borrowers = 0  # threads waiting in `borrow`
        self._closed = False
        self._crowded: set[str] = set()  # jobs whose GPU another of our stages used while they ran
        self._alone: dict[str, set[str]] = {}  # a CUDA OOM's retry → the GPUs it holds whole, first come first
        self._retried: dict[str, dict[str, float]] = {}  # its first attempt, booked as lost
        self._began: dict[str, float] = {}  # job → when it was sent to its slot (monotonic)
        self._usage = [0, 0, 0.0]  # every GPU's samples, busy samples, utilisation sum (gpu_usage)
        self._usage_gpus: set[str] = set()
        self._usage_asked: dict[Any, tuple[_Slot, float]] = {}  # take_usage's answers to come
        self._reporter: dict[str, _Slot] = {}  # GPU → the one slot whose samples of it are counted
        self._fresh: set[_Slot] = set()  # reporters whose first answer (their whole life so far) is not counted
        self._started_at = time.time()
        # `prepare`/`score` given a GPU run on the cluster, on a share of their own held for the
        # executor's life (placed first): the driver's thread runs them between its stages and cannot
        # wait for a slot only it frees. One at a time (`_harness_lock`), from any thread.
        self._harness: _Slot | None = _Slot(self._new_worker(gpus=harness_gpus, cpus=0)) if harness_gpus else None
        self._harness_lock = threading.Lock()
        self._harness_inputs: dict[str, tuple[str, Any]] = {}  # its folders' (id, ref), oldest first
        self._idle: deque[_Slot] = deque(_Slot(self._new_worker()) for _ in range(self._slots))
        self.facts: dict[str, Any] | None = None
        # `measure_in`: which nodes' slots get stages (None: all), the nodes found to measure so (a
        # replacement is placed on one of them), and how many slots on other nodes were given back
        self._accept: Callable[[dict[str, Any]], bool] | None = None
        self._nodes: list[str] = []  # ... learned from the slots' answers, first seen first
        self._foreign: set[str] = set()  # nodes found to measure otherwise
        self._failed: dict[str, float] = {}  # untried nodes where a worker died warming → when (retried later)
        self._released = 0
        self._nodes_seen: tuple[float, list[dict[str, Any]] | None] | None = None  # (when, ray.nodes()), `_cluster_nodes`
        self._gone_since: float | None = None  # `environment_gone`: since when only other environments' nodes were seen
        try:  # each imports torch and peft once, in parallel; an actor Ray cannot place never starts
            slots = [*([self._harness] if self._harness else []), *self._idle]
            readies = ray.get([w.actor.warm.remote() for w in slots], timeout=WARM_TIMEOUT_S)
            for slot, ready in zip(slots, readies):
                slot.heard(ready)
            # what the stages measure with: a node's, not this driver's (`Driver.environment`; each
            # result still carries the facts of the node that made it)
            self.facts = next((s.facts for s in self._idle if s.facts is not None), None)
        except ray.exceptions.GetTimeoutError:
            self.close()
            raise InfrastructureFailure(
                f"the cluster did not start {self._slots} warm worker(s) of {cpus} CPU / {gpus:g} GPU each in "
                f"{WARM_TIMEOUT_S:.0f} s (resources: {dict(resources)}); lower --workers or [run] cpus/gpus") from None

    def _new_worker(self, gpus: float | None = None, cpus: int | None = None, node: str | None = None,
                    avoid: list[str] | None = None) -> Any:
        """A warm worker actor: it holds `run.cpus` CPUs and `run.gpus` GPUs of a node (Ray sets the
        actor's CUDA_VISIBLE_DEVICES, which its stages inherit) for as long as the executor lives
        (the harness's: `gpus` and `cpus` of its own); on `node` only, where given; never on the
        nodes `avoid` names (Ray's default `ray.io/node-id` label)."""
        options: dict[str, Any] = {"num_cpus": self.cpus if cpus is None else cpus,
                                   "num_gpus": self.gpus if gpus is None else gpus, "max_restarts": 0,
                                   "max_concurrency": 3}  # a cancel, or `take_usage`, while a stage runs
        if self.memory_mb and gpus is None:
            options["memory"] = self.memory_mb * 2**20
        if node is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
        elif avoid:
            options["label_selector"] = {"ray.io/node-id": f"!in({','.join(avoid)})"}
        return self._actor_cls.options(**options).remote(self._sources, self._preload, sorted(STAGE_ENV),
                                                          list(STAGE_ENV_PREFIXES))

    def _spawn(self, near: str | None = None, harness: bool = False) -> _Slot:
        """A fresh slot (the harness's share with `harness`), warming. Once `measure_in` chose the
        nodes, on one of them that is alive (`near`, the node of the slot it replaces, first; then
        the one with the fewest of our slots), never on a node found to measure otherwise. When none
        of them is alive (spot machines taken back, and the autoscaler's new ones in their place),
        on a live node not tried yet, each in turn, to learn what it measures with (one where a worker
        died warming: again after NODE_RETRY_S). When there is none either, asked of the cluster as
        it is, on any node but those: it waits, pending, for a node to join (the demand an autoscaler
        starts one for, where the cluster has no worker left), and what that node measures with
        decides whether it stays."""
        node, avoid = None, None
        if self._accept is not None:
            nodes = self._cluster_nodes()
            # the live nodes that could hold it at all; where the GCS did not answer, the nodes as they were
            alive = self._could_hold(nodes, harness) if nodes is not None else list(self._nodes)
            live = [n for n in self._nodes if n in alive and n not in self._foreign]
            held = [s.node for s in (*self._idle, *self._lent, *(s for _, _, s in self._refs.values()))]
            if near in live:
                node = near
            elif live:
                node = min(live, key=held.count)
            else:
                now = time.monotonic()
                untried = [n for n in alive if n not in self._foreign and n not in self._nodes
                           and (n not in self._failed or now - self._failed[n] >= NODE_RETRY_S)]
                if untried:
                    node = min(untried, key=held.count)
                else:
                    avoid = sorted(self._foreign | {n for n, t in self._failed.items() if now - t < NODE_RETRY_S})
        actor = (self._new_worker(gpus=self.harness_gpus, cpus=0, node=node, avoid=avoid) if harness
                 else self._new_worker(node=node, avoid=avoid))
        return _Slot(actor, pending=actor.warm.remote(), node=node)

    def _nodes_stale(self) -> bool:
        return self._nodes_seen is None or time.monotonic() - self._nodes_seen[0] >= NODES_TTL_S

    def _ask_nodes(self) -> tuple[float, list[dict[str, Any]] | None]:
        """(now, the cluster's nodes) from the GCS; None for the nodes when it did not answer."""
        try:
            return time.monotonic(), list(self.ray.nodes())
        except Exception:
            return time.monotonic(), None

    def _cluster_nodes(self) -> list[dict[str, Any]] | None:
        """The cluster's nodes as the GCS last told them, asked again no more often than every
        NODES_TTL_S, an answer or its failure (under `_lock`: several slots lost at once ask once, not
        once each); None when the GCS did not answer."""
        if self._nodes_stale():
            self._nodes_seen = self._ask_nodes()
        return self._nodes_seen[1] if self._nodes_seen is not None else None

    def _could_hold(self, nodes: list[dict[str, Any]], harness: bool = False) -> list[str]:
        """The live nodes among `nodes` big enough for a stage's slot (the harness's share with
        `harness`): a head node without CPUs is not."""
        cpus, gpus = (0, self.harness_gpus) if harness else (self.cpus, self.gpus)
        return [n["NodeID"] for n in nodes if n.get("Alive") and (n.get("Resources") or {}).get("CPU", 0) >= cpus
                and (n.get("Resources") or {}).get("GPU", 0) >= gpus - 1e-9]

    def environment_gone(self) -> str | None:
        """Why the stages can no longer run where `measure_in` chose: for ENV_GONE_S (less than the
        WARM_TIMEOUT_S after which the stages waiting fail) every live node that could hold a slot
        has been one found to measure with another environment (a cluster re-imaged with a new
        torch or driver, node by node, under a running loop). The loop stops then, and its next start
        measures in the cluster's environment (the baseline re-measured there). None otherwise: before
        `measure_in`; while a live node that could hold a slot is ours, or not known to measure
        otherwise (one that joined and was not tried yet: the autoscaler's replacement may be ours);
        while no such node is alive at all (an outage, not a move); while the GCS does not answer.
        Polled by the loop's thread (the node list is asked for outside `_lock`); the clock starts at
        its first call that sees the nodes gone."""
        if self._accept is None or self._closed:
            return None
        asked = self._ask_nodes() if self._nodes_stale() else None  # the GCS may be slow: not under the lock
        with self._lock:
            if self._accept is None or self._closed:
                return None
            if asked is not None:
                self._nodes_seen = asked
            for slot in self._idle:  # replacements that answered: their nodes learned
                self._usable(slot)
            nodes = self._cluster_nodes()
            if nodes is None:
                return None
            fit = self._could_hold(nodes)
            others = [n for n in fit if n in self._foreign]
            if not others or len(others) < len(fit):  # a node of ours, or one that may be, or none at all
                self._gone_since = None
                return None
            now = time.monotonic()
            if self._gone_since is None:
                self._gone_since = now
            if now - self._gone_since < ENV_GONE_S:
                return None
            return (f"every live node of the cluster that could hold a slot ({len(others)}) has measured with another "
                    f"environment for {now - self._gone_since:.0f} s: no node of the measurement environment is left")

    @property
    def slots(self) -> int:
        return self._slots

    def environments(self) -> list[tuple[dict[str, Any], int]]:
        """What the stage slots' nodes measure with (`environment.node_facts`), as (facts, how many
        slots), in the slots' order; a slot that did not say is left out."""
        groups: dict[str, tuple[dict[str, Any], list[int]]] = {}
        with self._lock:
            for slot in self._idle:
                if isinstance(slot.facts, dict):
                    key = json.dumps(slot.facts, sort_keys=True)
                    groups.setdefault(key, (slot.facts, [0]))[1][0] += 1
        return [(facts, n[0]) for facts, n in groups.values()]

    def measure_in(self, accept: Callable[[dict[str, Any]], bool]) -> int:
        """From now on, stages go only to slots whose node's facts `accept` takes (the driver's
        measurement environment: a cluster whose nodes differ, in the packages or GPU model the lab
        counts, would otherwise serve one node's outputs to another's runs under one cache key). The
        others' actors are ended, giving their CPUs and GPUs back to the cluster (another job may use
        them; the loop cannot), and every replacement from now on is placed on a node that measures
        with the driver's environment (Ray's node affinity), never elsewhere; one that landed on
        another node anyway (it was asked for before) is ended and asked for again. The harness's
        share is checked at its next call. Before any stage is submitted (the driver's start);
        returns how many slots were given back."""
        with self._lock:
            self._accept = accept
            before = self._released
            for slot in self._idle:
                self._usable(slot)  # each slot's node learned, in the slots' order
            self._sweep(replace=False)
            kept = [s.facts for s in self._idle if s.fits and isinstance(s.facts, dict)]
            if not kept:
                raise InfrastructureFailure("no slot of the cluster measures with the driver's environment")
            self._slots = len(self._idle)
            self.facts = kept[0]
            return self._released - before

    def _usable(self, slot: _Slot) -> bool:
        """Whether `slot` may get a stage: always, unless `measure_in` chose the nodes; then only once
        its node said what it measures with and that is the driver's (under `_lock`). A slot that
        died warming says nothing: its first stage fails as infrastructure and it is replaced."""
        if self._accept is None:
            return True
        self._learn(slot)
        if slot.pending is not None:
            return False
        if slot.fits is None:
            slot.fits = slot.facts is None or bool(self._accept(slot.facts))
            if slot.node and slot.facts is not None:  # what its node measures with: learned
                if not slot.fits:  # (a node of ours whose software changed in place: not ours any more)
                    self._foreign.add(slot.node)
                elif slot.node not in self._nodes and slot.node not in self._foreign:
                    self._nodes.append(slot.node)
        return slot.fits

    def _sweep(self, replace: bool = True) -> None:
        """End the idle slots on a node of another environment (`measure_in`), each with a fresh
        worker asked for in its place, on a node of the driver's, when `replace` (under `_lock`)."""
        if self._accept is None or self._closed:
            return
        for slot in list(self._idle):
            if self._usable(slot) or slot.pending is not None:
                continue
            self._idle.remove(slot)
            self._kill(slot)
            self._released += 1
            if replace and not self._closed:
                self._idle.append(self._spawn())

    def _stranded(self) -> str | None:
        """Why the jobs waiting can never start (under `_lock`): `measure_in` chose nodes, and no slot
        on them is idle, running, lent, or warming for less than WARM_TIMEOUT_S (their nodes were
        lost; the cluster's other nodes measure with another environment). None while one may come."""
        if self._accept is None or not self._waiting or self._refs or self._lent:
            return None
        now = time.monotonic()
        if any(self._usable(s) or (s.pending is not None and now - s.born < WARM_TIMEOUT_S) for s in self._idle):
            return None
        other = f" ({self._released} given back on nodes of another environment)" if self._released else ""
        return (f"no slot of the cluster measures with the driver's environment any more{other}: the nodes it "
                f"measured on are gone and no replacement started in {WARM_TIMEOUT_S:.0f} s")

    def _harness_slot(self) -> _Slot | None:
        """The harness's share, on a node of the driver's environment once `measure_in` chose one
        (under `_harness_lock`): one on another node is ended and another asked for there, a few
        times; then `InfrastructureFailure`."""
        for _ in range(4):
            with self._lock:
                if self._harness is None and self.harness_gpus and not self._closed:  # lost, none in its place
                    self._harness = self._spawn(harness=True)
                slot = None if self._closed else self._harness
            if slot is None or self._accept is None:
                return slot
            if slot.pending is not None:
                self.ray.wait([slot.pending], timeout=WARM_TIMEOUT_S)
            with self._lock:
                self._learn(slot)
                if slot.pending is not None:  # asked of the cluster and not placed: it stays asked for
                    raise InfrastructureFailure(
                        f"no node that measures with the driver's environment took the GPU share for prepare/score "
                        f"in {WARM_TIMEOUT_S:.0f} s")
                if not self._usable(slot) and slot.pending is None and self._harness is slot:
                    self._kill(slot)
                    self._harness = self._spawn(harness=True)
                    self._harness_inputs.clear()
                    continue
            return slot
        raise InfrastructureFailure("the GPU share for prepare/score lands on nodes that measure with another "
                                    "environment than the stages'")

    @staticmethod
    def _ident(folder: Path) -> str:
        """A folder's id on the nodes: its path, and its entries' names, sizes and mtimes."""
        key = str(folder.resolve())
        h = hashlib.sha256(key.encode())
        for p in sorted(folder.rglob("*")):
            st = p.lstat()  # a symlink (even a dangling one) counts as itself
            h.update(f"{p.relative_to(folder)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return h.hexdigest()[:24]

    def _input(self, folder: Path, keep: bool = True) -> tuple[str, Any]:
        """(id, ref) for an input folder. Folders the driver hands out (dataset by id, cache entries
        by key) never change once written; the id still hashes names, sizes and mtimes, so a node's
        unpacked copy can never stand for different content at a reused path. `keep`: pinned for
        reuse by later stages (the driver's thread only; `run_ahead`'s throwaway folders are not)."""
        key = str(folder.resolve())
        if keep and key in self._inputs:
            self._inputs.move_to_end(key)
            return self._inputs[key]
        got = (self._ident(folder), self.ray.put(ray_task.pack(key)))
        if keep:
            self._inputs[key] = got
            while len(self._inputs) > MAX_PINNED_INPUTS:  # a job in flight holds its own refs
                self._inputs.popitem(last=False)
        return got

    def submit(self, job: StageJob) -> None:
        if job.job_id in self._refs or any(w[0].job_id == job.job_id for w in self._waiting):
            raise InfrastructureFailure(f"job {job.job_id} already submitted")
        self._waiting.append(self._spec(job))
        self._dispatch()

    def _spec(self, job: StageJob, keep: bool = True) -> tuple[StageJob, dict[str, Any], list[Any], list[Any]]:
        """What a slot's `run` takes for `job`: its spec, its code view's ref, its input folders' refs."""
        mounts = []
        for folder in job.inputs:
            ident, ref = self._input(folder, keep)
            mounts.append((str(folder), ident, [ref]))
        tree_id, tree_ref = self._input(job.cwd, keep)  # the stage's code view, not the whole commit
        spec = {
            "job_id": job.job_id, "tree_id": tree_id, "argv": job.argv, "cwd": str(job.cwd),
            "sandbox": job.sandbox, "gpus": job.gpus,
            "out": str(job.out), "timeout_s": job.timeout_s, "cpus": job.cpus, "memory_mb": job.memory_mb,
            "env": thread_env(job.cpus) | job.env,  # the lab's `[run] env`: the driver's values
            "env_allow": sorted(STAGE_ENV), "env_prefixes": list(STAGE_ENV_PREFIXES),
        }
        return job, spec, [tree_ref], mounts

    def _learn(self, slot: _Slot) -> None:
        """The GPUs and node facts of a replacement actor, once its `warm` has answered (under `_lock`)."""
        if slot.pending is not None and self.ray.wait([slot.pending], timeout=0)[0]:
            try:
                slot.heard(self.ray.get(slot.pending))
            except self.ray.exceptions.RayError:  # it died warming: its first stage says so, as infra
                if slot.node and slot.node not in self._nodes:  # a node tried for it: not again for a while
                    self._failed[slot.node] = time.monotonic()  # (a node out of memory then may have room later)
            slot.pending = None

    def _unknown(self, slot: _Slot) -> bool:
        """Whether `slot` may hold a GPU we cannot name yet (a replacement that has not answered, and
        not one Ray has failed to place for `WARM_TIMEOUT_S`: that one holds nothing)."""
        self._learn(slot)
        if not self.gpus or slot.gpus:
            return False
        return slot.pending is not None and time.monotonic() - slot.born < WARM_TIMEOUT_S

    def _running(self) -> list[_Slot]:
        """Slots a stage of ours runs on now: the driver's, and those run ahead (under `_lock`)."""
        return [s for _, s in self._running_jobs()]

    def _running_jobs(self) -> list[tuple[str, _Slot]]:
        """(job id, slot) of every stage of ours running now (under `_lock`)."""
        return [*((j, s) for j, (_, _, s) in self._refs.items()), *((j, s) for s, j in self._lent.items() if j)]

    def _busy_gpus(self) -> set[str]:
        """The GPUs a stage of ours runs on now: the driver's, and those run ahead (under `_lock`)."""
        return {g for s in self._running() for g in s.gpus}

    def _free_slot(self, job_id: str | None = None) -> _Slot | None:
        """An idle slot for `job_id` (under `_lock`). Nothing lands on a GPU a CUDA OOM's retry holds
        whole; a retry waits, first come first served among retries, until no stage of ours runs on
        its GPU, then takes a slot there (or, if that GPU's slots are all gone, any GPU it finds idle)."""
        if job_id not in self._alone:
            held = set().union(*self._alone.values())
            for slot in self._idle:
                if not self._usable(slot):
                    continue
                if held and self._unknown(slot):  # it may sit on the GPU a retry holds: not while one does
                    continue
                if not set(slot.gpus) & held:
                    return slot
            return None
        order = list(self._alone)
        held = set().union(*(self._alone[j] for j in order[:order.index(job_id)]))  # retries ahead of it
        mine, busy = self._alone[job_id], self._busy_gpus()
        if any(self._unknown(s) for s in self._running()):  # one may run on its GPU: not alone yet
            return None
        everyone = [*self._idle, *(s for _, _, s in self._refs.values()), *self._lent]
        if not any(set(s.gpus) & mine for s in everyone) and not any(self._unknown(s) for s in everyone):
            for slot in self._idle:  # its GPU's slots are gone (a lost node): any GPU with nothing on it
                if self._usable(slot) and slot.gpus and not set(slot.gpus) & (held | busy):
                    self._alone[job_id] = set(slot.gpus)
                    return slot
            return None
        if busy & mine:
            return None
        return next((s for s in self._idle if set(s.gpus) & mine and not set(s.gpus) & held and self._usable(s)), None)

    def _mark_crowded(self, job_id: str, slot: _Slot) -> None:
        """`job_id` starts on `slot`: it and every stage of ours on the same GPU shared it (under `_lock`)."""
        unknown = self.gpus and not slot.gpus  # a replacement not heard from: it may share with anyone
        others = [j for j, s in self._running_jobs() if s is not slot and (unknown or set(s.gpus) & set(slot.gpus))]
        if others:
            self._crowded |= {job_id, *others}

    def _dispatch(self) -> None:
        """Start each waiting job that has a free slot, in order; while `borrow` waits for a slot, only
        a CUDA OOM's retry (whose GPU it could not take anyway)."""
        with self._lock:
            self._sweep()
            why = self._stranded()
            if why is not None:  # an infrastructure failure each (the driver retries, then gives up), not a hang
                while self._waiting:
                    self._cancelled.append(self._forget(self._waiting.popleft()[0].job_id, "infra", why))
                return
            for item in list(self._waiting):
                job, spec, tree, mounts = item
                if self._borrowers and job.job_id not in self._alone:
                    continue
                slot = self._free_slot(job.job_id)
                if slot is None:
                    continue
                self._waiting.remove(item)
                self._idle.remove(slot)
                self._mark_crowded(job.job_id, slot)
                try:
                    ref = slot.actor.run.remote(spec, tree, mounts)
                except Exception as e:  # the job cannot be sent: its infrastructure failure, the slot kept
                    self._idle.append(slot)
                    self._cancelled.append(self._forget(job.job_id, "infra", f"cannot start the stage: {e}"))
                    continue
                self._refs[job.job_id] = (ref, job, slot)
                self._began[job.job_id] = time.monotonic()

    def _forget(self, job_id: str, status: str, detail: str) -> JobResult:
        """The result of a job that ends without running (again): its retry's state dropped, a lost
        first attempt still booked."""
        with self._lock:
            self._alone.pop(job_id, None)
        self._crowded.discard(job_id)
        lost = self._retried.pop(job_id, None)
        began = self._began.pop(job_id, None)  # a stage lost with its actor held its slot's GPUs until now
        return JobResult(job_id, status, detail=detail, wall_s=time.monotonic() - began if began else 0.0,  # type: ignore[arg-type]
                         extra={"gpu_oom_retried_alone": lost} if lost else {})

    def poll(self, timeout: float = 0.0) -> list[JobResult]:
        done, self._cancelled = self._cancelled, []
        if not self._refs:
            self._dispatch()  # what waited for a slot lent to `borrow`, given back since
            if not self._refs:
                if not done and not self._cancelled and self._waiting and timeout > 0:  # wait for a slot, do not spin
                    with self._lock:
                        self._lock.wait(timeout)
                    self._dispatch()
                done, self._cancelled = done + self._cancelled, []
                return done
        ray = self.ray
        by_ref = {ref: job_id for job_id, (ref, _, _) in self._refs.items()}
        ready, rest = ray.wait(list(by_ref), num_returns=1, timeout=0 if done else timeout)
        if ready and rest:
            more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
            ready += more
        for ref in ready:
            with self._lock:  # `borrow`'s thread reads which GPUs are busy
                _, job, slot = self._refs.pop(by_ref[ref])
            kept, retried = True, False
            try:
                res, kept = self._result(job, ref, slot)
                retried = self._retry_alone(job, slot, res)  # its GPU held before the slot is free to take
            except Exception as e:  # e.g. its log cannot be written here: the machinery's failure
                res = self._forget(job.job_id, "infra", f"collecting the stage's result: {e}")
            finally:
                if kept:
                    self._give_back(slot)
                else:
                    self._replace(slot)
            if not retried:
                done.append(res)
        self._dispatch()
        return done

    def _retry_alone(self, job: StageJob, slot: _Slot, res: JobResult) -> bool:
        """A stage that ran out of CUDA memory on a GPU another of our stages used meanwhile goes back
        to wait for that GPU alone (once), first in line; its first attempt is kept, as lost. As
        locally, the OOM is read from the stage's log, which branch code writes (`LocalExecutor._retry_alone`)."""
        crowded = job.job_id in self._crowded
        self._crowded.discard(job.job_id)
        if not crowded or not slot.gpus or "gpu_oom_retried_alone" in res.extra or not _oom(res, job):
            return False
        try:
            item = self._spec(job)
            note_retry_alone(job.log_path)
        except Exception:  # its code view or inputs cannot be sent again: the failure stands
            return False
        self._retried[job.job_id] = {"cpu_s": res.cpu_s, "wall_s": res.wall_s, "gpu_s": res.wall_s * job.gpus}
        with self._lock:
            self._alone[job.job_id] = set(slot.gpus)
        self._waiting.appendleft(item)
        return True

    def _result(self, job: StageJob, ref: Any, slot: _Slot, again: bool = False) -> tuple[JobResult, bool]:
        """The finished job's result, its output unpacked and its log written, and whether its slot
        is still good (False: Ray lost the actor; the caller replaces it). `again`: a second attempt."""
        job_id = job.job_id
        retry = again or job_id in self._retried  # its log follows the first attempt's
        ray = self.ray
        try:
            res: dict[str, Any] = ray.get(ref)
        except ray.exceptions.RayError as e:  # the actor or its node died, an object was lost
            return self._forget(job_id, "infra", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"), False
        self._began.pop(job_id, None)
        slot.gpus = list(res.get("gpus") or slot.gpus)
        extra: dict[str, object] = {}
        if res.get("gpu_util") is not None:
            extra["gpu_util"], extra["gpu_samples"] = float(res["gpu_util"]), int(res.get("gpu_samples") or 0)
        if isinstance(res.get("env"), dict):  # the node's measurement environment (`environment.node_facts`)
            extra["env"] = res["env"]
        with self._lock:
            alone = self._alone.pop(job_id, None)
        if alone is not None:
            extra["gpu_share"] = float(max(1, round(job.gpus)))  # it held its GPU whole
        if job_id in self._retried:
            extra["gpu_oom_retried_alone"] = self._retried.pop(job_id)
        job.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(job.log_path, "ab" if retry else "wb") as log:
            log.write(res["log"])
        if res["status"] == "ok":
            job.out.mkdir(parents=True, exist_ok=True)
            try:  # no entry written through a link; a link, hard link or device refused
                safefs.extract_tar(io.BytesIO(res["out"]), job.out, what="the stage's output")
            except (tarfile.TarError, OSError) as e:  # the stage's doing: nothing of it is kept (its links neither)
                shutil.rmtree(job.out, ignore_errors=True)  # rmtree never follows a link
                with open(job.log_path, "ab") as log:
                    log.write(f"\nray executor: output not kept: {e}\n".encode())
                return JobResult(job_id, "exit", exit_code=1, cpu_s=float(res["cpu_s"]), wall_s=float(res["wall_s"]),
                                 host=res["host"], detail=f"output not kept: {str(e)[:200]}", extra=extra), True
        return JobResult(job_id, res["status"], exit_code=res["exit_code"], signal=res["signal"],
                         cpu_s=float(res["cpu_s"]), wall_s=float(res["wall_s"]), host=res["host"],
                         detail=res.get("detail"), extra=extra), True

    def _give_back(self, slot: _Slot) -> None:
        """`slot` is idle again (a lent one included); after `close`, its actor is ended instead."""
        with self._lock:
            self._lent.pop(slot, None)
            if not self._closed:
                if slot not in self._idle:
                    self._idle.append(slot)
                self._lock.notify_all()
                return
        self._kill(slot)

    def _replace(self, slot: _Slot) -> None:
        """Ray lost `slot`'s actor (or its state is unknown): ended, and a fresh warm worker in its place."""
        self._kill(slot)
        with self._lock:
            self._lent.pop(slot, None)
            if not self._closed:
                self._idle.append(self._spawn(near=slot.node))
                self._lock.notify_all()

    def run_harness(self, argv: list[str], *, cwd: Path, ro: list[Path | str], rw: list[Path | str],
                    out: Path | None, stdout: Path | None, log: Path, timeout_s: float,
                    sandbox: dict[str, Any] | None, env: dict[str, str], gpus: float, stop: Any = None,
                    cpus: int = 1, memory_mb: int | None = None) -> dict[str, Any]:
        """A harness command (`prepare`, `score`) given a GPU, run on the cluster on the executor's
        harness share (`isolation.run_once` calls it inside `isolation.gpu_runner`, which the driver
        and the smoke run open when this executor holds such a share).

        `cwd` (the trusted files) and the folders of `ro` travel as input trees, unpacked in the
        job's own folder on the node and removed with it (a file of `ro` travels alone: the
        predictions, not the rest of their stage's output); `rw` and `out` are folders it writes,
        sent back and unpacked into them, as `stdout` and `log` are written here. Returns
        `isolation.Completed`'s fields; `stop` (anything with `is_set`) or `close` cancels it
        (`Interrupted`), a node or actor lost is `InfrastructureFailure`."""
        if gpus > self.harness_gpus + 1e-9:
            raise InfrastructureFailure(f"{argv[0]} asks {gpus:g} GPU but the executor holds {self.harness_gpus:g} "
                                        "for prepare/score")
        while not self._harness_lock.acquire(timeout=0.2):  # another call holds the share: a stop ends the wait
            if self._closed or (stop is not None and stop.is_set()):
                raise Interrupted(f"stopping: {Path(argv[0]).name} abandoned while it waited for the harness's share",
                                  started=False)
        try:
            try:
                slot = self._harness_slot()
            except InfrastructureFailure:
                if self._closed or (stop is not None and stop.is_set()):  # a stop is a stop, not a lost node
                    raise Interrupted(f"stopping: {Path(argv[0]).name} abandoned", started=False) from None
                raise
            if slot is None:
                raise Interrupted(f"stopping: {Path(argv[0]).name} abandoned (the Ray executor is closed)",
                                  started=False)
            return self._run_harness(slot, argv, cwd, ro, rw, out, stdout, log, timeout_s, sandbox, env,
                                     stop, cpus, memory_mb, gpus)
        finally:
            self._harness_lock.release()

    def _harness_input(self, folder: Path) -> tuple[str, Any]:
        """`_input` for the harness's own folders (the trusted files, the sealed data: they do not
        change), kept for its later calls (under `_harness_lock`)."""
        ident = self._ident(folder)
        got = self._harness_inputs.get(str(folder))
        if got is None or got[0] != ident:
            got = self._input(folder, keep=False)
            self._harness_inputs[str(folder)] = got
            while len(self._harness_inputs) > 8:
                self._harness_inputs.pop(next(iter(self._harness_inputs)))
        return got

    def _run_harness(self, slot: _Slot, argv: list[str], cwd: Path, ro: list[Path | str], rw: list[Path | str],
                     out: Path | None, stdout: Path | None, log: Path, timeout_s: float,
                     sandbox: dict[str, Any] | None, env: dict[str, str], stop: Any, cpus: int,
                     memory_mb: int | None, gpus: float) -> dict[str, Any]:
        import tempfile
        import uuid

        ray = self.ray
        name = Path(argv[0]).name
        self._learn(slot)
        job_id = f"harness-{uuid.uuid4().hex}"
        writes = [Path(p) for p in rw] + ([Path(out)] if out is not None else [])
        log.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".harness-", dir=log.parent) as tmp:
            mounts, seen = [], {str(Path(cwd)), *map(str, writes)}
            for i, path in enumerate(map(Path, ro)):
                folder = path if path.is_dir() else path.parent
                if str(folder) in seen:
                    continue
                seen.add(str(folder))
                if path.is_dir():
                    ident, ref = self._harness_input(path)
                else:  # the file alone, in a folder of its own standing for its folder on the node
                    alone = Path(tmp) / f"file{i}"
                    alone.mkdir()
                    shutil.copyfile(path, alone / path.name, follow_symlinks=False)
                    ident, ref = self._input(alone, keep=False)
                mounts.append((str(folder), ident, [ref]))
            tree_id, tree_ref = self._harness_input(Path(cwd))
            back = Path(tmp) / "out"
            spec = {
                "job_id": job_id, "tree_id": tree_id, "argv": argv, "cwd": str(cwd), "sandbox": sandbox, "gpus": gpus,
                "out": str(back), "outs": {str(w): f"w{i}" for i, w in enumerate(writes)}, "stdout": stdout is not None,
                "private": True, "timeout_s": timeout_s, "cpus": cpus, "memory_mb": memory_mb, "env": env,
                "env_allow": sorted(STAGE_ENV), "env_prefixes": list(STAGE_ENV_PREFIXES),
            }
            started = time.monotonic()
            deadline = started + timeout_s + HARNESS_GRACE_S  # the node kills it at timeout_s; past this, it is lost
            asked: float | None = None
            try:
                ref = slot.actor.run.remote(spec, [tree_ref], mounts)
                while not ray.wait([ref], timeout=0.2)[0]:
                    if self._closed or (stop is not None and stop.is_set()):
                        asked = asked or time.monotonic()
                        slot.actor.cancel.remote(job_id)  # again each pass: one sent while the node unpacks is not heard
                        if time.monotonic() - asked > HARNESS_GRACE_S:
                            self._replace_harness(slot)
                            raise Interrupted(f"stopping: {name} abandoned")
                    elif time.monotonic() > deadline:
                        self._replace_harness(slot)
                        raise InfrastructureFailure(f"{name} on the Ray cluster did not answer in {timeout_s:.0f} s")
            except (Interrupted, InfrastructureFailure):
                raise
            except Exception as e:  # Ray going away under `close`, or an actor lost before it answered
                if self._closed:
                    raise Interrupted(f"stopping: {name} abandoned (the Ray executor is closed)") from None
                raise InfrastructureFailure(f"{name} on the Ray cluster: {type(e).__name__}: {e}") from None
            try:
                res: dict[str, Any] = ray.get(ref)
            except ray.exceptions.RayError as e:
                if self._closed or asked:
                    raise Interrupted(f"stopping: {name} abandoned") from None
                if isinstance(e, ray.exceptions.RayActorError):  # the actor or its node died: a fresh one
                    self._replace_harness(slot)
                first = str(e).splitlines()[0][:300] if str(e) else ""
                raise InfrastructureFailure(f"{name} on the Ray cluster: {type(e).__name__}: {first}") from None
            log.write_bytes(res.get("log") or b"")
            if stdout is not None:
                Path(stdout).write_bytes(res.get("stdout") or b"")
            status = res["status"]
            if status == "infra" or (status == "cancelled" and not asked):  # the node's doing, not the harness's
                raise InfrastructureFailure(f"{name} on the Ray cluster: {res.get('detail') or status}")
            if status == "ok":  # no entry written through a link; a link, hard link or device refused
                back.mkdir()
                safefs.extract_tar(io.BytesIO(res["out"]), back, what=f"{name}'s output")
                for i, w in enumerate(writes):  # into the folders the caller made
                    got = back / f"w{i}"
                    for entry in (got.iterdir() if got.is_dir() else ()):
                        os.replace(entry, w / entry.name)
        return {"returncode": res["exit_code"] if status in ("ok", "exit") else None,
                "signal": res["signal"], "timed_out": status == "timeout", "cpu_s": float(res["cpu_s"]),
                "wall_s": float(res["wall_s"]) or time.monotonic() - started, "interrupted": bool(asked)}

    def _replace_harness(self, slot: _Slot) -> None:
        """A fresh actor for the harness's share (under `_harness_lock`), unless the executor closed."""
        self._kill(slot)
        self._harness_inputs.clear()  # refs that may have gone with it
        with self._lock:
            if self._harness is slot and not self._closed:
                self._harness = self._spawn(near=slot.node, harness=True)

    def _kill(self, slot: _Slot) -> None:
        try:
            self.ray.kill(slot.actor)
        except Exception:  # already gone with its node, or Ray itself is down
            pass

    def gpu_usage(self, wait: bool = False) -> dict[str, object] | None:
        """Every GPU our actors hold, sampled on its node (NVML), since the executor started: each GPU
        counted once (one slot on it reports it), summed over GPUs, so the busy share is the mean over
        the GPUs of the time each was busy. None where no node samples (no NVML, no GPU).

        It counts the answers to the previous call's questions and asks again, without waiting (the
        driver calls it every few seconds; a lost node's actor never holds it up); with `wait` (the
        driver's last call) it then waits up to 2 s for the new answers too."""
        self._count_usage(0)
        self._ask_usage()
        if wait:
            self._count_usage(2.0)
        if not self._usage_gpus:
            return None
        n, busy, util = self._usage
        return {"samples": n, "busy": busy, "util_sum": util, "busy_share": busy / n if n else None,
                "mean_util": util / n if n else None, "gpus": sorted(self._usage_gpus),
                "holder": f"ray:{socket.gethostname()}:{os.getpid()}:{self._started_at:.3f}"}

    def _count_usage(self, timeout: float) -> None:
        """Add the answers to `take_usage` that came within `timeout` s; forget those too long awaited."""
        if not self._usage_asked:
            return
        ray = self.ray
        ready, _ = ray.wait(list(self._usage_asked), num_returns=len(self._usage_asked), timeout=timeout)
        for ref in ready:
            slot, _ = self._usage_asked.pop(ref)
            try:
                got = ray.get(ref)
            except ray.exceptions.RayError:  # an actor lost meanwhile: its samples with it
                continue
            if slot in self._fresh:  # samples since it started, not since the last answer counted
                self._fresh.discard(slot)
                continue
            for key, (n, busy, util) in got.items():
                if self._reporter.get(key) is slot:
                    self._usage[0] += int(n)
                    self._usage[1] += int(busy)
                    self._usage[2] += float(util)
                    self._usage_gpus.add(key)
        now = time.monotonic()
        for ref, (_, asked_at) in list(self._usage_asked.items()):
            if now - asked_at > USAGE_GIVE_UP_S:  # its node hangs: ask its successor instead
                del self._usage_asked[ref]

    def _ask_usage(self) -> None:
        """Ask each GPU's reporting slot for its samples since it was last asked (unless it has not
        answered yet). One slot per GPU reports it; a new reporter's first answer is not counted."""
        with self._lock:  # the harness's share counts too: allocated, idle between its calls
            slots = [*self._idle, *(s for _, _, s in self._refs.values()), *self._lent,
                     *([self._harness] if self._harness else [])]
        alive = set(slots)
        for slot in slots:
            for key in slot.gpus:
                if self._reporter.get(key) not in alive:
                    self._reporter[key] = slot
                    self._fresh.add(slot)
        waiting = {slot for slot, _ in self._usage_asked.values()}
        for slot in set(self._reporter.values()) & alive:
            if slot not in waiting:
                self._usage_asked[slot.actor.take_usage.remote()] = (slot, time.monotonic())

    def borrow(self, stop: threading.Event | None = None) -> _Slot:
        """A slot lent to the caller's thread until `give_back_lent` (for `run_ahead`): the next one to
        come free, before every job queued here; while the caller waits, no queued job starts (but a
        CUDA OOM's retry). The thread that submits and polls must keep polling: it frees the slots.
        `stop` ends the wait (`Interrupted`); a closed executor raises `InfrastructureFailure`."""
        with self._lock:
            self._borrowers += 1
            try:
                while True:
                    if self._closed:
                        raise InfrastructureFailure("the Ray executor was closed")
                    if stop is not None and stop.is_set():
                        raise Interrupted("stopping: a stage run ahead of the queue was abandoned")
                    slot = self._free_slot()
                    if slot is not None:
                        self._idle.remove(slot)
                        self._lent[slot] = None
                        return slot
                    self._lock.wait(0.2)
            finally:
                self._borrowers -= 1

    def give_back_lent(self, slot: _Slot) -> None:
        with self._lock:
            if slot not in self._lent:  # given back (or replaced) already
                return
        self._give_back(slot)

    @property
    def closed(self) -> bool:
        return self._closed

    def run_ahead(self, job: StageJob, stop: threading.Event | None = None, slot: _Slot | None = None) -> JobResult:
        """Run `job` before every job queued here and wait for its result, from a thread other than
        the one that submits and polls: on `slot` (from `borrow`, kept by the caller while it is good:
        a smoke run keeps one for all its stages), else on the next slot to come free (`borrow`,
        given back after). A CUDA out-of-memory on a GPU another of our stages used meanwhile runs
        again with the GPU alone, as queued stages do. After a result `infra`, or any exception, the
        slot is no longer the caller's (replaced, or given back). `stop`, or `close`, cancels the
        stage: `Interrupted`."""
        own = slot is None
        slot = self.borrow(stop) if slot is None else slot
        try:
            res, kept = self._run_lent(job, slot, stop, alone=False)
            if kept and job.job_id in self._crowded and slot.gpus and _oom(res, job):
                note_retry_alone(job.log_path)
                first = res
                res, kept = self._run_lent(job, slot, stop, alone=True)
                lost = {"cpu_s": first.cpu_s, "wall_s": first.wall_s, "gpu_s": first.wall_s * job.gpus}
                res = dataclasses.replace(res, extra={**res.extra, "gpu_oom_retried_alone": lost})  # booked as lost
        except BaseException as e:
            with self._lock:  # raised between attempts (reading its log): the slot is good, and not the caller's
                idle_lent = slot in self._lent and self._lent[slot] is None
            if idle_lent:
                self._give_back(slot)
            if isinstance(e, Exception) and not isinstance(e, (Interrupted, InfrastructureFailure)):
                e = (Interrupted("stopping: a stage run ahead of the queue was abandoned") if self._closed
                     else InfrastructureFailure(f"a stage run ahead of the queue: {type(e).__name__}: {e}"))
                raise e from None
            raise
        finally:
            self._crowded.discard(job.job_id)
            with self._lock:
                self._alone.pop(job.job_id, None)
                self._lock.notify_all()
        if not kept:
            self._replace(slot)
        elif own or res.status == "infra":
            self._give_back(slot)
        return res

    def _run_lent(self, job: StageJob, slot: _Slot, stop: threading.Event | None, alone: bool) -> tuple[JobResult, bool]:
        """One attempt of `run_ahead` on the lent `slot`: (its result, whether the slot is still good).
        It waits while a CUDA OOM's retry holds the slot's GPU (or, `alone`, until no other stage of
        ours runs there). An exception leaves the slot given back (nothing ran) or replaced."""
        stopped = lambda: self._closed or (stop is not None and stop.is_set())  # noqa: E731
        try:
            item = self._spec(job, keep=False)
            with self._lock:
                if alone:
                    self._alone[job.job_id] = set(slot.gpus)
                while not stopped():
                    order = list(self._alone)
                    ahead = order[:order.index(job.job_id)] if job.job_id in self._alone else order
                    held = set().union(*(self._alone[j] for j in ahead))
                    near = [s for s in self._running() if s is not slot]
                    others = {g for s in near for g in s.gpus}
                    if held and self._unknown(slot) or set(slot.gpus) & held:
                        pass  # a retry ahead holds this GPU (or may: this slot has not named its GPUs yet)
                    elif alone and (set(slot.gpus) & others or any(self._unknown(s) for s in near)):
                        pass  # alone: until no other stage of ours may run on the GPU
                    else:
                        break
                    self._lock.wait(0.2)
                if not stopped():
                    self._mark_crowded(job.job_id, slot)
                    self._lent[slot] = job.job_id
        except BaseException:  # nothing ran on it: the slot is good
            self._give_back(slot)
            raise
        if self._lent.get(slot) != job.job_id:
            self._give_back(slot)
            raise Interrupted("stopping: a stage run ahead of the queue was abandoned")
        ray = self.ray
        cancelled = False
        try:
            ref = slot.actor.run.remote(item[1], item[2], item[3])
            self._began[job.job_id] = time.monotonic()  # lost with its actor: booked for the time it held the GPU
            while not ray.wait([ref], timeout=0.2)[0]:
                if stopped():  # again each pass: one sent while the node still unpacks is not heard
                    slot.actor.cancel.remote(job.job_id)
                    cancelled = True
            res, kept = self._result(job, ref, slot, again=alone)
        except BaseException:  # a Ray gone under it (`close`), a ^C: the slot's state is unknown
            self._replace(slot)
            raise
        with self._lock:
            if slot in self._lent:
                self._lent[slot] = None  # lent still, but nothing runs on it
                self._lock.notify_all()
        if cancelled:
            (self._give_back if kept else self._replace)(slot)
            raise Interrupted("stopping: a stage run ahead of the queue was abandoned")
        return res, kept

    def cancel(self, job_id: str) -> None:
        for i, (job, *_rest) in enumerate(self._waiting):
            if job.job_id == job_id:
                del self._waiting[i]
                self._cancelled.append(self._forget(job_id, "cancelled", "cancelled"))
                return
        entry = self._refs.get(job_id)
        if entry is not None:
            entry[2].actor.cancel.remote(job_id)  # its warm worker kills the stage; run() then returns

    def close(self) -> None:
        with self._lock:
            self._closed = True  # a `borrow` waiting gives up; a `run_ahead` running cancels its stage
            self._lock.notify_all()
        for job_id in list(self._refs):
            self.cancel(job_id)
        if self._refs:
            self.ray.wait([r for r, _, _ in self._refs.values()], num_returns=len(self._refs), timeout=10)
        deadline = time.monotonic() + 10
        with self._lock:  # a stage run ahead ends (cancelled) before Ray may go
            while any(self._lent.values()) and time.monotonic() < deadline:
                self._lock.wait(0.2)
            slots = [*self._idle, *(s for _, _, s in self._refs.values()), *self._lent,
                     *([self._harness] if self._harness else [])]
            self._harness = None
            self._alone.clear()
            self._crowded.clear()
            self._retried.clear()
            self._began.clear()
        for slot in slots:
            self._kill(slot)
        if self._harness_lock.acquire(timeout=HARNESS_GRACE_S):  # a harness call ends (`Interrupted`) first
            self._harness_lock.release()
        self._harness_inputs.clear()
        self._refs.clear()
        self._idle.clear()
        self._usage_asked.clear()
        self._reporter.clear()
        self._fresh.clear()
        self._waiting.clear()
        self._inputs.clear()
        if self._owns_ray:
            self.ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> "RayExecutor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
