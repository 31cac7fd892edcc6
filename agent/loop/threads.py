"""A hypothesis's thread taken as far as it goes now: started, resumed from its checkpoint, or given
the answer to its interrupt (a look's runs in, a human's review, a champion's fresh runs)."""

from __future__ import annotations

import logging
import time
from typing import Any

from langgraph.types import Command
from sqlalchemy.exc import OperationalError

from agent.errors import AgentError, LLMError
from agent.graph import HOLD, LOOK, base_moved, give_up, reverification_message, thread_input, withdraw_replication
from agent.lifecycle import Review, ReviewAction, Status
from agent.records import Hypothesis
from agent.verdicts import reverify_record
from pipeline.api import InfrastructureFailure, Interrupted, LabConfigError, RunStatus

log = logging.getLogger("autoresearch.loop")

MAX_GRAPH_FAILURES = 3  # unexpected errors in one hypothesis's graph before it is given up
NOTHING = object()  # a thread with nothing to do now


class Threads:
    """`Loop`'s part that steps the threads."""

    def _thread(self, h: Hypothesis) -> dict[str, Any]:
        return {"configurable": {"thread_id": str(h.id)}}

    def waits_for(self, h: Hypothesis, snap: Any = None) -> dict[str, Any] | None:
        """What the hypothesis's thread is paused on (its interrupt's payload), or None; `snap`: its
        state, if read already."""
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
        config = self._thread(h)
        before = (h.status, h.look, h.verdict, h.review)  # a held one's review turns pending once it replicated
        if h.id not in self.touched:
            self.touched.append(h.id)
        for _ in range(len(self.lab.config.gate.looks) + 3):  # each step ends at an interrupt or the end
            try:
                step = self._step(h)
                if step is NOTHING or self.stop.is_set():
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
            except LabConfigError:  # the user's to fix (research.toml, the trusted harness, the datasets):
                raise  # the loop stops in one line, the thread waits at its checkpoint
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
                    try:  # its replication runs, if it waited for some, are nobody's now
                        withdraw_replication(self.svc, self.records.get(h.id))
                    except Exception:  # the failure it was given up for may be this one's too
                        log.exception("hypothesis %s: its replication runs not withdrawn", h.id)
                break
            h = self.records.get(h.id)
            if h.status == Status.DONE:
                break
        h = self.records.get(h.id)
        if h.title and before[0] in (Status.PROPOSING, Status.IMPLEMENTING) and h.status != before[0]:
            self._llm_back()  # a proposal or an implementation came: the endpoint answers
        if self.opts.mlflow and h.status == Status.DONE and before[0] != Status.DONE:
            self._export(h)
        if (h.status, h.look, h.verdict, h.review) != before and not (h.status == Status.DONE and before[0] == Status.DONE):
            self.report(h)
        if h.promoted_tag and h.status == Status.DONE and self.reverifying is not None:
            self.reverifying.add(h.id)  # its thread waits for the champion's fresh runs
        return h

    def _step(self, h: Hypothesis) -> Any:
        """What to give the thread now: its start, None (go on from the checkpoint), the answer to
        its interrupt — or `NOTHING` while it waits for runs, a human or the LLM's back-off."""
        if h.id in self.llm_waiting:
            if time.time() < self.llm_retry_at:
                return NOTHING
            self.llm_waiting.discard(h.id)
        snap = self.graph.get_state(self._thread(h))
        if snap.interrupts:
            waits = self.waits_for(h, snap) or {}
            if waits.get("kind") == LOOK:
                # a noise study the lab no longer asks for (`noise_runs = 0` since the checkpoint) is not waited on
                # nor a replication the lab no longer asks for (`replicate_runs = 0` since) or one against a
                # base that moved meanwhile (its promote node re-bases it)
                now = self.records.get(h.id)
                done = ((waits.get("noise_study") and not self.svc.experiment.wants_noise_study())
                        or (waits.get("replication") and (not self.svc.experiment.wants_replication()
                                                          or base_moved(self.svc, now)
                                                          or (now.status == Status.HELD  # a held one rejected
                                                              and now.review == Review.REJECTED)))
                        or self.svc.experiment.finished(list(waits.get("runs", []))))
                return Command(resume="finished") if done else NOTHING
            answer = {Review.APPROVED: ReviewAction.APPROVE, Review.REJECTED: ReviewAction.REJECT}.get(self.records.get(h.id).review)
            return NOTHING if answer is None else Command(resume=answer)
        if snap.next:
            return None  # stopped or killed inside a node: that node runs again (its side effects are keyed)
        h = self.records.get(h.id)
        if snap.created_at is not None and h.status == Status.DONE:
            # ended; but a champion whose thread an earlier version ended at its promotion is re-verified
            legacy = "phase" not in (snap.values or {}) and h.id in (self.reverifying or ())
            return thread_input(h) if legacy else NOTHING
        # a new thread; or one that ended while its hypothesis is active, which only a lab driven by an
        # earlier version has (its threads ended at every wait): started at the node of its row's status
        return thread_input(h)

    def _export(self, h: Hypothesis) -> None:
        """`run --mlflow URI`: the decided hypothesis to MLflow; a tracking server that fails is said
        and retried at the next decision (`export mlflow` catches up), never a stop of the loop."""
        try:
            if self._exporter is None:
                from agent.mlflow_export import Exporter

                self._exporter = Exporter(self.lab, self.store, self.opts.mlflow or "")
            self._exporter.export(h)
        except (InfrastructureFailure, AgentError, OSError) as e:  # the server down or refusing the run, an
            # artifact store refusing a file
            self._exporter = None
            self.records.event("mlflow", f"#{h.id} not exported: {e}")
            self.say(f"#{h.id} not exported to MLflow: {e}")

    def release_holds(self) -> None:
        """Resume the threads of held hypotheses a human approved or rejected, at their `hold` node
        (one that a crash stopped short of it gets there first)."""
        for h in self.records.all((Status.HELD,)):
            self.advance(h)

    def replicating_holds(self) -> list[Hypothesis]:
        """Held hypotheses whose thread waits for its promotion's replication runs, before the
        reviewer is asked (`Nodes.hold`): in flight for the loop, which runs their runs."""
        return [h for h in self.records.all((Status.HELD,)) if (self.waits_for(h) or {}).get("replication")]

    def note_reverifications(self) -> None:
        """Resume the threads that wait, in their `reverify` node, for a new champion's fresh runs,
        once the runs are in; say how it held up. A thread an earlier version ended at the promotion
        (it re-verified in the loop) is given its `reverify` node once. Cheap when nothing is due:
        the runs a thread waits for are read from its checkpoint once, then one store query for
        all of them (the loop asks at most every REVERIFY_POLL_S)."""
        if self.reverifying is None:
            self.reverifying = {h.id for h in self.records.all((Status.DONE,))
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
                if step is not NOTHING and not self.stop.is_set():
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

    def pending_runs(self, h: Hypothesis) -> list[int]:
        """The runs the hypothesis's thread waits for (none unless it waits for a look)."""
        waits = self.waits_for(h)
        return list(waits["runs"]) if waits and waits.get("kind") == LOOK else []
