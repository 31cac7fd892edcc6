"""The driver: the one thing that executes runs. It works a lab's queue in a store through an executor.

    from pipeline.experiment import Experiment, ensure_runs, open_store
    store = open_store(lab)                               # SQLite in runs/, or any SQLAlchemy URL
    ids = ensure_runs(store, lab, "hyp/3-lr", tasks, seeds=[0, 1])   # idempotent
    with Experiment(lab, store).driver("local") as driver:
        driver.drive(until=ids)                           # returns when those runs are terminal
    store.results_by_task(sha, tasks)                     # {task: {seed: value | None}}
    store.goodput()                                       # useful / lost / saved compute

Queueing runs and reading results are not here: `pipeline.experiment` queues them (by revision),
the store reads them. The driver:

- claims queued runs atomically, expands each into its stage DAG (`pipeline.dag`), serves stages
  from the cache or submits them to the executor, and scores the final stage's `predictions.csv`
  with the harness's sealed scorer, in this process, never in branch code.
- is long-lived: `drive()` returns when its condition holds and leaves other claimed runs in flight
  for the next call; `close()` cancels and re-queues what is left. At start it reconciles the queue
  (runs of dead drivers go back to the queue under the same key), repairs worktrees, removes
  half-written cache entries, and joins the process's heartbeat (`pipeline.lease.Heartbeat`) or
  starts one.
- records method failures (non-zero exit, crash signal, timeout in branch code; missing, malformed
  or non-finite predictions) as results with `value = None`. Infrastructure failures (killed
  worker, lost node) are retried with the same seed up to `run.retries`, then recorded as
  `infra_failure` results, which every comparison leaves out (`pipeline.outcomes`).
- takes stage definitions, `[run]` and `[benchmark]` from the lab's `research.toml` as it loaded
  it (not from the commit under test): the agent may not edit it, so a challenger cannot change
  how it is measured. The commit decides only the code the stages run.

`python -m pipeline.runner LAB` drives a lab's queue from the command line (ops and tests).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline import environment, isolation
from pipeline.dag import Cache, StageNode, check_not_sealed, input_digests, plan_run, render
from pipeline.disk import DiskKeeper
from pipeline.executors import Executor, ExecutorOptions, StageJob, classify, make_executor
from pipeline.executors.base import lab_env
from pipeline.harness import Harness, Prepared
from pipeline.lab import Lab, load_lab
from pipeline.lease import Heartbeat
from pipeline.outcomes import ResultOutcome, StageOutcome
from pipeline.safefs import UnsafeTree
from pipeline.gpu_accounting import GpuAccounting
from pipeline.scoring import Scoring
from pipeline.store import Claim, Owner, Result, Store
from pipeline.worktrees import InfrastructureFailure, Worktrees

log = logging.getLogger("autoresearch.runner")

__all__ = ["Driver", "make_executor"]


GPU_USAGE_EVERY_S = 5.0  # how often the GPU sampler's totals are written to the store
CLAIM_IDLE_S = 0.1  # after a claim found the queue empty, the driver claims again no sooner than this


@dataclass
class _Active:
    """A claimed run being worked on by this driver."""

    claim: Claim
    worktree: Path
    nodes: list[StageNode]
    final: StageNode
    done: dict[str, Path] = field(default_factory=dict)
    pending: set[str] = field(default_factory=set)  # stages queued, in flight or awaited
    cpu_s: float = 0.0
    infra_failures: int = 0
    recorded_failures: dict[str, tuple[str, str]] = field(default_factory=dict)  # its keys' before this driver
    env_id: str | None = None  # where its final stage's output was made (a MeasureEnv; None: unknown)


@dataclass
class _Flight:
    """A stage job in the executor, and every run waiting for its key."""

    node: StageNode
    job: StageJob
    exec_id: int
    lead: int
    waiters: list[int]
    tmp: Path


def choose_environment(lab: Lab, executor: Executor, prefer: str | None = None) -> str | None:
    """Where the executor's slots sit on nodes that measure with different environments (as the
    lab counts them: `[run] environment`, the GPU model for a GPU lab), keep the stages on one
    environment's nodes (`RayExecutor.measure_in`): the cache key holds one environment, and a
    run's stages (and the arms of a pair) must be measured in it. The one chosen: `prefer` where
    the cluster has it (the baseline's: nothing to re-measure), else the one with the most slots
    (the first of those). On a cluster of like nodes too, so that a node that joins later with
    another environment gets no stage. The other nodes' slots are given back to the cluster. Returns
    what was given back and why, in one line; None when nothing was."""
    environments = getattr(executor, "environments", None)
    if not callable(environments):
        return None
    groups: dict[str, tuple[Any, int]] = {}  # environment id → (Environment, slots), first seen first
    for facts, n in environments():
        env = lab.config.run.environment_of(facts)
        groups[env.id] = (env, groups.get(env.id, (env, 0))[1] + n)
    if not groups:
        return None
    chosen = prefer if prefer in groups else max(groups, key=lambda k: groups[k][1])
    # on a cluster of like nodes too: a node that joins later with another environment gets no stage
    executor.measure_in(lambda facts: lab.config.run.environment_of(facts).id == chosen)  # type: ignore[attr-defined]
    if len(groups) < 2:
        return None
    mine, total = groups[chosen], sum(n for _, n in groups.values())
    others = "; ".join(f"{n} with {environment.change(mine[0], env)}" for k, (env, n) in groups.items() if k != chosen)
    return (f"{total - mine[1]} of {total} slots given back to the cluster: their nodes measure with another "
            f"environment ({others}); stages run on the {mine[1]} that measure with {mine[0].brief()}")


class Driver(Scoring, GpuAccounting):
    """Drives the queue of one lab through one executor. See the module docstring."""

    def __init__(self, lab: Lab, store: Store, executor: Executor, *, harness: Harness | None = None,
                 heartbeat_s: float = 5.0, stale_s: float = 120.0, max_active: int | None = None,
                 close_executor: bool = True, heartbeat: Heartbeat | None = None, prefer_env: str | None = None):
        """`prefer_env`: the environment id to measure in where the executor's nodes differ and
        some measure with it (the baseline's: `Experiment.baseline_environment`)."""
        self.lab = lab
        self.store = store
        self.executor = executor
        # on a cluster whose nodes measure with different environments, the stages go to one's nodes
        self.environment_note = choose_environment(lab, executor, prefer_env)
        self.harness = harness if harness is not None else lab.harness()
        self.owner = Owner.current()
        self.heartbeat_s = heartbeat_s
        self.stale_s = stale_s
        self.max_active = max_active if max_active is not None else 4 * executor.slots + 4
        self.close_executor = close_executor
        self.worktrees = Worktrees(lab.root, lab.state)
        self.cache = Cache(lab.state / "cache")
        self.logs = lab.state / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.disk = DiskKeeper(lab, store, self.cache, self.logs)
        self._published = 0
        self.stages = lab.stages_in_order()
        self.active: dict[int, _Active] = {}
        self.flights: dict[str, _Flight] = {}  # by key
        self.by_job: dict[str, str] = {}  # job id → key
        self.ready: deque[tuple[int, StageNode]] = deque()
        self.failed_keys: dict[str, tuple[str, str, str]] = {}  # key → (outcome, kind, detail)
        self.finished: list[int] = []
        self.to_score: list[int] = []
        self._prepared: Prepared | None = None
        self._stop: threading.Event | None = None  # the last `drive`'s: `close` scores no more once it is set
        self._digests: dict[tuple[str, tuple[str, ...]], dict[str, str]] = {}
        self._worktree_of: dict[str, Path] = {}
        self._views: dict[tuple[str, str], Path] = {}
        self.isolation = "sandbox" if isolation.is_sandboxed(lab) else "unsandboxed"
        # what this driver's stages measure with: in every cache key (`pipeline.environment`)
        facts = getattr(executor, "facts", None)  # the chosen nodes' on a cluster, or this machine's
        self.measures_here = not isinstance(facts, dict)
        self.environment = lab.config.run.environment_of(environment.here() if self.measures_here else facts)
        self.env_id: str | None = None  # recorded at `start`
        self._node_envs: dict[str, str] = {}  # a Ray node's facts (as JSON) → their MeasureEnv id
        self._started = False
        self._queue_empty_until = 0.0  # `_claim`: the last claim found nothing; not asked again before this
        self._baselines: set[str] = set()  # commits known to be baselines
        self._not_baseline_at: dict[str, float] = {}  # commit -> when the store said it was none
        self._last_reconcile = 0.0
        self._gpu_usage_at = 0.0
        self._harness_books: list[dict[str, Any]] = []  # harness calls booked, not written yet (`Scoring`)
        self._gpu_usage_totals: tuple[int, int, float] = (0, 0, 0.0)  # the sampler's, at the last row written
        self._gpu_usage_since = time.time()  # (GpuAccounting)
        self._gpu_usage_row: tuple[int | None, float] = (None, 0.0)  # the row being added to, and its start
        self.heartbeat = heartbeat  # the process's (the loop's, with its lease), else one of its own in start()
        self._own_heartbeat: Heartbeat | None = None

    # --- life cycle -----------------------------------------------------------------------------

    @property
    def slots(self) -> int:
        """How many stages the executor runs at once."""
        return self.executor.slots

    def environment_gone(self) -> str | None:
        """Why this driver's stages can no longer be measured in its environment, where the executor
        can tell (`RayExecutor.environment_gone`: a cluster whose nodes of that environment are all
        gone, others alive); None otherwise, and always for stages measured on this machine."""
        gone = getattr(self.executor, "environment_gone", None)
        return gone() if callable(gone) else None

    def start(self) -> None:
        """Reconcile the queue, repair worktrees and the cache, start the heartbeat (unless the process
        has one: `heartbeat`). Idempotent."""
        if self._started:
            return
        isolation.require(self.lab)  # refuse to run branch code where the sandbox cannot start
        self._started = True
        self.env_id = self.store.put_env(self.environment)
        requeued = self.store.reconcile(self.stale_s, reclaim=self.owner, heartbeat_s=self.heartbeat_s,
                                       gpus=self.lab.config.run.gpus)
        if requeued:
            log.warning("re-queued %d run(s) left running by a dead driver: %s", len(requeued), requeued)
        self._last_reconcile = time.monotonic()
        for line in self.worktrees.repair():
            log.info("worktrees: %s", line)
        self.cache.clear_tmp()
        self.disk.adopt_untracked()
        self._bound_disk()
        if self.heartbeat is None:
            self.heartbeat = self._own_heartbeat = Heartbeat(self.store, self.owner, self.heartbeat_s).start()

    def _bound_disk(self, logs: bool = True) -> None:
        """Keep the cache under `[run] cache_max_gb` and the logs under `logs_max_mb`, never touching
        what this driver's runs hold (their inputs, their flights' logs) or what is in flight."""
        held = {p.name for a in self.active.values() for p in a.done.values()} | set(self.flights)
        self.disk.bound(held)
        if self.disk.collect_due():  # runs of commits in flight keep theirs; a removed one is made again
            self.disk.collect(self.worktrees)
        if logs:
            self.disk.rotate_logs(keep=[fl.job.log_path for fl in self.flights.values()])

    def close(self, *, requeue: bool = True) -> None:
        """Cancel stages in flight and give claimed runs back to the queue (not counted as a retry)."""
        for fl in list(self.flights.values()):
            self.executor.cancel(fl.job.job_id)
        deadline = time.monotonic() + 15
        while self.flights and time.monotonic() < deadline:
            for res in self.executor.poll(0.2):
                self._on_result(res)
        from pipeline.errors import Interrupted

        try:  # runs whose outputs are complete are finished, not re-queued (unless the loop is stopping)
            with isolation.stopping(self._stop):
                self._score_pending()
        except Interrupted:
            pass  # those left are given back to the queue below
        for fl in list(self.flights.values()):
            self.store.stage_finished(fl.exec_id, "cancelled", detail="driver stopped")
            self.cache.discard(fl.tmp)
        self.flights.clear()
        self.by_job.clear()
        self.ready.clear()
        if requeue:
            for a in list(self.active.values()):
                self.store.release(a.claim, count_requeue=False)
        self.active.clear()
        self._record_gpu_usage(last=True)
        self._write_harness_books()
        if self._own_heartbeat is not None:
            self._own_heartbeat.stop()
            self.heartbeat = self._own_heartbeat = None
        if self.close_executor:
            self.executor.close()

    def __enter__(self) -> "Driver":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the loop --------------------------------------------------------------------------------

    def drive(self, until: Iterable[int] | Callable[[], bool] | None = None, *, stop: threading.Event | None = None,
              timeout_s: float | None = None, poll_s: float = 0.5) -> list[int]:
        """Work the queue until `until` holds; return the ids of runs finished meanwhile.

        until: run ids (returns when all are done or failed, whoever ran them), a predicate, or
        None (returns when the queue is empty and nothing is in flight). `stop` ends early
        (graceful stop); `timeout_s` bounds the wall time.
        """
        from pipeline.errors import Interrupted

        self.start()
        ids = None if until is None or callable(until) else set(until)
        t_end = None if timeout_s is None else time.monotonic() + timeout_s
        finished: list[int] = []
        while True:
            self._stop = stop
            try:
                with isolation.stopping(stop):  # a long `prepare` or scorer ends when `stop` is set
                    finished += self.step(poll_s)
            except Interrupted:
                if stop is None or not stop.is_set():
                    raise
                finished, self.finished = finished + self.finished, []
                break  # its run waits in `to_score`: `close` gives it back to the queue
            if stop is not None and stop.is_set():
                break
            if t_end is not None and time.monotonic() > t_end:
                break
            if ids is not None:
                if self.store.count_unfinished(ids) == 0:
                    break
            elif callable(until):
                if until():
                    break
            elif not self.active and not self.flights and self.store.count_queued() == 0:
                break
        return finished

    def step(self, timeout: float = 0.5) -> list[int]:
        """One turn: fill free slots, wait up to `timeout` for stage results, handle them."""
        self.start()
        if time.monotonic() - self._last_reconcile > self.stale_s / 2:
            self._last_reconcile = time.monotonic()
            self.store.reconcile(self.stale_s, heartbeat_s=self.heartbeat_s, gpus=self.lab.config.run.gpus)
        self._fill()
        if self.flights:
            for res in self.executor.poll(timeout):
                self._on_result(res)
            self._fill()
        elif timeout > 0 and not self.to_score:
            time.sleep(min(timeout, 0.2))
        if self._record_gpu_usage_every(GPU_USAGE_EVERY_S):
            self._write_harness_books()
        # slots are full again before the driver scores and claims ahead: neither delays a stage
        self._score_pending()
        self._prefetch()
        done, self.finished = self.finished, []
        return done

    def _score_pending(self) -> None:
        while self.to_score:
            run_id = self.to_score.pop(0)
            if run_id in self.active:
                self._score(run_id)

    def _claim(self, n: int) -> list[Claim]:
        """Up to `n` runs off the queue in one claim, with the dataset they are measured on. A claim
        that found the queue empty is not repeated for CLAIM_IDLE_S (each is a query; runs are
        queued by the loop's thread, and a stage takes seconds)."""
        if n <= 0 or time.monotonic() < self._queue_empty_until:
            return []
        claims = self.store.claim(self.owner, n, dataset_id=self.prepared().dataset_id)
        if not claims:
            self._queue_empty_until = time.monotonic() + CLAIM_IDLE_S
        return claims

    def _prefetch(self) -> None:
        """Claim and plan runs ahead, so a freed slot gets its next stage at once."""
        while len(self.ready) < self.executor.slots and len(self.active) < self.max_active:
            claims = self._claim(min(self.executor.slots - len(self.ready), self.max_active - len(self.active)))
            if not claims:
                return
            for claim in claims:
                self._activate(claim)
        self._score_pending()  # runs served entirely from the cache

    def _fill(self) -> None:
        while len(self.flights) < self.executor.slots:
            if self.ready:
                run_id, node = self.ready.popleft()
                if run_id in self.active:
                    self._launch_or_attach(run_id, node)
                continue
            if len(self.active) >= self.max_active:
                return
            claims = self._claim(min(self.executor.slots - len(self.flights), self.max_active - len(self.active)))
            if not claims:
                return
            for claim in claims:
                self._activate(claim)

    # --- runs ------------------------------------------------------------------------------------

    def prepared(self) -> Prepared:
        """The benchmark's dataset, prepared once per driver (the harness makes it idempotent)."""
        if self._prepared is None:
            b = self.lab.config.benchmark
            kwargs: dict[str, Any] = {"customers": b.customers} if b.customers is not None else {}
            self._prepared = self._booked("prepare", None, lambda: self.harness.prepare(
                self.lab.state, b.suite, b.data_seed, **kwargs))
        return self._prepared

    def _digest(self, commit: str, patterns: list[str]) -> dict[str, str]:
        k = (commit, tuple(patterns))
        if k not in self._digests:
            self._digests[k] = input_digests(self.worktrees, commit, patterns)
        return self._digests[k]

    def _activate(self, claim: Claim) -> None:
        try:
            self._activate_unguarded(claim)
        except BaseException:
            # never leave a claim nobody works on: our pid is alive, so reconcile would not free it
            self.active.pop(claim.run.id, None)  # type: ignore[arg-type]
            self.store.release(claim, count_requeue=False)
            raise

    def _activate_unguarded(self, claim: Claim) -> None:
        run = claim.run
        assert run.id is not None
        prepared = self.prepared()
        try:  # a link out of the tree is the branch's doing: the method's failure, never laid out
            self.worktrees.check_tree(run.commit)
            worktree = self._worktree_of.get(run.commit)
            if worktree is None or not worktree.is_dir():
                worktree = self._worktree_of[run.commit] = self.worktrees.ensure(run.commit)
        except UnsafeTree as e:
            self._record(claim, ResultOutcome.METHOD_FAILURE, None, "unsafe_tree", str(e), cpu_s=0.0)
            return
        except InfrastructureFailure as e:
            self._record(claim, ResultOutcome.INFRA_FAILURE, None, "worktree", str(e), cpu_s=0.0)
            return
        nodes = plan_run(self.stages, run.commit, run.task, run.seed, prepared.dataset_id, self._digest,
                         self.isolation, self.environment.id)
        needed = {n for node in nodes for n in node.spec.needs}
        final = next(node for node in nodes if node.name not in needed)
        if run.dataset_id != prepared.dataset_id:  # claimed with it, unless claimed elsewhere
            self.store.set_dataset(run.id, claim.token, prepared.dataset_id)
        # its stages' method failures recorded before this driver, in one read of just these keys
        recorded = self.store.method_failures([n.key for n in nodes if n.key not in self.failed_keys])
        self.active[run.id] = _Active(claim, worktree, nodes, final, infra_failures=run.infra_failures,
                                      recorded_failures=recorded)
        self._advance(run.id)

    def _advance(self, run_id: int) -> None:
        """Move a run forward: serve what the cache has, queue what is ready, score when complete."""
        a = self.active.get(run_id)
        if a is None:
            return
        for node in a.nodes:
            if node.name in a.done or node.name in a.pending:
                continue
            if any(n not in a.done for n in node.spec.needs):
                continue
            failure = self._known_failure(node.key, a)
            if failure is not None:
                outcome, kind, detail = failure
                self.store.stage_served(run_id, node.name, node.key, StageOutcome.UPSTREAM_FAILED,
                                        executor=self.executor.name, detail=f"{node.name}: {detail}")
                self._finish(run_id, ResultOutcome.METHOD_FAILURE, None, kind, f"{node.name}: {detail}")
                return
            if self.cache.has(node.key):
                saved_cpu_s, made_in = self.store.cache_hit_facts(node.key)
                self.store.stage_served(run_id, node.name, node.key, StageOutcome.CACHE_HIT, executor=self.executor.name,
                                        saved_cpu_s=saved_cpu_s)
                if node is a.final:
                    a.env_id = made_in
                self.disk.used(node.key)
                a.done[node.name] = self.cache.path(node.key)
                continue
            a.pending.add(node.name)
            if node.key in self.flights:
                self.flights[node.key].waiters.append(run_id)
            else:
                self.ready.append((run_id, node))
        if a.final.name in a.done and run_id not in self.to_score:
            self.to_score.append(run_id)

    def _known_failure(self, key: str, a: _Active) -> tuple[str, str, str] | None:
        """A method failure recorded for this stage key, by this driver (`failed_keys`) or before it
        (the store's, read for the run's keys when it was activated: one driver per lab, so a key that
        had none then has one later only if this driver records it). Not every failure the store
        holds at start: a lab's year of them is hundreds of MB in a driver that never needs most."""
        if key not in self.failed_keys:
            recorded = a.recorded_failures.get(key)
            if recorded is None:
                return None
            outcome, detail = recorded
            self.failed_keys[key] = (outcome, "timeout" if outcome == StageOutcome.TIMEOUT else "crash", detail)
        return self.failed_keys[key]

    def _launch_or_attach(self, run_id: int, node: StageNode) -> None:
        if node.key in self.flights:
            self.flights[node.key].waiters.append(run_id)
            return
        if self.cache.has(node.key):  # published by another driver meanwhile
            self.active[run_id].pending.discard(node.name)
            self._advance(run_id)
            return
        self._launch(run_id, node, [run_id])

    def _launch(self, run_id: int, node: StageNode, waiters: list[int]) -> None:
        a = self.active[run_id]
        run = a.claim.run
        prepared = self.prepared()
        cfg = self.lab.config.run
        tmp = self.cache.new_tmp(node.key)
        values = {"task": run.task, "seed": str(run.seed), "data": str(prepared.public), "out": str(tmp),
                  **{n: str(a.done[n]) for n in node.spec.needs}}
        try:
            argv = render(node.spec.run, values)
            check_not_sealed(argv, a.worktree, [prepared.sealed, self.lab.state / "sealed"])
        except Exception:
            self.cache.discard(tmp)
            raise
        job_id = uuid.uuid4().hex
        log_path = self.logs / f"{node.name}-{node.key[:12]}-{job_id[:8]}.log"
        view = self._view(run.commit, node)
        inputs = (prepared.public, *(a.done[n] for n in node.spec.needs))
        job = StageJob(job_id=job_id, argv=argv, cwd=view, commit=run.commit, out=tmp, log_path=log_path,
                       timeout_s=cfg.timeout_s, cpus=cfg.cpus, gpus=cfg.gpus,
                       memory_mb=None if cfg.gpus else cfg.memory_mb,  # CUDA cannot start under an RLIMIT_AS
                       inputs=inputs, sandbox=isolation.spec_for(self.lab, ro=[view, *inputs], out=tmp),
                       env=lab_env(cfg.env))
        exec_id = self.store.stage_started(run_id, node.name, node.key, executor=self.executor.name,
                                           log_path=str(log_path), gpu_share=cfg.gpus)
        self.flights[node.key] = _Flight(node, job, exec_id, run_id, waiters, tmp)
        self.by_job[job_id] = node.key
        try:
            self.executor.submit(job)
        except Exception:
            self.flights.pop(node.key, None)
            self.by_job.pop(job_id, None)
            self.store.stage_finished(exec_id, "infra", detail="submit failed")
            raise

    def _view(self, commit: str, node: StageNode) -> Path:
        """The stage's working directory: the commit's files, of the editable ones only its inputs."""
        k = (commit, node.name)
        if k not in self._views or not self._views[k].is_dir():
            self._views[k] = self.worktrees.view(commit, functools.partial(self.lab.stage_sees, node.spec))
        return self._views[k]

    def _on_result(self, res: Any) -> None:
        key = self.by_job.pop(res.job_id, None)
        if key is None:
            return
        fl = self.flights.pop(key)
        outcome, kind = classify(res)
        gpus = float(res.extra.get("gpu_share", self.lab.config.run.gpus))  # as held: a stage run alone, its GPU (but the reserve)
        common = dict(cpu_s=res.cpu_s, wall_s=res.wall_s, gpu_s=res.wall_s * gpus, exit_code=res.exit_code,
                      signal=res.signal, host=res.host)
        name = fl.node.name
        self._record_gpu_extra(fl, res)
        live = [r for r in dict.fromkeys(fl.waiters) if r in self.active]
        if outcome is StageOutcome.OK:
            final = self.cache.publish(fl.tmp, key)
            self.store.stage_finished(fl.exec_id, StageOutcome.OK, **common)
            made_in = self._env_of(res)
            self.store.cache_published(key, name, fl.job.commit, res.cpu_s, res.wall_s,
                                       size_bytes=self.disk.published(key), env_id=made_in)
            for rid in live:
                a = self.active[rid]
                a.pending.discard(name)
                a.done[name] = final
                if name == a.final.name:
                    a.env_id = made_in
                if rid == fl.lead:
                    a.cpu_s += res.cpu_s
                else:
                    self.store.stage_served(rid, name, key, StageOutcome.SHARED, executor=self.executor.name,
                                            saved_cpu_s=res.cpu_s)
            for rid in live:
                self._advance(rid)
            self._published += 1
            self._bound_disk(logs=self._published % 50 == 0)
            return
        self.cache.discard(fl.tmp)
        how = f"exit code {res.exit_code}" if res.exit_code is not None else (
            f"signal {res.signal}" if res.signal is not None else (res.detail or outcome))
        detail = f"{kind or outcome} ({how}); log {fl.job.log_path}"
        if outcome.is_method_failure():
            self.store.stage_finished(fl.exec_id, outcome, detail=detail, **common)
            self.failed_keys[key] = (outcome, kind or outcome, detail)
            for rid in live:
                if rid != fl.lead:
                    self.store.stage_served(rid, name, key, StageOutcome.UPSTREAM_FAILED, executor=self.executor.name,
                                            detail=detail)
                else:  # a timed-out stage's measured CPU is the run's too
                    self.active[rid].cpu_s += res.cpu_s
                self._finish(rid, ResultOutcome.METHOD_FAILURE, None, kind or outcome, f"{name}: {detail}")
            return
        if outcome is StageOutcome.CANCELLED:
            self.store.stage_finished(fl.exec_id, StageOutcome.CANCELLED, detail=res.detail or "cancelled", **common)
            return
        self.store.stage_finished(fl.exec_id, StageOutcome.INFRA, detail=detail, **common)
        for rid in live:
            self.store.note_infra_failure(rid)
            self.active[rid].infra_failures += 1
        retries = self.lab.config.run.retries
        lead = fl.lead if fl.lead in self.active else (live[0] if live else None)
        if lead is None:
            return
        if self.active[lead].infra_failures <= retries:
            log.warning("stage %s (%s) lost to infrastructure, retrying with the same seed: %s", name, key[:12], detail)
            self._launch(lead, fl.node, live)
        else:
            for rid in live:
                self._finish(rid, ResultOutcome.INFRA_FAILURE, None, "infra", f"{name}: {detail}; {retries} retries exhausted")

    def _finish(self, run_id: int, outcome: ResultOutcome, value: float | None, kind: str | None, detail: str | None) -> None:
        a = self.active.pop(run_id, None)
        if a is None:
            return
        for fl in self.flights.values():
            if run_id in fl.waiters:
                fl.waiters = [r for r in fl.waiters if r != run_id]
        self._record(a.claim, outcome, value, kind, detail, cpu_s=a.cpu_s, env_id=a.env_id)

    def _env_of(self, res: Any) -> str | None:
        """Where a stage ran: the Ray node's environment when it sent its facts, else this driver's."""
        facts = res.extra.get("env")
        if not isinstance(facts, dict):
            return self.env_id
        k = json.dumps(facts, sort_keys=True)
        if k not in self._node_envs:
            self._node_envs[k] = self.store.put_env(self.lab.config.run.environment_of(facts))
        return self._node_envs[k]

    def _record(self, claim: Claim, outcome: ResultOutcome, value: float | None, kind: str | None, detail: str | None,
                *, cpu_s: float, env_id: str | None = None) -> None:
        """A run's result. `env_id`: where its predictions were made (a scored run); a run that
        failed before them was this driver's."""
        run = claim.run
        assert run.id is not None
        result = Result(run_id=run.id, commit=run.commit, task=run.task, seed=run.seed, value=value,
                        outcome=outcome, kind=kind, detail=detail,
                        dataset_id=self._prepared.dataset_id if self._prepared else None, cpu_s=cpu_s,
                        env_id=env_id if env_id is not None or value is not None else self.env_id)
        if self.store.finish(claim, result, outcome.run_status()):
            self.finished.append(run.id)
        else:
            log.warning("run %s was taken back from this driver; its result is not recorded twice", run.id)


def main(argv: list[str] | None = None) -> int:
    """`python -m pipeline.runner LAB`: drive the lab's queue until it is empty."""
    p = argparse.ArgumentParser(prog="python -m pipeline.runner", description=main.__doc__)
    p.add_argument("lab", type=Path)
    p.add_argument("--db", default=None, help="store URL (default SQLite in runs/)")
    p.add_argument("--executor", default="local", help="a name in pipeline.executors.EXECUTORS")
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--ray-address", default=None)
    p.add_argument("--preload", default=None, help="comma-separated modules the warm worker imports")
    p.add_argument("--heartbeat-s", type=float, default=5.0)
    p.add_argument("--stale-s", type=float, default=120.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    lab = load_lab(args.lab)
    store = Store.for_lab(lab, args.db)
    preload = tuple(filter(None, args.preload.split(","))) if args.preload is not None else None
    executor = make_executor(ExecutorOptions(args.executor, args.workers, args.ray_address, preload), lab)
    with Driver(lab, store, executor, heartbeat_s=args.heartbeat_s, stale_s=args.stale_s) as d:
        d.drive()
    counts = store.queue_counts()
    print(" ".join(f"{k}={v}" for k, v in counts.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
