"""The driver loop behind `autoresearch run`: keeps hypotheses in flight, executes their runs,
enforces budgets and guards, and stops gracefully.

It is deliberately plain, and holds no state of a hypothesis: each hypothesis is its LangGraph
thread (`agent.graph`), and the loop only schedules threads. It picks or proposes hypotheses up to
`max_in_flight`, takes each thread as far as it goes from its checkpoint (to the interrupt that
waits for a look's runs, a human, or a new champion's fresh runs), while the execution layer (the
`Driver` the measurement API gives, `Experiment.driver`, in a thread of its own) works the queue;
when one in-flight look has all its runs, it resumes that thread. After a crash or `kill -9`, a
restart resumes every active thread from its checkpoint; the runs they queued are reconciled by
the execution layer under the same keys.

An LLM outage is infrastructure: a proposal the endpoint could not give creates no hypothesis
(the empty one is withdrawn), a thread that needs the endpoint waits at its node, and the loop
backs off (doubling, capped) while human seeds and runs in flight go on.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from agent.errors import BudgetExceeded, LLMError
from agent.graph import claim, give_up, open_proposal
from agent.lifecycle import Status
from agent.policy import llm_client
from agent.records import ACTIVE, Hypothesis, Records
from pipeline.api import ExecutorOptions, HarnessCommandError, Lab, MixedDatasets, RunStatus, open_store

log = logging.getLogger("autoresearch.loop")

GUARD_STREAK = 3  # hypotheses in a row rejected or failing before the loop backs off
GUARD_BACKOFF_S = 600.0
MAX_GRAPH_FAILURES = 3  # unexpected errors in one hypothesis's graph before it is given up
PROGRESS_EVERY_S = 30.0  # how often `run` reports the runs of the looks in flight
_NOTHING = object()  # a thread with nothing to do now
LEASE_HEARTBEAT_S = 5.0
IN_FLIGHT_PER_FILL = 3  # the derived max_in_flight: at most this many times the hypotheses whose first looks fill the slots
QUEUE_DEPTH = 2  # ... started while fewer runs than this many times the slots (plus a first look) are outstanding
PROGRESS_CHART_EVERY_S = 30.0  # the lab's progress chart: redrawn at most this often at decisions (and at promotions)
REVERIFY_POLL_S = 2.0  # how often the loop looks whether a champion's fresh runs are all in
LOOK_POLL_S = 0.2  # how often the loop's thread looks for a look with all its runs in
DRIVER_POLL_S = 0.2  # the driver's thread: the longest it waits for a stage result before it claims again
LLM_BACKOFF_S = (5.0, 300.0)  # the first and the longest wait before asking an unreachable endpoint again


class DriverThread:
    """The execution layer works the queue in a thread of its own: stages are submitted, polled,
    cached and scored while the loop's thread advances hypotheses (a gate, a summary and its
    pictures, a smoke run, an LLM request), so no slot waits for the graph. Only this thread
    touches the driver and its executor, and it closes the driver when halted; the loop meets it
    through the store (it queues runs and reads their status). An error of the driver's is
    re-raised in the loop's thread by `check`, as if the loop had driven the queue itself."""

    def __init__(self, driver: Any, stop: threading.Event):
        self.driver, self.stop = driver, stop
        self._halt = threading.Event()
        self.error: BaseException | None = None
        self.cpu_s = 0.0
        self._thread = threading.Thread(target=self._work, name="autoresearch-driver", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _work(self) -> None:
        t0 = time.thread_time()
        try:
            self.driver.drive(until=self._halt.is_set, stop=self.stop, poll_s=DRIVER_POLL_S)
        except BaseException as e:  # handed to the loop's thread
            self.error = e
        finally:
            self.cpu_s = time.thread_time() - t0  # the driver's own CPU (benchmarks/scale.py reports it per run)
            # closed by this thread, before it ends: a warm worker it started dies with it (PDEATHSIG
            # follows the thread that forked, not the process), so no stage may still be in flight then
            try:
                self.driver.close()
            except BaseException as e:
                log.exception("closing the driver failed")
                self.error = self.error or e

    def check(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        if self.started and not self.alive and not (self._halt.is_set() or self.stop.is_set()):
            raise RuntimeError("the driver thread ended unexpectedly")

    def halt(self) -> None:
        """Stop the thread after its current step and wait until it has closed the driver."""
        self._halt.set()
        while self.started and self.alive:
            self._thread.join(0.5)


@dataclass
class LoopOptions:
    max_hypotheses: int | None = 3
    hours: float | None = None
    forever: bool = False
    executor: ExecutorOptions = field(default_factory=ExecutorOptions)  # where runs execute (--executor, --workers, ...)
    offline: bool = False
    policy: str | None = None  # a name in agent.policy.POLICIES; None: the first configured one
    supervised: bool = False
    smoke: bool = True
    pause_on_plateau: bool = False
    mlflow: str | None = None  # a tracking URI: each hypothesis is exported as it is decided
    notify: tuple[str, ...] = ()  # `--notify URL`s, beside research.toml's [notify] targets (agent.notify)
    db: str | None = None
    idle_poll_s: float = 10.0


def in_flight_room(slots: int, first_look_runs: int, in_flight: int, outstanding: int) -> bool:
    """The derived `max_in_flight`: whether another hypothesis should start.

    Where one first look (tasks × its runs) already has as many runs as there are slots, one
    hypothesis at a time: the slots are full but for the tail of each look, and no decision waits
    on a re-base. Beyond that (a cluster), hypotheses start while the runs outstanding (queued,
    claimed, and a first look for each one not queued yet) are fewer than QUEUE_DEPTH × the slots
    plus one first look: the queue stays a round of stages deeper than the slots, so a slot freed
    at a look's tail finds a run while the loop's thread is busy deciding; at most
    IN_FLIGHT_PER_FILL × slots / first look of them (each re-base a promotion causes costs a
    hypothesis in flight its looks so far: more in flight buys utilisation with re-measurements)."""
    if in_flight == 0:
        return True
    if slots <= first_look_runs:
        return False
    if in_flight >= IN_FLIGHT_PER_FILL * math.ceil(slots / first_look_runs):
        return False
    return outstanding < QUEUE_DEPTH * slots + first_look_runs


def choose_policy(lab: Lab, store: Any, offline: bool, name: str | None = None):
    """`--policy NAME`, `--offline` (= offline), or the first configured policy of the registry."""
    from agent.policy import make_policy

    return make_policy(lab, store, "offline" if offline else name)


class Loop:
    def __init__(self, lab: Lab, opts: LoopOptions, progress: Callable[[str], None] | None = None,
                 looks: Callable[[dict[int, dict[str, Any]]], None] | None = None):
        """`progress` gets the loop's messages; `looks`, if given, where each look in flight stands
        (runs done, running, total, ETA), every half second while runs execute (a terminal's bars)."""
        from agent.graph import Services, build_graph, open_checkpointer
        from agent.pictures import Painter
        from agent.workspace import Workspace

        self.lab, self.opts = lab, opts
        self.say = progress or (lambda msg: log.info(msg))
        self.on_looks = looks
        self.touched: list[int] = []  # the hypotheses this run worked on, in order
        self.store = open_store(lab, opts.db)
        self.stop = threading.Event()
        self.stop_reason = ""
        self.notifier = None
        self._took_over: str | None = None
        self._take_lease()  # before anything else is set up: a second driver leaves here, in one line
        try:
            self.records = Records(self.store)
            self.policy = choose_policy(lab, self.store, opts.offline, opts.policy)
            self.svc = Services(lab, self.store, self.records, Workspace(lab), self.policy, opts.supervised,
                                opts.smoke, stop=self.stop, progress_every_s=PROGRESS_CHART_EVERY_S,
                                painter=Painter())
            self.checkpointer = open_checkpointer(self.svc)
            self.graph = build_graph(self.svc, self.checkpointer)
            self._exporter = None
            if opts.mlflow:  # no MLflow installed, or its server down: one line now, not at the first decision
                from agent.mlflow_export import Exporter

                self._exporter = Exporter(lab, self.store, opts.mlflow)
            from agent.notify import attach

            self.notifier = attach(lab, self.store, self.records, list(opts.notify))  # events go to the outbox now
            if self._took_over:
                self.records.event("takeover", self._took_over)
        except BaseException:  # an unknown --policy, an unreachable checkpointer: the lab stays free
            if self.notifier is not None:
                self.notifier.close(flush_s=0)
            self._release_lease()
            raise
        self.started = 0  # hypotheses this run worked on: started, or resumed after a crash
        self.t0 = time.monotonic()
        self.backoff_until = 0.0
        self.failures: dict[int, int] = {}
        self.llm_retry_at = 0.0  # no request to the LLM before this time (an outage's back-off)
        self.llm_backoff_s = 0.0
        self.llm_down_since: float | None = None
        self.llm_waiting: set[int] = set()  # threads stopped at a node that needs the endpoint
        self._budget_said = False
        self.reverifying: set[int] | None = None  # promoted hypotheses whose threads wait in `reverify`
        self._reverify_runs: dict[int, list[int]] = {}  # ... and the champion's runs each waits for
        self._reverify_polled = -REVERIFY_POLL_S

    def close(self) -> None:
        """Stop the smoke runs' worker, release the checkpointer's connection and the lab's lease
        (the store stays readable). Due notifications get a few seconds to go out first."""
        if self.notifier is not None:
            self.notifier.close()
        self.svc.painter.close()  # the pictures asked for are drawn before the loop returns
        self.svc.experiment.close()
        conn = getattr(self.checkpointer, "conn", None)
        if conn is not None:
            conn.close()
        self._release_lease()

    # -------------------------------------------------------------- the lab's lease

    def _release_lease(self) -> None:
        from pipeline.api import lease

        self.heartbeat.stop()
        lease.release(self.store, self.owner)

    def _take_lease(self) -> None:
        """One driver per lab (`pipeline.lease`): take it, or a dead holder's; refresh it while we live."""
        from pipeline.api import lease

        self.owner = lease.Owner.current()
        dead = lease.acquire(self.store, self.owner)
        if dead is not None:
            self._took_over = (f"took over the lab from pid {dead.pid} on {dead.host}, which died "
                               f"(its last heartbeat {time.time() - dead.heartbeat_at:.0f} s ago)")
            self.say(self._took_over)  # a loop event too, once the records are open

        def lost() -> None:
            if not self.stop.is_set():
                self.say("this driver lost the lab's lease to another (it stalled past the lease's staleness): stopping")
                self.stop_reason = "lease lost"
                self.stop.set()

        # the process's one heartbeat: the lease's and, once the driver runs, its runs' (`lease.Heartbeat`)
        self.heartbeat = lease.Heartbeat(self.store, self.owner, LEASE_HEARTBEAT_S, holds_lease=True,
                                         on_lost=lost).start()

    # -------------------------------------------------------------- signals

    def install_signals(self) -> None:
        def handler(signum: int, _frame: Any) -> None:
            if self.stop.is_set():  # a second signal: stop waiting for anything (runs are re-queued)
                raise KeyboardInterrupt
            self.say(f"received {signal.Signals(signum).name}: finishing what can finish, re-queueing the rest")
            self.stop_reason = "signal"
            self.stop.set()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    # -------------------------------------------------------------- budget

    def out_of_time(self) -> bool:
        return self.opts.hours is not None and time.monotonic() - self.t0 > self.opts.hours * 3600

    def _start_clock(self) -> threading.Timer | None:
        """`--hours`: at the deadline the loop stops as on SIGTERM, in the middle of a look if need be
        (runs in flight finish or are re-queued; the next start resumes the hypotheses)."""
        if self.opts.hours is None:
            return None

        def deadline() -> None:
            if not self.stop.is_set():
                msg = f"time budget of {self.opts.hours:g} h reached: finishing what can finish, re-queueing the rest"
                self.records.event("budget", msg)
                self.say(msg)
                self.stop_reason = "time budget"
                self.stop.set()

        timer = threading.Timer(max(0.0, self.t0 + self.opts.hours * 3600 - time.monotonic()), deadline)
        timer.daemon = True
        timer.start()
        return timer

    def count_left(self) -> bool:
        return self.opts.forever or self.opts.max_hypotheses is None or self.started < self.opts.max_hypotheses

    def blocked(self) -> bool:
        """A guard holds new proposals back: the failure streak's back-off, or the LLM's daily budget
        or outage. Each holds back only proposals: human seeds still start (issue 20)."""
        return self.guard_holds() or self.llm_blocked()

    def guard_holds(self) -> bool:
        """The failure streak's back-off is in force (it holds proposals, never human seeds)."""
        return time.time() < self.backoff_until

    def llm_blocked(self) -> bool:
        if llm_client(self.policy) is None:
            return False
        return time.time() < self.llm_retry_at or self.llm_budget_spent()

    def may_start(self) -> bool:
        """Whether a new hypothesis may start now: a seed, or a proposal if no guard holds proposals
        back (`next_hypothesis` decides which)."""
        if self.stop.is_set() or self.out_of_time():
            return False
        return self.count_left()

    def llm_budget_spent(self) -> bool:
        """Whether today's LLM spend reached a cap (dollars, or tokens); said once (in `status` too)
        when it does."""
        client = llm_client(self.policy)
        reached = getattr(client, "budget_reached", None) if client is not None else None
        why = reached() if reached is not None else None
        if why is None:
            self._budget_said = False
            return False
        if not self._budget_said:
            self._budget_said = True
            msg = f"{why}; no new hypothesis until the cap resets at UTC midnight"
            self.records.event("budget", msg)
            self.say(msg)
        return True

    def plateau(self) -> bool:
        """`[agent] plateau_after` measured hypotheses in a row without a promotion: said once per
        baseline (an event in `status` and the digest); True when reached."""
        from agent.graph import plateau_of

        n = plateau_of(self.svc)
        if n is None:
            return False
        after = self.lab.config.agent.plateau_after
        base = self.svc.workspace.baseline_head()
        said = [e for e in self.records.events(50) if e.kind == "plateau"]
        if not any(base[:10] in e.message for e in said):
            msg = (f"plateau: {n} measured hypotheses in a row without a promotion (baseline {base[:10]}, "
                   f"[agent] plateau_after = {after}); the LLM policy is told so in its next proposal")
            self.records.event("plateau", msg)
            self.say(msg)
        # a human seed queued is the new direction the pause asks for: it runs (and counts, if it fails)
        if self.opts.pause_on_plateau and not self.stop.is_set() and self.records.next_queued() is None:
            self.stop_reason = "plateau"
            self.say("stopping: --pause-on-plateau (seed a new direction, then run again)")
            self.stop.set()
        return True

    def guard(self) -> None:
        """Back off after GUARD_STREAK hypotheses in a row that never produced evidence."""
        done = [h for h in self.records.all(("done",)) if h.finished_at]
        done.sort(key=lambda h: h.finished_at or 0)
        streak = 0
        for h in reversed(done):
            failed = h.decision == "reject" and h.reject_kind not in ("exhausted",)
            if not failed and h.verdict is not None:
                fr = self._failure_report(h)
                failed = bool(fr and fr.get("not_promising"))
            if not failed:
                break
            streak += 1
        if streak >= GUARD_STREAK and time.time() >= self.backoff_until:
            last = done[-1].finished_at or 0
            if time.time() - last < GUARD_BACKOFF_S:
                self.backoff_until = last + GUARD_BACKOFF_S
                msg = (f"guard: {streak} hypotheses in a row were rejected or failed their runs; "
                       f"no new proposal until {time.strftime('%H:%M:%S', time.localtime(self.backoff_until))} "
                       "(human seeds still start)")
                self.records.event("guard", msg)
                self.say(msg)

    def _failure_report(self, h: Hypothesis) -> dict | None:
        g = self.records.latest_verdict(h.id)
        return g.failures.model_dump(mode="json") if g is not None else None

    # -------------------------------------------------------------- hypotheses

    def next_hypothesis(self) -> Hypothesis | None:
        held = self.guard_holds()
        if held:  # a human seed is never held back by the guard; the policy's own follow-ups (queued) are
            seeds = [x for x in self.records.all(("queued",)) if x.origin == "human"]
            h = min(seeds, key=lambda x: (-x.priority, x.id or 0), default=None)
        else:
            h = self.records.next_queued()
        if h is not None:  # taken off the queue: its thread starts at its first node
            return claim(self.records, h)
        if held or self.llm_blocked():
            return None
        base = self.svc.workspace.baseline_head()
        if any(x.reject_kind == "exhausted" and x.origin == self.policy.name and x.base_commit == base
               for x in self.records.all(("done",))):
            return None  # nothing untried around this baseline; wait for human seeds or a new baseline
        return open_proposal(self.records, self.policy.name)  # an empty one: its thread proposes

    def _thread(self, h: Hypothesis) -> dict[str, Any]:
        return {"configurable": {"thread_id": str(h.id)}}

    def waits_for(self, h: Hypothesis, snap: Any = None) -> dict[str, Any] | None:
        """What the hypothesis's thread is paused on (its interrupt's payload), or None; `snap`: its
        state, if read already."""
        from agent.graph import HOLD

        snap = snap if snap is not None else self.graph.get_state(self._thread(h))
        if not snap.interrupts:
            return None
        value = snap.interrupts[0].value
        return value if isinstance(value, dict) and "kind" in value else {"kind": HOLD}

    def advance(self, h: Hypothesis) -> Hypothesis:
        """Take the hypothesis's thread as far as it goes now, from its checkpoint: start it (a new
        hypothesis), go on from the node a stop or a crash left it in, or answer its interrupt — the
        look's runs are all in, or a human reviewed the hold — until it waits for something that has
        not come. An unexpected error is recorded, and after MAX_GRAPH_FAILURES of them the
        hypothesis is given up: one broken idea must not stop the loop."""
        from sqlalchemy.exc import OperationalError

        from pipeline.api import Interrupted

        config = self._thread(h)
        before = (h.status, h.look, h.verdict)
        if h.id not in self.touched:
            self.touched.append(h.id)
        for _ in range(len(self.lab.config.gate.looks) + 3):  # each step ends at an interrupt or the end
            try:
                step = self._step(h)
                if step is _NOTHING or self.stop.is_set():
                    break
                self.graph.invoke(step, config, durability="sync")
            except OperationalError as e:  # the store's database went away: infrastructure, not the idea's
                self.say(f"#{h.id}: the store did not answer ({str(e.orig or e).splitlines()[0][:200]}); "
                         "the thread waits at its checkpoint")
                self.stop.wait(self.opts.idle_poll_s)
                return h
            except Interrupted:
                break  # stopping: the next start resumes it
            except LLMError as e:
                return self._llm_failed(h, e)
            except (MixedDatasets, HarnessCommandError):  # the user's to fix (the trusted harness, the
                raise  # datasets): the loop stops in one line, the thread waits at its checkpoint
            except BrokenPipeError as e:  # a helper process killed under us (git's persistent cat-file)
                self.svc.workspace.repo.git.clear_cache()  # gitpython starts fresh helpers on next use
                self.say(f"#{h.id}: a helper process died ({e}); restarted, the thread waits at its checkpoint")
                return h
            except Exception as e:  # a bug in a node, git refusing, a database error: recorded, counted
                log.exception("hypothesis %s: graph failed", h.id)
                n = self.failures[h.id] = self.failures.get(h.id, 0) + 1
                msg = f"#{h.id}: {type(e).__name__}: {e} (failure {n} of {MAX_GRAPH_FAILURES})"
                self.records.event("error", msg)
                self.say(msg)
                if n >= MAX_GRAPH_FAILURES:
                    give_up(self.records, h.id, msg)
                break
            h = self.records.get(h.id)
            if h.status == "done":
                break
        h = self.records.get(h.id)
        if h.title and before[0] in ("proposing", "implementing") and h.status != before[0]:
            self._llm_back()  # a proposal or an implementation came: the endpoint answers
        if self.opts.mlflow and h.status == "done" and before[0] != "done":
            self._export(h)
        if (h.status, h.look, h.verdict) != before:
            self.report(h)
        if h.promoted_tag and h.status == Status.DONE and self.reverifying is not None:
            self.reverifying.add(h.id)  # its thread waits for the champion's fresh runs
        return h

    def _step(self, h: Hypothesis) -> Any:
        """What to give the thread now: its start, None (go on from the checkpoint), the answer to
        its interrupt — or `_NOTHING` while it waits for runs, a human or the LLM's back-off."""
        from langgraph.types import Command

        from agent.graph import LOOK, thread_input

        if h.id in self.llm_waiting:
            if time.time() < self.llm_retry_at:
                return _NOTHING
            self.llm_waiting.discard(h.id)
        snap = self.graph.get_state(self._thread(h))
        if snap.interrupts:
            waits = self.waits_for(h, snap) or {}
            if waits.get("kind") == LOOK:
                done = self.svc.experiment.finished(list(waits.get("runs", [])))
                return Command(resume="finished") if done else _NOTHING
            answer = {"approved": "approve", "rejected": "reject"}.get(self.records.get(h.id).review or "")
            return _NOTHING if answer is None else Command(resume=answer)
        if snap.next:
            return None  # stopped or killed inside a node: that node runs again (its side effects are keyed)
        h = self.records.get(h.id)
        if snap.created_at is not None and h.status == Status.DONE:
            # ended; but a champion whose thread an earlier version ended at its promotion is re-verified
            legacy = "phase" not in (snap.values or {}) and h.id in (self.reverifying or ())
            return thread_input(h) if legacy else _NOTHING
        # a new thread; or one that ended while its hypothesis is active, which only a lab driven by an
        # earlier version has (its threads ended at every wait): started at the node of its row's status
        return thread_input(h)

    def _export(self, h: Hypothesis) -> None:
        """`run --mlflow URI`: the decided hypothesis to MLflow; a tracking server that fails is said
        and retried at the next decision (`export mlflow` catches up), never a stop of the loop."""
        from pipeline.api import ServiceUnavailable

        try:
            if self._exporter is None:
                from agent.mlflow_export import Exporter

                self._exporter = Exporter(self.lab, self.store, self.opts.mlflow or "")
            self._exporter.export(h)
        except (ServiceUnavailable, OSError) as e:  # the server down, an artifact store refusing a file
            self._exporter = None
            self.records.event("mlflow", f"#{h.id} not exported: {e}")
            self.say(f"#{h.id} not exported to MLflow: {e}")

    def _llm_failed(self, h: Hypothesis, e: LLMError) -> Hypothesis:
        """The endpoint down or refusing requests (`LLMUnavailable`, `LLMRequestRejected`), or the
        budget spent, where a thread needs an answer (an answer that is garbage is the nodes' to
        record). A proposal that did not come is no hypothesis: the empty one is withdrawn (row and
        thread). Otherwise the thread waits at its node. The endpoint is asked again after a back-off."""
        h = self.records.get(h.id)
        now = time.time()
        if not h.title:
            self.records.delete(h.id)
            self.checkpointer.delete_thread(str(h.id))
            self.started -= 1
        else:
            self.llm_waiting.add(h.id)
        if isinstance(e, BudgetExceeded):
            self.llm_budget_spent()  # says it once; the budget, not a back-off, holds proposals now
            return h
        self.llm_backoff_s = min(LLM_BACKOFF_S[1], max(LLM_BACKOFF_S[0], self.llm_backoff_s * 2))
        self.llm_retry_at = now + self.llm_backoff_s
        retry = time.strftime("%H:%M:%S", time.localtime(self.llm_retry_at))
        if self.llm_down_since is None:
            self.llm_down_since = now
            self.records.event("llm_down", f"LLM unreachable: {e}")
        self.say(f"LLM unreachable since {time.strftime('%H:%M:%S', time.localtime(self.llm_down_since))}"
                 f" ({e}); next try at {retry}")
        return h

    def _llm_back(self) -> None:
        """The endpoint answered: said once, whoever saw it go down (this process or one before it)."""
        from agent.commands import llm_unreachable_since

        since = self.llm_down_since or llm_unreachable_since(self.records)
        if since is None:
            return
        down = time.time() - since
        self.llm_down_since, self.llm_backoff_s, self.llm_retry_at = None, 0.0, 0.0
        msg = f"LLM reachable again after {down:.0f} s"
        self.records.event("llm_up", msg)
        self.say(msg)

    def report(self, h: Hypothesis) -> None:
        if h.status == "measuring":
            why = f"verdict escalate{self._evidence(h)}; " if h.verdict == "escalate" else ""
            if h.verdict is None and (h.rationale_decision or "").startswith("Re-based"):  # graph.rebase
                why = f"{h.rationale_decision.removesuffix('.')}; "
            self.say(f"#{h.id} {h.title!r}: {why}measuring, look of {h.look} challenger runs on "
                     f"{len(self.lab.tasks())} tasks")
        elif h.status == "done" and h.decision == "reject":
            self.say(f"#{h.id} {h.title!r}: rejected ({h.reject_kind}): {h.reject_reason}")
        elif h.status in ("done", "held"):
            extra = f" → {h.promoted_tag}" if h.promoted_tag else ""
            self.say(f"#{h.id} {h.title!r}: verdict {h.verdict}{self._evidence(h)}, decision {h.decision}{extra}")

    def _evidence(self, h: Hypothesis) -> str:
        """` at look N (horizontal Δ +0.42σ, t 1.3 vs boundary 2.9)` from the gate's last record."""
        g = self.records.latest_verdict(h.id)
        if g is None:
            return ""
        hz = g.horizontal
        if hz.delta is None or hz.t is None:
            return f" at look {g.look}"
        bound = f" vs boundary {hz.boundary:.2f}" if hz.boundary is not None else ""
        sep = ", " if g.higher_is_better else ", + = better; "  # the horizontal Δ is oriented
        return f" at look {g.look} (horizontal Δ {hz.delta:+.2f}σ{sep}t {hz.t:.2f}{bound})"

    def release_holds(self) -> None:
        """Resume the threads of held hypotheses a human approved or rejected, at their `hold` node
        (one that a crash stopped short of it gets there first)."""
        for h in self.records.all(("held",)):
            self.advance(h)

    def note_reverifications(self) -> None:
        """Resume the threads that wait, in their `reverify` node, for a new champion's fresh runs,
        once the runs are in; say how it held up. A thread an earlier version ended at the promotion
        (it re-verified in the loop) is given its `reverify` node once. Cheap when nothing is due:
        the runs a thread waits for are read from its checkpoint once, then one store query for
        all of them (the loop asks at most every REVERIFY_POLL_S)."""
        from agent.graph import LOOK, reverification_message
        from agent.verdicts import reverify_record

        if self.reverifying is None:
            self.reverifying = {h.id for h in self.records.all(("done",))
                                if h.promoted_tag and reverify_record(self.store, h.id) is None}
        if not self.reverifying:
            return
        waiting = {hid: self._reverify_runs[hid] for hid in self.reverifying if hid in self._reverify_runs}
        unfinished = {r.id for r in self.store.runs([i for ids in waiting.values() for i in ids])
                      if not RunStatus(r.status).is_finished()}
        for hid in sorted(self.reverifying):
            if hid in waiting and any(i in unfinished for i in waiting[hid]):
                continue  # its champion's runs are not all in
            h = self.records.get(hid)
            try:
                step = self._step(h)
                if step is not _NOTHING and not self.stop.is_set():
                    self.graph.invoke(step, self._thread(h), durability="sync")
            except Exception as e:  # the store or git hiccuping: the thread waits at its checkpoint
                log.warning("#%s: re-verification: %s", hid, e)
                continue
            waits = self.waits_for(h)
            if waits is not None and waits.get("kind") == LOOK:
                self._reverify_runs[hid] = list(waits.get("runs", []))
                continue
            self.reverifying.discard(hid)
            self._reverify_runs.pop(hid, None)
            r = reverify_record(self.store, hid)
            if r is not None:
                bench = self.lab.config.benchmark
                self.say(reverification_message(r, bench.metric, bench.higher_is_better))

    # -------------------------------------------------------------- main loop

    def room_for_another(self, in_flight: list[Hypothesis], slots: int) -> bool:
        """Whether one more hypothesis may start now. `[agent] max_in_flight`, if set, is the limit;
        unset, it is derived from the slots (`in_flight_room`), with the runs outstanding now."""
        limit = self.lab.config.agent.max_in_flight
        if limit is not None:
            return len(in_flight) < limit
        first = len(self.lab.tasks()) * self.lab.config.gate.looks[0]
        if not in_flight or slots <= first:
            return not in_flight
        counts = self.store.queue_counts()
        coming = sum(1 for h in in_flight if h.status != "measuring")  # not queued yet: a first look each
        return in_flight_room(slots, first, len(in_flight), counts["queued"] + counts["running"] + coming * first)

    def pending_runs(self, h: Hypothesis) -> list[int]:
        """The runs the hypothesis's thread waits for (none unless it waits for a look)."""
        from agent.graph import LOOK

        waits = self.waits_for(h)
        return list(waits["runs"]) if waits and waits.get("kind") == LOOK else []

    def run(self) -> dict[str, Any]:
        driver = self.svc.experiment.driver(self.opts.executor, heartbeat=self.heartbeat)
        self.say(f"loop started: policy {self.policy.name}, executor {self.opts.executor.kind} "
                 f"({driver.slots} slots), lab {self.lab.root}")
        clock = self._start_clock()
        worker = self.driver_thread = DriverThread(driver, self.stop)
        try:
            driver.start()  # here: a sandbox that cannot start is one line before any thread runs
            worker.start()
            resumed = self.records.all(ACTIVE)
            for h in resumed:
                self.say(f"#{h.id} {h.title!r}: resuming ({h.status})")
            self.started = len(resumed)
            while not self.stop.is_set() and not self.out_of_time():
                self.release_holds()
                if time.monotonic() - self._reverify_polled >= REVERIFY_POLL_S:
                    self._reverify_polled = time.monotonic()
                    self.note_reverifications()
                self.guard()
                if self.plateau() and self.stop.is_set():
                    break
                in_flight = self.records.all(ACTIVE)
                while self.room_for_another(in_flight, driver.slots) and self.may_start():
                    h = self.next_hypothesis()
                    if h is None:
                        break
                    self.started += 1
                    in_flight.append(h)
                if not in_flight:
                    # idle: wait for seeds (--forever) or for a guard to lift (--forever, --hours)
                    wait = self.opts.forever or (self.opts.hours is not None and self.count_left() and self.blocked())
                    if wait and not self.stop.is_set():
                        self.stop.wait(self._idle_wait())
                        continue
                    if self.count_left() and self.llm_down_since is not None:
                        self.stop_reason = "LLM unreachable"
                        self.say("stopping: the LLM endpoint is unreachable and nothing else is in flight "
                                 "(`run --forever` or `--hours` waits for it; see `autoresearch status`)")
                    elif self.count_left() and self.blocked():
                        self.say("stopping: a guard holds new hypotheses back (see `autoresearch status`)")
                    break
                waiting: dict[int, list[int]] = {}
                moved = False
                for h in in_flight:
                    if self.stop.is_set():
                        break
                    after = self.advance(h)
                    moved |= (after.status, after.look, after.verdict, after.title) != (h.status, h.look, h.verdict,
                                                                                         h.title)
                    if after.status == "measuring":
                        waiting[after.id] = self.pending_runs(after)
                waiting = {hid: ids for hid, ids in waiting.items() if ids}
                if not waiting:
                    if not moved and not self.stop.is_set():  # all wait for the LLM: do not spin
                        self.stop.wait(self._idle_wait())
                    continue

                last_said = [time.monotonic()]
                last_shown = [0.0]

                def one_look_complete() -> bool:
                    every = {r.id: r for r in self.store.runs([i for ids in waiting.values() for i in ids])}  # one read
                    runs = {h: [every[i] for i in ids if i in every] for h, ids in waiting.items()}
                    if self.on_looks is not None:
                        if time.monotonic() - last_shown[0] > 0.5:
                            last_shown[0] = time.monotonic()
                            self.on_looks(self._look_state(runs, driver.slots))
                    elif time.monotonic() - last_said[0] > PROGRESS_EVERY_S:
                        last_said[0] = time.monotonic()
                        self.say("runs: " + "; ".join(
                            f"#{h} {sum(RunStatus(r.status).is_finished() for r in rs)}/{len(rs)} finished, "
                            f"{sum(r.status == RunStatus.RUNNING for r in rs)} running" for h, rs in runs.items()))
                    return any(all(RunStatus(r.status).is_finished() for r in rs) for rs in runs.values())

                while not self.stop.is_set() and not one_look_complete():
                    worker.check()  # the driver's own error (a trusted prepare failing): raised here
                    self.stop.wait(LOOK_POLL_S)
                worker.check()
                if self.on_looks is not None:
                    self.on_looks({})
        finally:
            if clock is not None:
                clock.cancel()
            try:
                worker.halt()  # the driver's thread closes the driver: stages cancelled, claimed runs re-queued
            finally:
                if not worker.started:  # the driver's start failed: closed here
                    driver.close()
                elif worker.alive:  # a second signal while it finished a step (a long prepare): not closed under it
                    log.warning("the driver thread did not stop; its claimed runs are re-queued at the next start")
                from agent.summary import redraw_stale_progress

                redraw_stale_progress(self.svc)
                self.svc.painter.flush()  # the summaries' pictures are on disk when `run` returns
                self.say("loop stopped" + (f" ({self.stop_reason})" if self.stop_reason else ""))
        hyps = {h.id: h for h in self.records.all()}  # a withdrawn proposal is not among them
        return {"started": self.started, "hypotheses": list(hyps), "stopped": self.stop_reason or None,
                "this_run": [self._row(hyps[hid]) for hid in self.touched if hid in hyps]}

    @staticmethod
    def _row(h: Hypothesis) -> dict[str, Any]:
        return {"id": h.id, "title": h.title, "status": h.status, "look": h.look, "verdict": h.verdict,
                "decision": h.decision, "promoted_tag": h.promoted_tag}

    def _look_state(self, runs: dict[int, list[Any]], slots: int) -> dict[int, dict[str, Any]]:
        """Per hypothesis waiting for a look: runs done, running and planned, and an ETA from the
        wall time of the look's finished runs (the slots working in parallel)."""
        out = {}
        for hid, rs in runs.items():
            done = [r for r in rs if RunStatus(r.status).is_finished()]
            walls = [r.finished_at - r.started_at for r in done if r.finished_at and r.started_at]
            left = len(rs) - len(done)
            eta = left * (sum(walls) / len(walls)) / max(1, slots) if walls else None
            h = self.records.get(hid)
            out[hid] = {"title": h.title, "look": h.look, "done": len(done), "total": len(rs),
                        "running": sum(r.status == RunStatus.RUNNING for r in rs), "eta_s": eta}
        return out

    def _idle_wait(self) -> float:
        """Until the next poll, or sooner if the LLM's back-off ends first."""
        left = self.llm_retry_at - time.time()
        return max(0.05, min(self.opts.idle_poll_s, left)) if left > 0 else self.opts.idle_poll_s
