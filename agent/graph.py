"""One LangGraph graph per hypothesis: propose → implement → evaluate ⇄ decide → [promote] → summarize
→ [hold → promote → summarize]; promote → evaluate when a re-based hypothesis is measured again.

The graph is the hypothesis's one state machine: its thread (id = hypothesis id) is checkpointed
after every node and, after any stop, crash or `kill -9`, resumed from that checkpoint — never
started over. Its state is only the hypothesis id and a routing flag; every fact lives in the
store (`agent.records`, `pipeline.store`). A node's side effects are keyed (branch names, tags,
run keys, gate records per look) and each node first looks at what the store already says, so a
node that died half-way, before its checkpoint, is simply run again.

A thread waits in two places, both a LangGraph `interrupt()` kept in its checkpoint:
- `evaluate`, for the runs of a look (`{"kind": "look", "runs": [...]}`): the driver loop
  (`agent.loop`) executes runs for every hypothesis in flight and resumes the thread with
  `Command(resume="finished")` once they are all in;
- `hold`, for a human (`{"kind": "hold"}`): a held promotion (`--supervised`, or a result too
  good to be true); `review --approve/--reject` records the answer and the loop resumes the thread
  with `Command(resume="approve"|"reject")`.
Promotion happens in the `promote` node only, and only against the baseline the hypothesis was
measured with: one whose base moved meanwhile (several hypotheses in flight) is re-based there,
promote → evaluate, and measured again (`rebase`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, TypedDict

from agent.errors import LLMError, LLMOutputError, LLMUnavailable
from agent.policy import Choice, Context, Feedback, Policy
from agent.records import Decision, Hypothesis, Records
from agent.workspace import EditRejected, FileEdit, Workspace, slugify
from pipeline.experiment import Experiment
from pipeline.lab import BASELINE_BRANCH, Lab, glob_match

log = logging.getLogger("autoresearch.agent")


REPAIR_STAGE = {"compile_error": "compile", "smoke_failed": "smoke", "not_applying": "apply", "empty": "apply",
                "malformed": "apply"}


class State(TypedDict, total=False):
    hypothesis_id: int
    route: str  # "waiting" | "rejected" | "measure" | "done" | ""


LOOK, HOLD = "look", "hold"  # the kinds of a thread's interrupt: waiting for runs, or for a human


@dataclass
class Services:
    lab: Lab
    store: Any  # pipeline.store.Store
    records: Records
    workspace: Workspace
    policy: Policy
    supervised: bool = False
    smoke: bool = True
    stop: threading.Event | None = None  # set when the loop is asked to stop: long steps give up early
    experiment: Experiment | None = None  # the measurement API; made from lab and store if not given
    # the lab's progress chart: redrawn at every decision (None), or at most this often (and at each
    # promotion): `autoresearch run` sets it, where thousands of decisions an hour may come
    progress_every_s: float | None = None
    progress_drawn_at: float | None = None  # when this loop last drew it (time.monotonic)
    progress_stale: bool = False  # a decision since was left out of it (drawn when the loop stops)

    def __post_init__(self) -> None:
        if self.experiment is None:
            self.experiment = Experiment(self.lab, self.store)


# ----------------------------------------------------------------------------- context

def proposal_context(svc: Services) -> Context:
    """`build_context` and the directions tried so far, with what each banked (only a proposal reads
    them: grouping diffs every hypothesis once)."""
    from agent.directions import directions_lines, group_directions

    ctx = build_context(svc)
    try:  # advice, not evidence: a git or store hiccup here must not cost the proposal
        ctx.directions = directions_lines(group_directions(svc.workspace, svc.store, svc.records))
    except Exception:
        log.exception("directions for the proposal context")
    return ctx


def build_context(svc: Services) -> Context:
    lab, ws = svc.lab, svc.workspace
    base = ws.baseline_head()
    files = {}
    for path in ws.repo.git.ls_tree("-r", "--name-only", base).splitlines():
        if any(glob_match(path, g) for g in lab.config.lab.editable):
            files[path] = ws.read(base, path) or ""
    history = []
    tried_states = []
    baseline_states = []
    base_commits = set()
    for h in svc.records.all():
        if h.change:
            tried_states.append(h.change)
        if h.base_commit:
            base_commits.add(h.base_commit)
        if h.status in ("done", "held"):
            history.append({"id": h.id, "title": h.title, "status": h.status, "verdict": h.verdict,
                            "decision": h.decision, **_effect_summary(svc, h)})
    cfg = lab.config
    # every configuration a baseline ever had was measured too: going back to one is not a new idea
    if cfg.search_space:
        from agent.policy import CONFIG_FILE, config_values

        for commit in base_commits:
            text = ws.read(commit, CONFIG_FILE)
            if text is not None:
                try:
                    baseline_states.append(config_values(text, list(cfg.search_space)))
                except ValueError:  # an unparsable config at an old baseline says nothing about states
                    pass
    from agent import prompts
    from agent.summary import metric_line

    comments = [prompts.phrase("comment", id=c.hypothesis_id, action=c.action, text=c.text)
                for c in svc.records.comments() if c.text]
    tag = _baseline_tag(ws, base)
    return Context(
        lab_name=cfg.lab.name,
        program=(lab.root / cfg.lab.program).read_text() if (lab.root / cfg.lab.program).is_file() else "",
        metric=metric_line(cfg),
        tasks=lab.tasks(),
        editable=list(cfg.lab.editable),
        baseline=prompts.phrase("baseline", tag=tag or "autoresearch/baseline", commit=base[:10]),
        files=files,
        history=history,
        comments=comments,
        search_space=dict(cfg.search_space),
        tried_states=tried_states,
        baseline_states=baseline_states,
        key_costs=search_key_costs(lab),
        plateau=plateau_of(svc),
    )


def plateau_of(svc: Services) -> int | None:
    """How many measured hypotheses in a row went without a promotion, once that reaches
    `[agent] plateau_after`; else None."""
    n = svc.records.since_promotion()
    return n if n >= svc.lab.config.agent.plateau_after else None


def search_key_costs(lab: Lab) -> dict[str, int]:
    """For each `[search_space]` key: how many stages a change of it re-runs — the stages whose cache
    inputs cover config.toml (or its table), and everything downstream of them."""
    from agent.policy import CONFIG_FILE

    stages = lab.stages_in_order()
    out = {}
    for key in lab.config.search_space:
        section = key.split(".", 1)[0]
        dirty: set[str] = set()
        for st in stages:  # topological order: upstream first
            covers = any(glob_match(CONFIG_FILE, path) and table in ("", section)
                         for path, _, table in (i.partition("#") for i in st.inputs))
            if covers or any(n in dirty for n in st.needs):
                dirty.add(st.name)
        out[key] = len(dirty)
    return out


def _baseline_tag(ws: Workspace, commit: str) -> str | None:
    tags = [t.name for t in ws.repo.tags if t.name.startswith("baseline/") and t.commit.hexsha == commit]
    return tags[-1] if tags else None


def _effect_summary(svc: Services, h: Hypothesis) -> dict[str, Any]:
    """Mean raw Δ (challenger − baseline) and how many tasks improved, by the metric's direction."""
    g = svc.records.latest_verdict(h.id)
    if g is None:
        return {}
    deltas = [t.delta for t in g.tasks if t.delta is not None]
    if not deltas:
        return {}
    sign = 1.0 if g.higher_is_better else -1.0
    return {"mean_delta": f"{sum(deltas) / len(deltas):+.4f}",
            "improved": f"{sum(sign * d > 0 for d in deltas)}/{len(deltas)}"}


# ----------------------------------------------------------------------------- nodes

def allowed_decisions(verdict: str | None, look: int, looks: list[int], supervised: bool) -> list[Decision]:
    """The gate bounds the agent: no promotion without `improvement`, escalation only to a planned look."""
    later = [n for n in looks if n > look]
    if verdict == "improvement":
        return [Decision.HOLD if supervised else Decision.PROMOTE, Decision.ABANDON]
    if verdict == "escalate" and later:
        return [Decision.ESCALATE, Decision.ABANDON]
    return [Decision.ABANDON, Decision.REFINE]


class Nodes:
    def __init__(self, svc: Services):
        self.svc = svc

    # propose ----------------------------------------------------------------
    def propose(self, state: State) -> State:
        rec = self.svc.records
        h = rec.get(state["hypothesis_id"])
        if h.title:
            if h.status == "proposing":
                rec.update(h.id, status="implementing")
            return {"route": ""}
        try:
            # the endpoint down, refusing or over budget leaves the node: no answer is no hypothesis,
            # and the loop (which created this empty one) withdraws it and backs off
            p = self.svc.policy.propose(proposal_context(self.svc))
        except LLMOutputError as e:  # it answered, but nothing usable after the repair rounds: recorded
            rec.update(h.id, title="(no proposal)", status="summarizing", decision=Decision.REJECT,
                       reject_kind="propose", reject_reason=f"{type(e).__name__}: {e}")
            return {"route": "rejected"}
        if p is None:
            rec.update(h.id, title="(search space exhausted)", status="summarizing", decision=Decision.REJECT,
                       reject_kind="exhausted", reject_reason="the policy has no untried idea left",
                       base_commit=self.svc.workspace.baseline_head())
            return {"route": "rejected"}
        rec.update(h.id, title=p.title, rationale=p.rationale, expected_effect=p.expected_effect,
                   expected_tasks=p.expected_tasks, change=p.change, plan=p.plan, seed_text=p.notes or None,
                   origin=self.svc.policy.name, status="implementing")
        return {"route": ""}

    # implement --------------------------------------------------------------
    def implement(self, state: State) -> State:
        """Edits → checks → smoke run → one commit on `hyp/<id>-<slug>` and the tag `exp/<id>`.

        A hypothesis that carries edits (an offline proposal, a `seed --file` with edits) is tried
        with them first; a policy that can repair (the LLM) then gets each rejection fed back, up
        to `repair_rounds` times. Every rejected attempt is kept in the reason recorded.
        """
        svc, rec, ws = self.svc, self.svc.records, self.svc.workspace
        h = rec.get(state["hypothesis_id"])
        if h.status == "summarizing" or h.decision == Decision.REJECT:
            return {"route": "rejected"}
        if h.commit:
            return {"route": "measure"}
        resumed = self._resume_tagged(h)  # a crash between the commit and its record
        if resumed is not None:
            return resumed
        base = ws.baseline_head()
        if h.seed_branch:
            return self._adopt_branch(h, base)
        branch = h.branch or f"hyp/{h.id}-{slugify(h.title)}"
        ctx = build_context(svc)
        rounds = svc.lab.config.agent.repair_rounds
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
                check_not_measured(svc, h, ws.tree_of(base, candidate))
                self._smoke(base, candidate)
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
                rec.update(h.id, status="summarizing", decision=Decision.REJECT, reject_kind=_llm_failure_kind(e, "llm"),
                           reject_reason="; ".join([*attempts, f"{type(e).__name__}: {e}"]))
                return {"route": "rejected"}
        if files is None:
            assert last is not None
            reason = str(last) if len(attempts) == 1 else f"{len(attempts)} attempts rejected: " + " | ".join(attempts)
            rec.update(h.id, status="summarizing", decision=Decision.REJECT, reject_kind=last.kind, reject_reason=reason)
            return {"route": "rejected"}
        message = f"hyp {h.id}: {h.title}\n\n{h.rationale}\n\nExpected: {h.expected_effect}"
        commit = ws.commit_files(branch, base, files, message)
        ws.tag(f"exp/{h.id}", commit, experiment_message(h))
        rec.update(h.id, branch=branch, base_commit=base, commit=commit, status="measuring",
                   look=svc.lab.config.gate.looks[0])
        return {"route": "measure"}

    def _smoke(self, base: str, files: dict[str, str]) -> None:
        """The candidate's whole pipeline on tiny data, sandboxed; `EditRejected` if it fails."""
        svc = self.svc
        if not svc.smoke:
            return
        from pipeline.smoke import SmokeFailed

        try:
            svc.experiment.smoke(base, files, stop=svc.stop)
        except SmokeFailed as e:
            raise EditRejected("smoke_failed", str(e)) from None

    def _resume_tagged(self, h: Hypothesis) -> State | None:
        """Adopt the commit a previous pass tagged `exp/<id>` but did not live to record."""
        ws = self.svc.workspace
        tagged = ws.tagged(f"exp/{h.id}")
        if tagged is None:
            return None
        commit, message = tagged
        if message.strip() != experiment_message(h).strip():
            self.svc.records.update(
                h.id, status="summarizing", decision=Decision.REJECT, reject_kind="tag_conflict",
                reject_reason=f"tag exp/{h.id} already exists for another experiment ({message.strip()!r}): "
                              "was this lab run with another store?")
            return {"route": "rejected"}
        if h.seed_branch:
            branch, base = h.seed_branch, ws.baseline_head()
        else:
            branch, base = h.branch or f"hyp/{h.id}-{slugify(h.title)}", ws.repo.commit(commit).parents[0].hexsha
            ws.point_branch(branch, commit)
        self.svc.records.update(h.id, branch=branch, base_commit=base, commit=commit, status="measuring",
                                look=self.svc.lab.config.gate.looks[0])
        return {"route": "measure"}

    def _adopt_branch(self, h: Hypothesis, base: str) -> State:
        """A researcher's branch is measured as-is, after the same editable-path check, against the
        baseline it contains. A branch made off an older baseline (the baseline moved since, as with
        several in flight) is first merged onto the current one, exactly as a re-base is
        (`Workspace.merge_onto`; its branch `hyp/<id>-<slug>`, the researcher's branch untouched): a
        comparison of the branch as made with the current baseline would count the promotions it
        lacks against it, and a win would promote a merge nobody measured. A conflict is a reject
        naming the paths."""
        from agent.workspace import PromotionConflict, check_path
        from pipeline.errors import UserError

        ws, rec = self.svc.workspace, self.svc.records
        branch = h.seed_branch
        try:
            commit = ws.resolve(h.seed_branch)
            forks = ws.repo.merge_base(base, commit)
            if not forks:
                raise EditRejected("unrelated", f"branch {h.seed_branch} shares no history with the baseline")
            changed = ws.changed_paths(forks[0].hexsha, commit)
            if not changed:
                raise EditRejected("empty", f"branch {h.seed_branch} changes nothing relative to the baseline")
            for path in changed:
                check_path(self.svc.lab, path)
            tagged = commit
            if not ws.repo.is_ancestor(base, commit):
                onto = _baseline_tag(ws, base) or f"{BASELINE_BRANCH}@{base[:10]}"
                try:
                    commit = ws.merge_onto(base, commit, f"hyp {h.id}: branch {h.seed_branch} merged onto {onto}")
                except PromotionConflict as e:
                    raise EditRejected("conflict", f"branch {h.seed_branch} was made off an earlier baseline and "
                                                   f"does not merge onto {onto}: {e}") from None
                if ws.tree(commit) == ws.tree(base):
                    raise EditRejected("empty", f"branch {h.seed_branch} merged onto {onto} changes nothing: "
                                                "its change is in the baseline already")
                branch = f"hyp/{h.id}-{slugify(h.title)}"
                rec.event("rebase", f"#{h.id}: branch {h.seed_branch} was made off an earlier baseline; "
                                    f"merged onto {onto} and measured against it")
            self._smoke(commit, {})  # a syntax error costs a second here, not a look of failed runs
        except (EditRejected, UserError) as e:
            kind = e.kind if isinstance(e, EditRejected) else "unknown_branch"
            rec.update(h.id, status="summarizing", decision=Decision.REJECT, reject_kind=kind, reject_reason=str(e),
                       branch=h.seed_branch, commit=None)
            return {"route": "rejected"}
        if commit != tagged:
            ws.point_branch(branch, commit)
        ws.tag(f"exp/{h.id}", tagged, experiment_message(h))
        rec.update(h.id, branch=branch, base_commit=base, commit=commit, status="measuring",
                   look=self.svc.lab.config.gate.looks[0])
        return {"route": "measure"}

    # evaluate ---------------------------------------------------------------
    def evaluate(self, state: State) -> State:
        svc, rec = self.svc, self.svc.records
        h = rec.get(state["hypothesis_id"])
        if h.status != "measuring":
            return {"route": "measure" if h.status in ("deciding", "promoting", "held") else ""}
        ids = queue_look(svc, h)
        if not svc.experiment.finished(ids):
            from langgraph.types import interrupt

            # the thread pauses here, in its checkpoint, until the loop resumes it with the runs in;
            # resumed early, it waits again (a fresh pass of this node)
            interrupt({"kind": LOOK, "hypothesis_id": h.id, "look": h.look, "runs": ids})
            return {"route": "waiting"}
        result = svc.experiment.judge_look(h.base_commit, h.commit, h.look)
        svc.store.put_gate_record(str(h.id), h.look, result)
        rec.update(h.id, verdict=result.verdict or "inconclusive", status="deciding")
        return {"route": "measure"}

    # decide -----------------------------------------------------------------
    def decide(self, state: State) -> State:
        svc, rec = self.svc, self.svc.records
        h = rec.get(state["hypothesis_id"])
        if h.status in ("measuring", "promoting"):  # work of a later node, after a restart
            return {"route": {"measuring": "measure", "promoting": "promote"}[h.status]}
        if h.status == "held":  # to its summary, which leads to the hold
            return {"route": "done"}
        if h.status != "deciding":
            return {"route": "done"}
        looks = svc.lab.config.gate.looks
        allowed = allowed_decisions(h.verdict, h.look, looks, svc.supervised)
        too_good = self._too_good(h)
        if too_good:  # never promoted automatically, whatever --supervised says
            allowed = [Decision.HOLD]
        choice = self._choice(h, allowed)
        if too_good and choice.decision == Decision.HOLD:
            choice.rationale = f"Held for human review: {too_good}. {choice.rationale}"
        if choice.decision == Decision.ESCALATE:
            nxt = min(n for n in looks if n > h.look)
            rec.update(h.id, look=nxt, status="measuring", decision=Decision.ESCALATE,
                       rationale_decision=rebased_note(svc, h) + choice.rationale)
            return {"route": "measure"}
        rationale = rebased_note(svc, h) + choice.rationale
        fields: dict[str, Any] = {"decision": choice.decision, "rationale_decision": rationale,
                                  "follow_up": choice.follow_up or None, "status": "summarizing"}
        route = "done"
        if choice.decision == Decision.PROMOTE:
            fields["status"], route = "promoting", "promote"
        elif choice.decision == Decision.HOLD:  # summarized first, then the hold node waits for a human
            fields |= {"status": "held", "review": "pending"}
        elif choice.decision == Decision.REFINE and choice.follow_up:
            queue_refinement(svc, h, choice.follow_up)
        rec.update(h.id, **fields)
        return {"route": route}

    # hold -------------------------------------------------------------------
    def hold(self, state: State) -> State:
        """A held promotion (`--supervised`, or too good to be true) waits here, as a LangGraph
        interrupt in the thread's checkpoint, until `review --approve/--reject` resumes it."""
        from langgraph.types import interrupt

        rec = self.svc.records
        h = rec.get(state["hypothesis_id"])
        if h.status != "held":
            return {"route": "promote" if h.status == "promoting" else ""}
        answer = interrupt({"kind": HOLD, "hypothesis_id": h.id, "reason": h.rationale_decision or ""})
        if answer == "approve":
            rec.update(h.id, status="promoting", decision=Decision.PROMOTE)
            return {"route": "promote"}
        rec.update(h.id, status="summarizing", decision=Decision.ABANDON)
        return {"route": ""}

    # promote ----------------------------------------------------------------
    def promote(self, state: State) -> State:
        """The one place a hypothesis becomes the baseline (idempotent: a re-run finds it merged).

        Every promote decision is carried out here, the decide node's and an approved hold's, so
        this is where its base is checked: a hypothesis whose base moved since it was measured is
        re-based (`rebase`) and goes back to `evaluate`, to be measured against the current baseline
        from its first look; only a hypothesis compared with the current head is promoted, and that
        is a fast-forward. Promotions are one at a time: one driver per lab (its lease), and the
        driver advances its threads one after another in its own thread (`graph.invoke` returns only
        when a thread stops), so no two promote nodes run at once; `Workspace.promote` moves the
        baseline branch only from the head it read (`git update-ref NEW OLD`) besides."""
        rec = self.svc.records
        h = rec.get(state["hypothesis_id"])
        if h.status == "measuring":  # re-based by a pass of this node that died before its checkpoint
            return {"route": "measure"}
        if h.status != "promoting":
            return {"route": ""}
        if base_moved(self.svc, h):
            return rebase(self.svc, h)
        rec.update(h.id, **{"status": "summarizing", **promote(self.svc, h)})
        return {"route": ""}

    def _too_good(self, h: Hypothesis) -> str | None:
        if h.verdict != "improvement":
            return None
        from pipeline.gate.plausibility import implausible

        return implausible(self.svc.records.latest_verdict(h.id), self.svc.lab.config)

    def _choice(self, h: Hypothesis, allowed: list[str]) -> Choice:
        """The policy's choice at this look, within `allowed`; stored before any side effect, so a
        re-run after a crash carries out the same decision instead of asking again."""
        svc = self.svc
        done = svc.records.decision_at(h.id, h.look)
        if done is not None and done.decision in allowed:  # an unknown decision string is in no allowed list
            return Choice(done.decision, done.rationale, done.follow_up)
        from pipeline.gate import render_markdown

        from agent import prompts
        from agent.verdicts import DecisionRecord, put_decision

        looks = svc.lab.config.gate.looks
        evidence = render_markdown(svc.records.latest_verdict(h.id))
        look_text = prompts.phrase("look", index=looks.index(h.look) + 1 if h.look in looks else "?",
                                   count=len(looks), runs=h.look)
        try:
            choice = svc.policy.decide(build_context(svc), h, h.verdict, evidence, allowed, look_text)
        except LLMError as e:  # no answer (budget, endpoint down, no valid JSON): follow the gate
            from agent.policy import OfflinePolicy

            choice = OfflinePolicy().decide(build_context(svc), h, h.verdict, evidence, allowed, look_text)
            choice.rationale = f"No decision from the policy ({type(e).__name__}: {e}). {choice.rationale}"
        if choice.decision not in allowed:
            choice = Choice(Decision.ABANDON if Decision.ABANDON in allowed else allowed[-1],
                            f"the policy chose {choice.decision!r}, which the verdict {h.verdict} does not allow")
        put_decision(svc.store, h.id, DecisionRecord(h.look, choice.decision, choice.rationale, choice.follow_up,
                                                     list(allowed), h.verdict, svc.policy.name))
        return choice

    # summarize --------------------------------------------------------------
    def summarize(self, state: State) -> State:
        from agent.summary import write_summary

        svc, rec = self.svc, self.svc.records
        h = rec.get(state["hypothesis_id"])
        if h.status == "held":  # the summary a reviewer reads before approving
            write_summary(svc, h)
            return {"route": "hold"}
        if h.status != "summarizing":
            return {"route": "done"}
        # every summary waits for a human read; approvals and comments steer the agent
        h = rec.update(h.id, review="pending" if h.review == "none" else h.review)
        write_summary(svc, h)
        rec.update(h.id, status="done", finished_at=time.time())
        if h.commit and not h.promoted_tag:  # a champion's worktree serves its baseline runs
            svc.experiment.release(h.commit)
        return {"route": "done"}


def experiment_message(h: Hypothesis) -> str:
    return f"experiment {h.id}: {h.title}"


def _llm_failure_kind(e: Exception, default: str) -> str:
    from agent.llm import BudgetExceeded

    return "budget" if isinstance(e, BudgetExceeded) else default


def queue_refinement(svc: Services, h: Hypothesis, follow_up: str) -> Hypothesis:
    """The child hypothesis a `refine` decision asks for, once (a re-run finds it queued)."""
    for child in svc.records.all():
        if child.parent_id == h.id:
            return child
    first = follow_up.strip().splitlines()[0].lstrip("# ").strip()
    return svc.records.add(Hypothesis(
        title=first[:120], seed_text=follow_up.strip(), parent_id=h.id, origin=svc.policy.name, priority=h.priority,
        rationale=f"Refines #{h.id} ({h.title}), verdict {h.verdict}: {follow_up.strip()}",
        expected_effect=h.expected_effect, expected_tasks=list(h.expected_tasks or []), status="queued"))


def promote(svc: Services, h: Hypothesis) -> dict[str, Any]:
    """Merge into the baseline, tag `baseline/vN`, and queue the new champion's own runs."""
    from agent.workspace import PromotionConflict

    try:
        new, tag = svc.workspace.promote(h.commit, f"promote hyp {h.id}: {h.title}")
    except PromotionConflict as e:
        return {"decision": Decision.ABANDON, "rationale_decision": f"promotion refused: {e}"}
    svc.experiment.queue_champion(new, tag)
    return {"promoted_tag": tag}


def base_moved(svc: Services, h: Hypothesis) -> bool:
    """Whether the baseline moved since the hypothesis was measured against `base_commit` (not a
    re-run of a promotion that already landed: then its commit is in the baseline's history)."""
    ws = svc.workspace
    head = ws.baseline_head()
    return bool(h.base_commit and h.commit) and h.base_commit != head and not ws.repo.is_ancestor(h.commit, head)


def rebase(svc: Services, h: Hypothesis) -> State:
    """A hypothesis about to be promoted whose base moved: its commit merged onto the current
    baseline head (no working tree, as promotion does), measured again from its first look.

    A conflict, or a merge that leaves the baseline as it is, is an `abandon` with the reason and
    nothing written but unreferenced objects. Otherwise the merge (deterministic for the same head
    and commit) becomes the hypothesis's commit and its branch moves there (a seeded branch is left
    alone: `hyp/<id>-<slug>` is made); the old commit stays in the merge's history and under its
    tag `exp/<id>`. The earlier comparison's gate records are moved aside, to the key
    `<id>@<old base>`, so no verdict or decision against the old base can promote it: the policy's
    evidence and the gate's looks start over against the new base, on its generation's seed block.
    A record `rebase` (and a loop event) says from where to where, and what the old base's verdict
    was. Each step is idempotent; the hypothesis's row changes last."""
    from agent.verdicts import rebases
    from agent.workspace import PromotionConflict

    ws, rec, store = svc.workspace, svc.records, svc.store
    head = ws.baseline_head()
    old_base, old_commit = h.base_commit or "", h.commit or ""
    frm = _baseline_tag(ws, old_base) or f"{BASELINE_BRANCH}@{old_base[:10]}"
    onto = _baseline_tag(ws, head) or f"{BASELINE_BRANCH}@{head[:10]}"
    earlier = f"its verdict {h.verdict} at look {h.look} against {frm}"
    payload: dict[str, Any] = {"from_base": old_base, "from_commit": old_commit, "from_tag": frm, "to_base": head,
                               "to_tag": onto, "verdict": h.verdict, "look": h.look,
                               "archived_as": f"{h.id}@{old_base[:12]}"}
    new, why = None, ""
    try:
        new = ws.merge_onto(head, old_commit, f"hyp {h.id} re-based onto {onto}: {h.title}")
        if ws.tree(new) == ws.tree(head):
            why = f"merged onto {onto} it changes nothing: its change is in the baseline already"
    except PromotionConflict as e:
        why = str(e)
    done = rebases(store, h.id)
    if not any(r.get("to_base") == head and r.get("from_commit") == old_commit for r in done):
        store.put_gate_record(str(h.id), len(done) + 1, {**payload, "commit": None if why else new,
                                                         "outcome": why or "re-measured"}, kind="rebase")
        said = (f"#{h.id} re-based from {frm} onto {onto}: " +
                (f"abandoned, {why}" if why else f"{earlier} does not count; measured again against {onto}"))
        rec.event("rebase", said)
    if why:
        rec.update(h.id, status="summarizing", decision=Decision.ABANDON,
                   rationale_decision=f"Re-based from {frm} onto {onto} before its promotion ({earlier}): {why}. "
                                      f"Abandoned: never measured against {onto}.")
        return {"route": ""}
    assert new is not None
    branch = h.branch if h.branch and h.branch != h.seed_branch else f"hyp/{h.id}-{slugify(h.title)}"
    if branch == h.seed_branch:
        branch = f"hyp/{h.id}-rebased"
    ws.point_branch(branch, new)
    store.move_gate_records(str(h.id), payload["archived_as"], ("verdict", "decision"))
    rec.update(h.id, commit=new, base_commit=head, branch=branch, look=svc.lab.config.gate.looks[0], verdict=None,
               decision=None, follow_up=None, review="none", status="measuring",
               rationale_decision=f"Re-based from {frm} onto {onto} before its promotion: {earlier} does not "
                                  f"count; measured again against {onto}.")
    if old_commit != new:
        svc.experiment.release(old_commit)
    return {"route": "measure"}


def rebased_note(svc: Services, h: Hypothesis) -> str:
    """'Re-based from A0 onto A1 (...)' before a re-based hypothesis's decision rationale; '' if it never was."""
    from agent.verdicts import rebases

    recs = [r for r in rebases(svc.store, h.id) if r.get("commit")]
    if not recs:
        return ""
    last = recs[-1]
    return (f"Re-based from {last['from_tag']} onto {last['to_tag']} before its promotion (its verdict "
            f"{last['verdict']} at look {last['look']} against {last['from_tag']} does not count); "
            f"against {last['to_tag']}: ")


def reverification(svc: Services, h: Hypothesis) -> dict[str, Any] | None:
    """How the champion of a promotion held up on its fresh baseline seeds (None until they are in)."""
    return svc.experiment.reverification(h.promoted_tag, h.commit, h.base_commit, h.look or 0)


def check_not_measured(svc: Services, h: Hypothesis, tree: str) -> None:
    """Refuse code that was measured already: the tree of an earlier experiment or of a baseline
    (the same files, byte for byte, whatever the proposal's words). Repeating it would spend runs on
    a known answer; the history the policy reads says what that answer was."""
    ws = svc.workspace
    for other in svc.records.all():
        if other.id != h.id and other.commit and ws.tree(other.commit) == tree:
            raise EditRejected("duplicate", f"the same code as #{other.id} ({other.title!r}, verdict "
                                            f"{other.verdict or other.status}): measured already")
    for tag in ws.baseline_tags():
        if ws.tree(tag) == tree:
            raise EditRejected("duplicate", f"the same code as {tag}: measured already as a baseline")


def queue_rank(h: Hypothesis) -> int:
    """Where a hypothesis's runs go in the queue among looks equally deep (0-99, higher first): a
    human seed before the policy's proposals, then by the seed's priority."""
    return min(99, (50 if h.origin == "human" else 0) + min(max(h.priority, 0), 49))


def queue_look(svc: Services, h: Hypothesis) -> list[int]:
    """Queue (idempotently) the runs of the hypothesis's current look: the baseline's and its own."""
    return svc.experiment.queue_look(h.base_commit, h.commit, h.look or 0, label=h.branch, rank=queue_rank(h))


# ----------------------------------------------------------------------------- graph

def build_graph(svc: Services, checkpointer: Any):
    from langgraph.graph import END, START, StateGraph

    nodes = Nodes(svc)
    g = StateGraph(State)
    g.add_node("propose", nodes.propose)
    g.add_node("implement", nodes.implement)
    g.add_node("evaluate", nodes.evaluate)
    g.add_node("decide", nodes.decide)
    g.add_node("promote", nodes.promote)
    g.add_node("summarize", nodes.summarize)
    g.add_node("hold", nodes.hold)
    g.add_edge(START, "propose")
    g.add_conditional_edges("propose", lambda s: "summarize" if s.get("route") == "rejected" else "implement",
                            ["summarize", "implement"])
    g.add_conditional_edges("implement", lambda s: "summarize" if s.get("route") == "rejected" else "evaluate",
                            ["summarize", "evaluate"])
    g.add_conditional_edges("evaluate", lambda s: "evaluate" if s.get("route") == "waiting" else "decide",
                            ["decide", "evaluate"])
    after_decide = {"measure": "evaluate", "promote": "promote", "hold": "hold"}
    g.add_conditional_edges("decide", lambda s: after_decide.get(s.get("route") or "", "summarize"),
                            ["evaluate", "promote", "hold", "summarize"])
    g.add_conditional_edges("promote", lambda s: "evaluate" if s.get("route") == "measure" else "summarize",
                            ["evaluate", "summarize"])  # a re-based hypothesis is measured again
    g.add_conditional_edges("summarize", lambda s: "hold" if s.get("route") == "hold" else END, ["hold", END])
    g.add_conditional_edges("hold", lambda s: "promote" if s.get("route") == "promote" else "summarize",
                            ["promote", "summarize"])
    return g.compile(checkpointer=checkpointer)


CHECKPOINT_SETUP_LOCK = 7_272_742  # a PostgreSQL advisory lock: one process at a time sets the saver up


def open_checkpointer(svc: Services):
    """SQLite beside the store by default; the Postgres saver when the store is PostgreSQL."""
    url = svc.store.url
    if url.startswith("postgresql"):
        import psycopg
        from langgraph.checkpoint.postgres import PostgresSaver

        conn = psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True,
                               prepare_threshold=0)
        saver = PostgresSaver(conn)
        conn.execute("SELECT pg_advisory_lock(%s)", (CHECKPOINT_SETUP_LOCK,))  # drivers starting together
        try:
            saver.setup()
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (CHECKPOINT_SETUP_LOCK,))
        return saver
    import sqlite3

    from langgraph.checkpoint.sqlite import SqliteSaver

    path = svc.lab.state / "checkpoints.sqlite"
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(str(path), check_same_thread=False, timeout=30)
    conn.execute("PRAGMA journal_mode=WAL")
    return SqliteSaver(conn)
