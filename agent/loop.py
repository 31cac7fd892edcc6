"""The driver loop behind `autoresearch run`: keeps hypotheses in flight, executes their runs,
enforces budgets and guards, and stops gracefully.

It is deliberately plain: pick or propose hypotheses up to `max_in_flight`, invoke each one's
graph (which queues its runs or moves it on), then let the execution layer work the queue until
one in-flight hypothesis has all the runs of its current look. After a crash or `kill -9`, a
restart finds the hypotheses still active in the store and invokes their graphs again; the runs
they queued are reconciled by the execution layer under the same keys.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from agent.records import ACTIVE, Hypothesis, Records
from pipeline import runner
from pipeline.lab import Lab

log = logging.getLogger("autoresearch.loop")

GUARD_STREAK = 3  # hypotheses in a row rejected or failing before the loop backs off
GUARD_BACKOFF_S = 600.0
MAX_GRAPH_FAILURES = 3  # unexpected errors in one hypothesis's graph before it is given up
PROGRESS_EVERY_S = 30.0  # how often `run` reports the runs of the looks in flight


@dataclass
class LoopOptions:
    max_hypotheses: int | None = 3
    hours: float | None = None
    forever: bool = False
    executor: str = "local"
    workers: int | None = None
    ray_address: str | None = None
    offline: bool = False
    policy: str | None = None  # a name in agent.policy.POLICIES; None: the first configured one
    supervised: bool = False
    smoke: bool = True
    db: str | None = None
    idle_poll_s: float = 10.0


def reverification_message(r: dict[str, Any], metric: str, higher_is_better: bool) -> str:
    """One line on how a champion held up on fresh seeds, worded by the metric's direction
    (for a lower-is-better metric a rise of the mean is a loss, and `tasks_worse` counts rises)."""
    shrink = r["shrinkage"]
    moved = "no change" if shrink == 0 else "better" if (shrink > 0) == higher_is_better else "worse"
    return (f"{r['tag']} re-verified on {len(r['fresh_seeds'])} fresh seeds: mean {metric} "
            f"{r['fresh_mean']:.4f} vs {r['selected_mean']:.4f} on the runs it was selected on "
            f"({shrink:+.4f}, {moved}: {'higher' if higher_is_better else 'lower'} is better; "
            f"{r['tasks_worse']}/{len(r['tasks'])} tasks worse)")


def choose_policy(lab: Lab, store: Any, offline: bool, name: str | None = None):
    """`--policy NAME`, `--offline` (= offline), or the first configured policy of the registry."""
    from agent.policy import make_policy

    return make_policy(lab, store, "offline" if offline else name)


class Loop:
    def __init__(self, lab: Lab, opts: LoopOptions, progress: Callable[[str], None] | None = None):
        from agent.graph import Services, build_graph, open_checkpointer
        from agent.workspace import Workspace

        self.lab, self.opts = lab, opts
        self.say = progress or (lambda msg: log.info(msg))
        self.store = runner.open_store(lab, opts.db)
        self.records = Records(self.store)
        self.policy = choose_policy(lab, self.store, opts.offline, opts.policy)
        self.stop = threading.Event()
        self.svc = Services(lab, self.store, self.records, Workspace(lab), self.policy, opts.supervised, opts.smoke,
                            stop=self.stop)
        self.checkpointer = open_checkpointer(self.svc)
        self.graph = build_graph(self.svc, self.checkpointer)
        self.started = 0  # hypotheses this run worked on: started, or resumed after a crash
        self.t0 = time.monotonic()
        self.backoff_until = 0.0
        self.failures: dict[int, int] = {}
        self._budget_said = False
        self.stop_reason = ""

    def close(self) -> None:
        """Stop the smoke runs' worker and release the checkpointer's connection (the store stays readable)."""
        self.svc.experiment.close()
        conn = getattr(self.checkpointer, "conn", None)
        if conn is not None:
            conn.close()

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
        """A guard holds new hypotheses back: the failure streak's back-off, or the LLM's daily budget."""
        return time.time() < self.backoff_until or self.llm_budget_spent()

    def may_start(self) -> bool:
        if self.stop.is_set() or self.out_of_time():
            return False
        return self.count_left() and not self.blocked()

    def llm_budget_spent(self) -> bool:
        """Whether today's LLM spend reached the cap; said once (in `status` too) when it does."""
        client = self.policy.llm
        cap = getattr(client, "max_usd_per_day", None) if client is not None else None
        if client is None or cap is None:
            return False
        spent = client.spent_today()
        if spent < cap:
            self._budget_said = False
            return False
        if not self._budget_said:
            self._budget_said = True
            msg = (f"LLM budget reached: ${spent:.4f} of ${cap:.2f} spent today (UTC); no new hypothesis until "
                   "the cap resets at UTC midnight")
            self.records.event("budget", msg)
            self.say(msg)
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
                       f"no new hypothesis until {time.strftime('%H:%M:%S', time.localtime(self.backoff_until))}")
                self.records.event("guard", msg)
                self.say(msg)

    def _failure_report(self, h: Hypothesis) -> dict | None:
        recs = self.store.gate_records(str(h.id), kind="verdict")
        return recs[-1].payload.get("failures") if recs else None

    # -------------------------------------------------------------- hypotheses

    def next_hypothesis(self) -> Hypothesis | None:
        h = self.records.next_queued()
        if h is not None:
            return self.records.update(h.id, status="proposing" if not h.title else "implementing")
        base = self.svc.workspace.baseline_head()
        if any(x.reject_kind == "exhausted" and x.origin == self.policy.name and x.base_commit == base
               for x in self.records.all(("done",))):
            return None  # nothing untried around this baseline; wait for human seeds or a new baseline
        return self.records.add(Hypothesis(status="proposing", origin=self.policy.name))

    def advance(self, h: Hypothesis, resume: str | None = None) -> Hypothesis:
        """One pass of the hypothesis's graph; with `resume`, the human's answer to its hold. An
        unexpected error is recorded, and after MAX_GRAPH_FAILURES of them the hypothesis is given
        up: one broken idea must not stop the loop."""
        from langgraph.types import Command

        from pipeline.smoke import Interrupted

        config = {"configurable": {"thread_id": str(h.id)}}
        before = (h.status, h.look, h.verdict)
        try:
            if resume is not None and not self.graph.get_state(config).interrupts:
                # held, but its thread never reached the interrupt (a crash in between): get it there first
                self.graph.invoke({"hypothesis_id": h.id}, config)
            self.graph.invoke(Command(resume=resume) if resume is not None else {"hypothesis_id": h.id}, config)
        except Interrupted:
            return self.records.get(h.id)  # stopping: the next start resumes it
        except Exception as e:
            log.exception("hypothesis %s: graph failed", h.id)
            n = self.failures[h.id] = self.failures.get(h.id, 0) + 1
            msg = f"#{h.id}: {type(e).__name__}: {e} (failure {n} of {MAX_GRAPH_FAILURES})"
            self.records.event("error", msg)
            self.say(msg)
            if n >= MAX_GRAPH_FAILURES:
                self.records.update(h.id, status="done", decision="reject", reject_kind="internal_error",
                                    reject_reason=msg, finished_at=time.time())
        h = self.records.get(h.id)
        if (h.status, h.look, h.verdict) != before:
            self.report(h)
        return h

    def report(self, h: Hypothesis) -> None:
        if h.status == "measuring":
            why = f"verdict escalate{self._evidence(h)}; " if h.verdict == "escalate" else ""
            self.say(f"#{h.id} {h.title!r}: {why}measuring, look of {h.look} challenger runs on "
                     f"{len(self.lab.tasks())} tasks")
        elif h.status == "done" and h.decision == "reject":
            self.say(f"#{h.id} {h.title!r}: rejected ({h.reject_kind}): {h.reject_reason}")
        elif h.status in ("done", "held"):
            extra = f" → {h.promoted_tag}" if h.promoted_tag else ""
            self.say(f"#{h.id} {h.title!r}: verdict {h.verdict}{self._evidence(h)}, decision {h.decision}{extra}")

    def _evidence(self, h: Hypothesis) -> str:
        """` at look N (horizontal Δ +0.42σ, t 1.3 vs boundary 2.9)` from the gate's last record."""
        recs = self.store.gate_records(str(h.id), kind="verdict")
        if not recs:
            return ""
        g = recs[-1].payload
        hz = g.get("horizontal") or {}
        if hz.get("delta") is None or hz.get("t") is None:
            return f" at look {g.get('look')}"
        bound = f" vs boundary {hz['boundary']:.2f}" if hz.get("boundary") is not None else ""
        sep = ", " if g.get("higher_is_better", True) else ", + = better; "  # the horizontal Δ is oriented
        return f" at look {g.get('look')} (horizontal Δ {hz['delta']:+.2f}σ{sep}t {hz['t']:.2f}{bound})"

    def release_holds(self) -> None:
        """Resume the threads of held hypotheses a human approved or rejected, at their `hold` node;
        bring one that a crash stopped short of it (before its summary) there first."""
        for h in self.records.all(("held",)):
            if h.review in ("approved", "rejected"):
                self.advance(h, resume="approve" if h.review == "approved" else "reject")
            elif not self.graph.get_state({"configurable": {"thread_id": str(h.id)}}).interrupts:
                self.advance(h)

    def note_reverifications(self) -> None:
        """Once a promoted champion's fresh baseline runs are all in, record how it held up."""
        from agent.graph import reverification

        for h in self.records.all(("done",)):
            if not h.promoted_tag or self.store.gate_records(str(h.id), kind="reverify"):
                continue
            r = reverification(self.svc, h)
            if r is None:
                continue
            self.store.put_gate_record(str(h.id), 0, r, kind="reverify")
            bench = self.lab.config.benchmark
            msg = reverification_message(r, bench.metric, bench.higher_is_better)
            self.records.event("reverified", msg)
            self.say(msg)

    # -------------------------------------------------------------- main loop

    def pending_runs(self, h: Hypothesis) -> list[int]:
        from agent.graph import queue_look

        if h.status != "measuring" or not h.commit:
            return []
        return queue_look(self.svc, h)

    def run(self) -> dict[str, Any]:
        executor = runner.make_executor(self.opts.executor, self.lab, workers=self.opts.workers,
                                        ray_address=self.opts.ray_address)
        driver = runner.Driver(self.lab, self.store, executor)
        self.say(f"loop started: policy {self.policy.name}, executor {self.opts.executor} "
                 f"({executor.slots} slots), lab {self.lab.root}")
        clock = self._start_clock()
        try:
            driver.start()
            resumed = self.records.all(ACTIVE)
            for h in resumed:
                self.say(f"#{h.id} {h.title!r}: resuming ({h.status})")
            self.started = len(resumed)
            while not self.stop.is_set() and not self.out_of_time():
                self.release_holds()
                self.note_reverifications()
                self.guard()
                in_flight = self.records.all(ACTIVE)
                while len(in_flight) < self.lab.config.agent.max_in_flight and self.may_start():
                    h = self.next_hypothesis()
                    if h is None:
                        break
                    self.started += 1
                    in_flight.append(h)
                if not in_flight:
                    # idle: wait for seeds (--forever) or for a guard to lift (--forever, --hours)
                    wait = self.opts.forever or (self.opts.hours is not None and self.count_left() and self.blocked())
                    if wait and not self.stop.is_set():
                        self.stop.wait(self.opts.idle_poll_s)
                        continue
                    if self.count_left() and self.blocked():
                        self.say("stopping: a guard holds new hypotheses back (see `autoresearch status`)")
                    break
                waiting: dict[int, list[int]] = {}
                for h in in_flight:
                    if self.stop.is_set():
                        break
                    h = self.advance(h)
                    if h.status == "measuring":
                        waiting[h.id] = self.pending_runs(h)
                if not waiting:
                    continue

                last_said = [time.monotonic()]

                def one_look_complete() -> bool:
                    runs = {h: self.store.runs(ids) for h, ids in waiting.items()}
                    if time.monotonic() - last_said[0] > PROGRESS_EVERY_S:
                        last_said[0] = time.monotonic()
                        self.say("runs: " + "; ".join(
                            f"#{h} {sum(r.status in ('done', 'failed') for r in rs)}/{len(rs)} finished, "
                            f"{sum(r.status == 'running' for r in rs)} running" for h, rs in runs.items()))
                    return any(all(r.status in ("done", "failed") for r in rs) for rs in runs.values())

                driver.drive(until=one_look_complete, stop=self.stop)
        finally:
            if clock is not None:
                clock.cancel()
            driver.close()
            self.say("loop stopped" + (f" ({self.stop_reason})" if self.stop_reason else ""))
        return {"started": self.started, "hypotheses": [h.id for h in self.records.all()]}
