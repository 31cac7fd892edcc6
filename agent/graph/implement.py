"""The implement node: edits → checks → smoke run → one commit on `hyp/<id>-<slug>` and the tag
`exp/<id>`; a researcher's branch adopted (merged onto the current baseline if it moved)."""

from __future__ import annotations

import logging

from agent.config import agent_config
from agent.errors import LLMError, LLMUnavailable
from agent.graph.context import build_context
from agent.graph.promotion import queue_rank
from agent.graph.state import Services, State
from agent.graph.step import Step
from agent.lifecycle import Decision, Status
from agent.policy import Feedback
from agent.records import Hypothesis
from agent.workspace import EditRejected, FileEdit, PromotionConflict, slugify
from pipeline.api import MethodFailure, UserError

log = logging.getLogger("autoresearch.agent")

REPAIR_STAGE = {"compile_error": "compile", "smoke_failed": "smoke", "not_applying": "apply", "empty": "apply",
                "malformed": "apply"}


class Implement(Step):
    """The implement node and its helpers (`Nodes` has it)."""

    # implement --------------------------------------------------------------
    def implement(self, state: State) -> State:
        """Edits → checks → smoke run → one commit on `hyp/<id>-<slug>` and the tag `exp/<id>`.

        A hypothesis that carries edits (an offline proposal, a `seed --file` with edits) is tried
        with them first; a policy that can repair (the LLM) then gets each rejection fed back, up
        to `repair_rounds` times. Every rejected attempt is kept in the reason recorded.
        """
        svc, ws = self.svc, self.svc.workspace
        h = svc.records.get(state["hypothesis_id"])
        if h.decision == Decision.REJECT:  # rejected by a pass that died before its checkpoint
            return self._to(h, Status.SUMMARIZING)
        if h.commit:
            return self._to(h, Status.MEASURING, look=h.look or svc.lab.config.gate.looks[0])
        resumed = self._resume_tagged(h)  # a crash between the commit and its record
        if resumed is not None:
            return resumed
        base = ws.baseline_head()
        # a seed starts here, not at propose: the lab's noise study (idempotent) runs while it is implemented
        svc.experiment.noise_study(base, rank=queue_rank(h))
        if h.seed_branch:
            return self._adopt_branch(h, base)
        branch = h.branch or f"hyp/{h.id}-{slugify(h.title)}"
        ctx = build_context(svc)
        rounds = agent_config(svc.lab).agent.repair_rounds
        feedback: Feedback | None = None
        attempts: list[str] = []
        files: dict[str, str] | None = None
        last: EditRejected | None = None
        for attempt in range(rounds + 1):
            edits: list[FileEdit] = []
            try:
                if attempt == 0 and h.plan:
                    edits = [FileEdit.from_dict(d) for d in h.plan]
                else:
                    edits = svc.policy.implement(ctx, h, feedback)
                candidate = ws.apply(base, edits)
                tree = ws.tree_of(base, candidate)
                ws.check_tree(base, tree)
                check_not_measured(svc, h, tree)
                self._smoke(base, candidate, str(h.id))
                files = candidate
                break
            except EditRejected as e:
                log.info("hypothesis %s: implementation rejected (%s): %s", h.id, e.kind, e)
                attempts.append(f"attempt {attempt + 1} ({e.kind}): {e}")
                last = e
                if not svc.policy.can_repair or e.kind in ("needs_llm", "duplicate"):
                    break
                feedback = Feedback(REPAIR_STAGE.get(e.kind, "paths"), str(e), attempt + 1, rounds, edits)
            except LLMUnavailable:
                raise  # infrastructure: the thread stays here and is resumed when the endpoint answers
            except LLMError as e:  # the LLM answered, but nothing usable (or the budget ran out): a reason
                return self._reject(h, _llm_failure_kind(e, "llm"), "; ".join([*attempts, f"{type(e).__name__}: {e}"]))
        if files is None:
            assert last is not None
            reason = str(last) if len(attempts) == 1 else f"{len(attempts)} attempts rejected: " + " | ".join(attempts)
            return self._reject(h, last.kind, reason)
        message = f"hyp {h.id}: {h.title}\n\n{h.rationale}\n\nExpected: {h.expected_effect}"
        commit = ws.commit_files(branch, base, files, message)
        ws.tag(f"exp/{h.id}", commit, experiment_message(h))
        return self._measuring(h, branch, base, commit)

    def _smoke(self, base: str, files: dict[str, str], hypothesis: str) -> None:
        """The candidate's whole pipeline on tiny data, sandboxed (booked under `hypothesis`);
        `EditRejected` if it fails."""
        svc = self.svc
        if not svc.smoke:
            return
        try:
            svc.experiment.smoke(base, files, stop=svc.stop, hypothesis=hypothesis)
        except MethodFailure as e:
            raise EditRejected("smoke_failed", str(e)) from None

    def _resume_tagged(self, h: Hypothesis) -> State | None:
        """Adopt the commit a previous pass tagged `exp/<id>` but did not live to record. A seeded
        branch's tag is the branch as seeded, not what is measured: it is adopted again
        (`_adopt_branch`: merged onto the current baseline when that moved, checked), so a crash
        between the tag and its record never leaves the unmerged commit to be measured and promoted."""
        ws = self.svc.workspace
        tagged = ws.tagged(f"exp/{h.id}")
        if tagged is None:
            return None
        commit, message = tagged
        if message.strip() != experiment_message(h).strip():
            return self._reject(h, "tag_conflict", f"tag exp/{h.id} already exists for another experiment "
                                                   f"({message.strip()!r}): was this lab run with another store?")
        if h.seed_branch:
            return self._adopt_branch(h, ws.baseline_head(), seeded=commit)
        branch, base = h.branch or f"hyp/{h.id}-{slugify(h.title)}", ws.repo.commit(commit).parents[0].hexsha
        try:
            ws.check_tree(base, commit)
        except EditRejected as e:
            return self._reject(h, e.kind, f"exp/{h.id}: {e}")
        ws.point_branch(branch, commit)
        return self._measuring(h, branch, base, commit)

    def _adopt_branch(self, h: Hypothesis, base: str, seeded: str | None = None) -> State:
        """A researcher's branch (or `seeded`, the commit its tag `exp/<id>` holds, on a resume) is
        measured as-is, after the same check of the paths it changes, against the baseline it
        contains. A branch made off an older baseline (the baseline moved since, as with several in
        flight) is first merged onto the current one, exactly as a re-base is
        (`Workspace.merge_onto`; its branch `hyp/<id>-<slug>`, the researcher's branch untouched),
        and the merge is checked as a tree (`Workspace.check_tree`): a comparison of the branch as
        made with the current baseline would count the promotions it lacks against it, and a win
        would promote a merge nobody measured. A conflict, or a merge that lands a change on a path
        the agent may not change, is a reject naming the paths."""
        ws, rec = self.svc.workspace, self.svc.records
        branch = h.seed_branch
        try:
            commit = seeded or ws.resolve(h.seed_branch)
            forks = ws.repo.merge_base(base, commit)
            if not forks:
                raise EditRejected("unrelated", f"branch {h.seed_branch} shares no history with the baseline")
            if not ws.check_tree(forks[0].hexsha, commit):
                raise EditRejected("empty", f"branch {h.seed_branch} changes nothing relative to the baseline")
            tagged = commit
            if not ws.repo.is_ancestor(base, commit):
                onto = ws.baseline_name(base)
                try:
                    commit = ws.merge_onto(base, commit, f"hyp {h.id}: branch {h.seed_branch} merged onto {onto}")
                except PromotionConflict as e:
                    raise EditRejected("conflict", f"branch {h.seed_branch} was made off an earlier baseline and "
                                                   f"does not merge onto {onto}: {e}") from None
                if ws.tree(commit) == ws.tree(base):
                    raise EditRejected("empty", f"branch {h.seed_branch} merged onto {onto} changes nothing: "
                                                "its change is in the baseline already")
                try:
                    ws.check_tree(base, commit)
                except EditRejected as e:
                    raise EditRejected(e.kind, f"branch {h.seed_branch} merged onto {onto}: {e}") from None
                branch = f"hyp/{h.id}-{slugify(h.title)}"
                rec.event("rebase", f"#{h.id}: branch {h.seed_branch} was made off an earlier baseline; "
                                    f"merged onto {onto} and measured against it")
            self._smoke(commit, {}, str(h.id))  # a syntax error costs a second here, not a look of failed runs
        except (EditRejected, UserError) as e:
            kind = e.kind if isinstance(e, EditRejected) else "unknown_branch"
            return self._reject(h, kind, str(e), branch=h.seed_branch, commit=None)
        if commit != tagged:
            ws.point_branch(branch, commit)
        ws.tag(f"exp/{h.id}", tagged, experiment_message(h))
        return self._measuring(h, branch, base, commit)



def experiment_message(h: Hypothesis) -> str:
    return f"experiment {h.id}: {h.title}"


def _llm_failure_kind(e: Exception, default: str) -> str:
    from agent.llm import BudgetExceeded

    return "budget" if isinstance(e, BudgetExceeded) else default


def check_not_measured(svc: Services, h: Hypothesis, tree: str) -> None:
    """Refuse code that was measured already: the tree of an earlier experiment or of a baseline
    (the same files, byte for byte, whatever the proposal's words). Repeating it would spend runs on
    a known answer; the history the policy reads says what that answer was."""
    ws = svc.workspace
    others = [o for o in svc.records.briefs() if o.id != h.id and o.commit]
    trees = ws.trees([o.commit for o in others if o.commit])  # one git call for a year's of them
    for other in others:
        if trees.get(other.commit or "") == tree:
            raise EditRejected("duplicate", f"the same code as #{other.id} ({other.title!r}, verdict "
                                            f"{other.verdict or other.status}): measured already")
    tags = ws.baseline_tags()
    commits = ws.tag_commits(tags)
    trees = ws.trees(list(commits.values()))
    for tag in tags:
        if trees.get(commits.get(tag, "")) == tree:
            raise EditRejected("duplicate", f"the same code as {tag}: measured already as a baseline")
