"""The graph's nodes: propose, implement (agent.graph.implement), evaluate, decide, hold, promote,
summarize, reverify. Each reads where its thread is from the state, does its one step (its side
effects keyed, so a node that died half-way is simply run again), and returns the state's update
from `Step._to`. Where the thread goes next is the routers' (agent.graph.spec), never a node's."""

from __future__ import annotations

import time
from typing import Any

from agent.errors import LLMError, LLMOutputError
from agent.graph.context import build_context, proposal_context
from agent.graph.implement import Implement
from agent.graph.promotion import (base_moved, promote, queue_look, queue_rank, queue_refinement, queue_replication,
                                    rebase, rebased_note, replicated, reverification, withdraw_replication)
from agent.graph.state import HOLD, LOOK, State
from agent.graph.step import phase_of, verdict_of
from agent.lifecycle import Decision, Review, ReviewAction, Status
from agent.policy import Choice
from agent.records import Hypothesis
from agent import prompts
from agent.verdicts import DecisionRecord, replicate_record, reverify_record
from pipeline.api import Verdict, implausible, render_markdown

WAITING = object()  # `Nodes._replication`: the thread waited for the replication's runs

def allowed_decisions(verdict: Verdict | None, look: int, looks: list[int], supervised: bool) -> list[Decision]:
    """The gate bounds the agent: no promotion without `improvement`, escalation only to a planned look."""
    later = [n for n in looks if n > look]
    if verdict == Verdict.improvement:
        return [Decision.HOLD if supervised else Decision.PROMOTE, Decision.ABANDON]
    if verdict == Verdict.escalate and later:
        return [Decision.ESCALATE, Decision.ABANDON]
    return [Decision.ABANDON, Decision.REFINE]



class Nodes(Implement):
    """The graph's nodes. Each reads where its thread is from the state (`phase_of`), does its one
    step (its side effects keyed, so a node that died half-way is simply run again), and returns
    the state's update from `_to`, which projects it onto the hypothesis's row in the same step.
    Where the thread goes next is the routers' (`graph_spec`), never a node's."""

    # propose ----------------------------------------------------------------
    def propose(self, state: State) -> State:
        rec = self.svc.records
        h = rec.get(state["hypothesis_id"])
        # the lab's first comparison will wait for its noise study (evaluate): queued now (idempotently),
        # its runs go while the hypothesis is proposed, implemented and smoke-run
        self.svc.experiment.noise_study(self.svc.workspace.baseline_head(), rank=queue_rank(h))
        if h.title:  # a seed, or a proposal recorded by a pass that died before its checkpoint
            return self._to(h, Status.IMPLEMENTING)
        try:
            # the endpoint down, refusing or over budget leaves the node: no answer is no hypothesis,
            # and the loop (which created this empty one) withdraws it and backs off
            p = self.svc.policy.propose(proposal_context(self.svc))
        except LLMOutputError as e:  # it answered, but nothing usable after the repair rounds: recorded
            return self._reject(h, "propose", f"{type(e).__name__}: {e}", title="(no proposal)")
        if p is None:
            return self._reject(h, "exhausted", "the policy has no untried idea left", title="(search space exhausted)",
                                base_commit=self.svc.workspace.baseline_head())
        return self._to(h, Status.IMPLEMENTING, title=p.title, rationale=p.rationale, expected_effect=p.expected_effect,
                        expected_tasks=p.expected_tasks, change=p.change, plan=p.plan, seed_text=p.notes or None,
                        origin=self.svc.policy.name)


    # evaluate ---------------------------------------------------------------
    def evaluate(self, state: State) -> State:
        """The look's runs queued (idempotently); the thread waits for them in an interrupt, and is
        then judged by the gate (one record per look)."""
        svc = self.svc
        h = svc.records.get(state["hypothesis_id"])
        look = state.get("look") or h.look or svc.lab.config.gate.looks[0]
        # a lab's first comparison waits for its noise study, then is recorded (none after that)
        study = svc.experiment.noise_study(h.base_commit, rank=queue_rank(h))
        noise = bool(study) and not svc.experiment.finished(study)
        ids = study if noise else queue_look(svc, h, look)
        if not svc.experiment.finished(ids):
            from langgraph.types import interrupt

            # the thread pauses here, in its checkpoint, until the loop resumes it with the runs in;
            # resumed early, it waits again (a fresh pass of this node: the phase stays `measuring`)
            interrupt({"kind": LOOK, "hypothesis_id": h.id, "look": look, "runs": ids, "noise_study": noise})
            return {}
        result = svc.experiment.judge_look(h.base_commit, h.commit, look, record_as=str(h.id))
        return self._to(h, Status.DECIDING, look=look, verdict=result.verdict or Verdict.inconclusive)

    # decide -----------------------------------------------------------------
    def decide(self, state: State) -> State:
        """The policy's choice within what the verdict allows: escalate (→ evaluate the next look),
        promote (→ promote), hold (→ summarize, then wait for a human), abandon or refine (→ summarize)."""
        svc = self.svc
        h = svc.records.get(state["hypothesis_id"])
        look = state.get("look") or h.look or 0
        verdict = verdict_of(state, h)
        looks = svc.lab.config.gate.looks
        allowed = allowed_decisions(verdict, look, looks, svc.supervised)
        too_good = self._too_good(h, verdict, look)
        if too_good:  # never promoted automatically, whatever --supervised says
            allowed = [Decision.HOLD]
        choice = self._choice(h, look, verdict, allowed)
        if too_good and choice.decision == Decision.HOLD:
            choice.rationale = f"Held for human review: {too_good}. {choice.rationale}"
        rationale = rebased_note(svc, h) + choice.rationale
        if choice.decision == Decision.ESCALATE:
            return self._to(h, Status.MEASURING, look=min(n for n in looks if n > look), decision=Decision.ESCALATE,
                            rationale_decision=rationale)
        fields: dict[str, Any] = {"decision": choice.decision, "rationale_decision": rationale,
                                  "follow_up": choice.follow_up or None}
        replicating = False
        if choice.decision in (Decision.PROMOTE, Decision.HOLD) and not base_moved(svc, h):
            replicating = bool(queue_replication(svc, h))  # its replication runs while it waits (judged later)
        if choice.decision == Decision.PROMOTE:
            return self._to(h, Status.PROMOTING, **fields)
        if choice.decision == Decision.HOLD:  # summarized first, then the hold node waits for a human: asked
            # (review pending, `review` lists it, the hold notification goes) once it replicated, if it must
            return self._to(h, Status.HELD, review=Review.NONE if replicating else Review.PENDING, **fields)
        if choice.decision == Decision.REFINE and choice.follow_up:
            queue_refinement(svc, h, choice.follow_up)
        return self._to(h, Status.SUMMARIZING, **fields)

    # hold -------------------------------------------------------------------
    def hold(self, state: State) -> State:
        """A held promotion (`--supervised`, or too good to be true) waits here, as a LangGraph
        interrupt in the thread's checkpoint, until `review --approve/--reject` resumes it. With
        `[gate] replicate_runs` it first waits for its replication (queued at the decision): a gain
        that is not there again is abandoned without asking anyone, one that is reaches the reviewer
        with the replication in its summary: its review turns pending (`review` lists it, the hold
        notification goes) only then. An answer given meanwhile is kept (a reject ends it at once and
        withdraws its replication runs not started yet); one whose base moved is asked without its
        replication (it would be re-based and measured again after an approval)."""
        from langgraph.types import interrupt

        from agent.summary import write_summary

        h = self.svc.records.get(state["hypothesis_id"])
        if h.review == Review.REJECTED:  # a reviewer who did not wait for the replication
            return self._to(h, Status.SUMMARIZING, decision=Decision.ABANDON)
        if base_moved(self.svc, h):  # re-based at `promote`, after the review: its replication is moot
            withdraw_replication(self.svc, h)
        else:
            judged = replicate_record(self.svc.store, h.id) is not None
            r = self._replication(h)
            if r is WAITING:
                return {}
            if r is not None and not r["passed"]:
                return self._not_replicated(h, r)
            if r is not None and not judged:  # judged in this pass: the reviewer reads it in the summary
                write_summary(self.svc, h)
        if not h.summary_md:  # the reviewer reads a summary, whatever path led here (summarize writes it)
            write_summary(self.svc, h)
        if h.review == Review.NONE:  # now the reviewer is asked (an answer given before is kept)
            h = self.svc.records.ask_review(h.id)
        answer = interrupt({"kind": HOLD, "hypothesis_id": h.id, "reason": h.rationale_decision or ""})
        if answer not in (ReviewAction.APPROVE, ReviewAction.REJECT):
            # the answer to the replication runs' wait ("finished"), which a pass resumed from it reaches
            # (judged now, or the wait ended without a judgement: its base moved, the lab asks for no
            # replication since, a crash after the judgement): no reviewer's; asked in a pass of its own
            return {}
        if answer == ReviewAction.APPROVE:
            return self._to(h, Status.PROMOTING, decision=Decision.PROMOTE)
        return self._to(h, Status.SUMMARIZING, decision=Decision.ABANDON)

    # promote ----------------------------------------------------------------
    def promote(self, state: State) -> State:
        """The one place a hypothesis becomes the baseline (idempotent: a re-run finds it merged).

        Every promote decision is carried out here, the decide node's and an approved hold's, so
        this is where its base is checked: a hypothesis whose base moved since it was measured is
        re-based (`rebase`) and goes back to `evaluate`, to be measured against the current baseline
        from its first look; only a hypothesis compared with the current head is promoted, and that
        is a fast-forward. With `[gate] replicate_runs` it is first replicated on fresh seeds: the
        thread waits here (an interrupt) for the runs the decision queued, and a gain that is not
        there again is an abandon with the reason (`Experiment.replication`). Promotions are one at
        a time: one driver per lab (its lease), and the driver advances its threads one after
        another in its own thread (`graph.invoke` returns only when a thread stops), so no two
        promote nodes run at once; `Workspace.promote` moves the baseline branch only from the head
        it read (`git update-ref NEW OLD`) besides."""
        h = self.svc.records.get(state["hypothesis_id"])
        if h.promoted_tag:  # promoted by a pass that died before its checkpoint
            return {**self._to(h, Status.SUMMARIZING), "champion": h.promoted_tag}
        if base_moved(self.svc, h):
            update, fields = rebase(self.svc, h)
            return self._to(h, Status(update.pop("phase")), **update, **fields)
        r = self._replication(h)
        if r is WAITING:
            return {}
        if r is not None and not r["passed"]:
            return self._not_replicated(h, r)
        if r is None:  # none asked for: the gate's improvement is the stream's discovery (LOND)
            self.svc.experiment.promoted_unreplicated(h.base_commit, h.commit)
        fields = promote(self.svc, h)
        return {**self._to(h, Status.SUMMARIZING, **fields), "champion": fields.get("promoted_tag")}

    def _replication(self, h: Hypothesis) -> Any:
        """The promotion's replication (`[gate] replicate_runs`): its record, None when the lab asks
        for none, or WAITING after the thread waited for its runs (an interrupt; the node returns and
        its router brings it back). Judged once, against this base (a re-base moves the record
        aside), so a pass re-run after a crash carries out the same answer."""
        svc = self.svc
        r = replicate_record(svc.store, h.id)
        ids = [] if r is not None else queue_replication(svc, h)  # idempotent: queued at the decision
        if ids:
            r = svc.experiment.replication(h.base_commit, h.commit, record_as=str(h.id), look=h.look or 0)
            if r is None:  # its runs are not all in (or the lab asks for more since): it waits for them
                from langgraph.types import interrupt

                interrupt({"kind": LOOK, "hypothesis_id": h.id, "look": h.look, "runs": ids, "replication": True})
                return WAITING
            svc.records.event("replication", f"#{h.id}: {r['reason']}")
        return r

    def _not_replicated(self, h: Hypothesis, r: dict[str, Any]) -> State:
        return self._to(h, Status.SUMMARIZING, decision=Decision.ABANDON,
                        rationale_decision=f"Not promoted: the gate's improvement was {r['reason']}. "
                                           f"{h.rationale_decision or ''}".strip())

    def _too_good(self, h: Hypothesis, verdict: Verdict | None, look: int) -> str | None:
        if verdict != Verdict.improvement:
            return None
        why = implausible(self.svc.records.latest_verdict(h.id), self.svc.lab.config)
        if why or not h.commit:
            return why
        exp = self.svc.experiment
        mixed = None if base_moved(self.svc, h) else exp.mixed_environments(h.base_commit, h.commit, look)
        return exp.ran_alone(h.base_commit, h.commit) or mixed  # a moved base: re-based at promotion anyway

    def _choice(self, h: Hypothesis, look: int, verdict: Verdict | None, allowed: list[Decision]) -> Choice:
        """The policy's choice at this look, within `allowed`; stored before any side effect, so a
        re-run after a crash carries out the same decision instead of asking again."""
        svc = self.svc
        done = svc.records.decision_at(h.id, look)
        if done is not None and done.decision in allowed:  # an unknown decision string is in no allowed list
            return Choice(done.decision, done.rationale, done.follow_up)
        looks = svc.lab.config.gate.looks
        evidence = render_markdown(svc.records.latest_verdict(h.id))
        look_text = prompts.phrase("look", index=looks.index(look) + 1 if look in looks else "?",
                                   count=len(looks), runs=look)
        try:
            choice = svc.policy.decide(build_context(svc), h, verdict, evidence, allowed, look_text)
        except LLMError as e:  # no answer (budget, endpoint down, no valid JSON): follow the gate
            from agent.policy_offline import OfflinePolicy

            choice = OfflinePolicy().decide(build_context(svc), h, verdict, evidence, allowed, look_text)
            choice.rationale = f"No decision from the policy ({type(e).__name__}: {e}). {choice.rationale}"
        if choice.decision not in allowed:
            choice = Choice(Decision.ABANDON if Decision.ABANDON in allowed else allowed[-1],
                            f"the policy chose {choice.decision!r}, which the verdict {verdict} does not allow")
        svc.records.put_decision(h.id, DecisionRecord(look, choice.decision, choice.rationale, choice.follow_up,
                                                      list(allowed), verdict, svc.policy.name))
        return choice

    # summarize --------------------------------------------------------------
    def summarize(self, state: State) -> State:
        """The summary a human reviews: at a hold (before the reviewer approves), or at the end."""
        from agent.summary import write_summary

        svc, rec = self.svc, self.svc.records
        h = rec.get(state["hypothesis_id"])
        if phase_of(state, h) == Status.HELD:  # the summary a reviewer reads before approving
            write_summary(svc, h)
            return {}
        # every summary waits for a human read; approvals and comments steer the agent
        h = rec.update(h.id, review=Review.PENDING if h.review == Review.NONE else h.review)
        write_summary(svc, h)
        if h.commit and not h.promoted_tag:  # a champion's worktree serves its baseline runs
            withdraw_replication(svc, h)  # a promotion given up before its replication ran
            svc.experiment.release(h.commit)
        return self._to(h, Status.DONE, finished_at=time.time())

    # reverify ---------------------------------------------------------------
    def reverify(self, state: State) -> State:
        """After a promotion: the new champion's own runs (queued by `promote`, on seeds it was not
        selected on) are waited for in an interrupt, and how it held up is recorded (a `reverify`
        gate record and a loop event). The thread ends here; the hypothesis was decided before."""
        svc = self.svc
        h = svc.records.get(state["hypothesis_id"])
        tag = state.get("champion") or h.promoted_tag
        if not tag or reverify_record(svc.store, h.id) is not None:
            return {"champion": None}
        ids = svc.experiment.queue_champion(tag, tag, replicated=replicated(svc, h))  # idempotent: `promote`'s
        if not svc.experiment.finished(ids):
            from langgraph.types import interrupt

            interrupt({"kind": LOOK, "hypothesis_id": h.id, "champion": tag, "runs": ids})
            return {}
        r = reverification(svc, h)
        if r is None:  # a fresh run failed: nothing to compare on all tasks, said once
            svc.records.event("reverified", f"{tag}: not re-verified, a fresh run has no metric")
            return {"champion": None}
        svc.store.put_gate_record(str(h.id), 0, r, kind="reverify")
        bench = svc.lab.config.benchmark
        svc.records.event("reverified", reverification_message(r, bench.metric, bench.higher_is_better))
        return {"champion": None}



def reverification_message(r: dict[str, Any], metric: str, higher_is_better: bool) -> str:
    """One line on how a champion held up on fresh seeds, worded by the metric's direction
    (for a lower-is-better metric a rise of the mean is a loss, and `tasks_worse` counts rises)."""
    shrink = r["shrinkage"]
    moved = "no change" if shrink == 0 else "better" if (shrink > 0) == higher_is_better else "worse"
    return (f"{r['tag']} re-verified on {len(r['fresh_seeds'])} fresh seeds: mean {metric} "
            f"{r['fresh_mean']:.4f} vs {r['selected_mean']:.4f} on the runs it was selected on "
            f"({shrink:+.4f}, {moved}: {'higher' if higher_is_better else 'lower'} is better; "
            f"{r['tasks_worse']}/{len(r['tasks'])} tasks worse)")

