"""`Loop`: the scheduler. It keeps hypotheses in flight, starts the execution layer's thread, and
resumes each thread when what it waits for has come; it holds no state of a hypothesis and never
writes a phase (the graph does: agent.graph)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from agent.config import agent_config
from agent.graph import GraphSpec, Services, graph_spec, open_checkpointer
from agent.lifecycle import Status
from agent.loop.driver_thread import DriverThread
from agent.loop.guards import Guards
from agent.loop.lease import LeaseAndClock
from agent.loop.options import LoopOptions, choose_policy, in_flight_room
from agent.loop.reporting import Reporting
from agent.loop.threads import Threads
from agent.pictures import Painter
from agent.records import ACTIVE, Hypothesis, Records
from agent.workspace import Workspace
from pipeline.api import Lab, RunStatus, open_store

log = logging.getLogger("autoresearch.loop")

PROGRESS_EVERY_S = 30.0  # how often `run` reports the runs of the looks in flight
PROGRESS_CHART_EVERY_S = 30.0  # the lab's progress chart: redrawn at most this often at decisions (and at promotions)
REVERIFY_POLL_S = 2.0  # how often the loop looks whether a champion's fresh runs are all in
LOOK_POLL_S = 0.2  # how often the loop's thread looks for a look with all its runs in
UPKEEP_S = 6 * 3600.0  # how often the lab's repository is packed (`upkeep`), the first time at start


class Loop(LeaseAndClock, Guards, Threads, Reporting):
    """The scheduler; its guards, lease, thread stepping and messages are its parts' (one module each)."""

    def __init__(self, lab: Lab, opts: LoopOptions, progress: Callable[[str], None] | None = None,
                 looks: Callable[[dict[int, dict[str, Any]]], None] | None = None,
                 graph: Callable[[Services], GraphSpec] = graph_spec):
        """`progress` gets the loop's messages; `looks`, if given, where each look in flight stands
        (runs done, running, total, ETA), every half second while runs execute (a terminal's bars).
        `graph` makes the hypotheses' graph from the loop's services (`agent.graph.graph_spec`, or a
        function that adds a node to it: `GraphSpec.insert_after`)."""
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
            self.graph = graph(self.svc).compile(self.checkpointer, projection=self.records)
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
        self._env_checked = time.monotonic()  # the last look at the installed versions (`environment_moved`)
        self._upkept = -UPKEEP_S  # when `upkeep` last started (monotonic)
        self._upkeep: threading.Thread | None = None

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

    def remeasure_baseline(self, env: Any) -> str | None:
        """Re-measure the baseline when the loop runs in another measurement environment than the one
        its runs were measured in (`pipeline.environment`): a new commit with its tree on the baseline
        branch, so its runs are made again here and the challengers from now on are compared within
        one environment (`[run] remeasure_on_change`; off, a gain across the change is held for a
        human instead). The new commit, or None."""
        from pipeline.api import PromotionConflict

        changed = self.svc.experiment.environment_change(env)
        if changed is None:
            return None
        head, what = changed
        if not self.lab.config.run.remeasure_on_change:
            self.say(f"the environment changed since the baseline was measured ({what}); "
                     "[run] remeasure_on_change = false: gains across the change are held for a human")
            return None
        try:
            commit = self.svc.workspace.remeasure(head, f"Re-measure the baseline in environment {env.id}: {what}")
        except PromotionConflict as e:
            self.say(f"baseline not re-measured: {e}")
            return None
        msg = (f"the environment changed since the baseline {head[:10]} was measured ({what}): "
               f"its code is measured again as {commit[:10]}")
        self.records.event("environment", msg)
        self.say(msg)
        return commit

    def upkeep(self) -> None:
        """Every UPKEEP_S (and at start), pack the lab's repository in a thread of its own
        (`LabRepo.maintain`): a year of hypotheses leaves 32,000 loose refs and 64,000 loose objects.
        The loop does not wait for it at its end: a git left running finishes on its own."""
        if time.monotonic() - self._upkept < UPKEEP_S or (self._upkeep is not None and self._upkeep.is_alive()):
            return
        self._upkept = time.monotonic()
        from pipeline.api import LabRepo

        repo = LabRepo(self.lab.root)  # its own GitPython objects: the loop's are not shared across threads

        def pack() -> None:
            try:
                for line in repo.maintain():
                    log.info("repository upkeep: %s", line)
            except Exception as e:  # never the loop's failure
                log.warning("repository upkeep failed: %s", e)

        self._upkeep = threading.Thread(target=pack, name="repository-upkeep", daemon=True)
        self._upkeep.start()

    # -------------------------------------------------------------- main loop

    def room_for_another(self, in_flight: list[Hypothesis], slots: int) -> bool:
        """Whether one more hypothesis may start now. `[agent] max_in_flight`, if set, is the limit;
        unset, it is derived from the slots (`in_flight_room`), with the runs outstanding now."""
        limit = agent_config(self.lab).agent.max_in_flight
        if limit is not None:
            return len(in_flight) < limit
        first = len(self.lab.tasks()) * self.lab.config.gate.looks[0]
        if not in_flight or slots <= first:
            return not in_flight
        counts = self.store.queue_counts()
        # not queued yet: a first look each (a promotion waiting for its replication has its runs queued)
        coming = sum(1 for h in in_flight if h.status not in (Status.MEASURING, Status.PROMOTING, Status.HELD))
        return in_flight_room(slots, first, len(in_flight), counts["queued"] + counts["running"] + coming * first)

    def run(self) -> dict[str, Any]:
        driver = self.svc.experiment.driver(self.opts.executor, heartbeat=self.heartbeat)
        self.say(f"loop started: policy {self.policy.name}, executor {self.opts.executor.kind} "
                 f"({driver.slots} slots), lab {self.lab.root}")
        clock = self._start_clock()
        worker = self.driver_thread = DriverThread(driver, self.stop)
        try:
            driver.start()  # here: a sandbox that cannot start is one line before any thread runs
            if driver.environment_note:  # a cluster of mixed nodes: stages on one environment's
                self.records.event("environment", driver.environment_note)
                self.say(driver.environment_note)
            self.remeasure_baseline(driver.environment)
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
                self.upkeep()
                if self.environment_moved(driver):
                    break
                if self.plateau() and self.stop.is_set():
                    break
                in_flight = self.records.all(ACTIVE) + self.replicating_holds()
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
                    if after.status in (Status.MEASURING, Status.PROMOTING, Status.HELD):  # a look's, a replication's
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
                    if self.environment_moved(driver):  # a look can take hours
                        break
                    self.upkeep()
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

    def _idle_wait(self) -> float:
        """Until the next poll, or sooner if the LLM's back-off ends first."""
        left = self.llm_retry_at - time.time()
        return max(0.05, min(self.opts.idle_poll_s, left)) if left > 0 else self.opts.idle_poll_s
