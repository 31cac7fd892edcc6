"""One LangGraph graph per hypothesis: propose → implement → evaluate ⇄ decide → [promote] → summarize
→ [reverify]; decide → summarize → hold → promote (a held promotion); promote → evaluate when a
re-based hypothesis is measured again.

The graph is the hypothesis's one state machine. Its state carries the lifecycle: `phase` (a
`Status`), `look` and `verdict`, and the champion a promotion made until it is re-verified. Each
node does one step and returns the state's update through `Nodes._to`, which projects it onto the
hypothesis's row in the same step (`agent.lifecycle.project`, the one writer of `status`); where
the thread goes next is the named routers' (`GraphSpec`), from the state alone. The thread (id =
hypothesis id) is checkpointed after every node and, after any stop, crash or `kill -9`, resumed
from that checkpoint — never started over. The facts of a step (branches, tags, runs, gate
records, the summary) live in the store and git, keyed, and come before the projection: a node that
died half-way is simply run again, and one that died after its projection (the row a step ahead of
the checkpoint) takes the row's update without doing its step twice (`_replayed`).

A thread waits in three places, each a LangGraph `interrupt()` kept in its checkpoint:
- `evaluate`, for the runs of a look (`{"kind": "look", "runs": [...]}`): the driver loop
  (`agent.loop`) executes runs for every hypothesis in flight and resumes the thread with
  `Command(resume="finished")` once they are all in;
- `hold`, for a human (`{"kind": "hold"}`): a held promotion (`--supervised`, or a result too
  good to be true); `review --approve/--reject` records the answer and the loop resumes the thread
  with `Command(resume="approve"|"reject")`;
- `reverify`, after a promotion's summary, for the new champion's runs on fresh seeds
  (`{"kind": "look", "champion": tag, "runs": [...]}`); the thread ends when how it held up is
  recorded. The hypothesis is `done` (decided) while its thread waits there.
Promotion happens in the `promote` node only, and only against the baseline the hypothesis was
measured with: one whose base moved meanwhile (several hypotheses in flight) is re-based there,
promote → evaluate, and measured again (`rebase`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TypedDict

from agent.errors import LLMError, LLMOutputError, LLMUnavailable
from agent.policy import Choice, Context, Feedback, Policy
from agent.lifecycle import Status, project
from agent.records import Decision, Hypothesis, Records
from agent.workspace import EditRejected, FileEdit, Workspace, slugify
from pipeline.api import Experiment, Lab, BASELINE_BRANCH, glob_match

log = logging.getLogger("autoresearch.agent")


REPAIR_STAGE = {"compile_error": "compile", "smoke_failed": "smoke", "not_applying": "apply", "empty": "apply",
                "malformed": "apply"}


class State(TypedDict, total=False):
    """A thread's state: the hypothesis, and where it is in its lifecycle. The graph routes on
    `phase` alone (the named routers below); `agent.lifecycle.project` writes the same step onto the
    hypothesis's row (`status`, `look`, `verdict`), which is what the rest of the tool reads."""
    hypothesis_id: int
    phase: str  # an `agent.lifecycle.Status` value
    look: int | None  # challenger runs wanted at the current look
    verdict: str | None  # the gate's verdict at the last look judged
    champion: str | None  # the baseline tag a promotion made, until its re-verification is recorded


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
    painter: Any = None  # agent.pictures.Painter: the loop draws its pictures in a process of its own
    effects: dict[int, dict[str, Any]] = field(default_factory=dict)  # `build_context`'s, of done hypotheses

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
    briefs = svc.records.briefs()
    effects = _effect_summaries(svc, [h for h in briefs if h.status in ("done", "held")])
    for h in briefs:
        if h.change:
            tried_states.append(h.change)
        if h.base_commit:
            base_commits.add(h.base_commit)
        if h.status in ("done", "held"):
            history.append({"id": h.id, "title": h.title, "status": h.status, "verdict": h.verdict,
                            "decision": h.decision, **effects.get(h.id, {})})
    cfg = lab.config
    # every configuration a baseline ever had was measured too: going back to one is not a new idea
    if cfg.search_space:
        from agent.policy_offline import CONFIG_FILE, config_values

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
    tag = ws.baseline_tag(base)
    return Context(
        lab_name=cfg.lab.name,
        program=(lab.root / cfg.lab.program).read_text() if (lab.root / cfg.lab.program).is_file() else "",
        metric=metric_line(cfg),
        tasks=lab.tasks(),
        editable=list(cfg.lab.editable),
        baseline=prompts.phrase("baseline", tag=tag or BASELINE_BRANCH, commit=base[:10]),
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
    from agent.policy_offline import CONFIG_FILE

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


def _effect_summaries(svc: Services, hs: list[Any]) -> dict[int, dict[str, Any]]:
    """`_effect_summary` of each of `hs` (decided hypotheses). A `done` one's is final, and kept
    (`Services.effects`): a context is built at every decision, and reading every verdict each time
    cost the loop more, at a few hundred hypotheses, than everything else it did. The ones not kept
    are read in one query when there are many (a loop starting on a long history)."""
    from agent.verdicts import VERDICT

    from pipeline.api import GateResult

    out, missing = {}, []
    for h in hs:
        if h.id in svc.effects:
            out[h.id] = svc.effects[h.id]
        else:
            missing.append(h)
    if len(missing) > 8:
        recs = svc.store.latest_gate_records(VERDICT)
        verdicts = {h.id: GateResult.from_dict(recs[str(h.id)].payload) if str(h.id) in recs else None
                    for h in missing}
    else:
        verdicts = {h.id: svc.records.latest_verdict(h.id) for h in missing}
    for h in missing:
        out[h.id] = _effect_summary(verdicts[h.id])
        if h.status == Status.DONE:
            svc.effects[h.id] = out[h.id]
    return out


def _effect_summary(g: Any) -> dict[str, Any]:
    """Mean raw Δ (challenger − baseline) of a verdict (`GateResult`, or None) and how many tasks
    improved, by the metric's direction."""
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


KEEP: Any = object()  # `Nodes._to`: leave the look or the verdict as it is


def phase_of(state: State, h: Hypothesis) -> str:
    """Where the thread is: its state's phase; for a thread checkpointed by a version before the
    phase was in the state (or a node called alone, as tests do), the row's status."""
    return state.get("phase") or h.status


class Nodes:
    """The graph's nodes. Each reads where its thread is from the state (`phase_of`), does its one
    step (its side effects keyed, so a node that died half-way is simply run again), and returns
    the state's update from `_to`, which projects it onto the hypothesis's row in the same step.
    Where the thread goes next is the routers' (`graph_spec`), never a node's."""

    def __init__(self, svc: Services):
        self.svc = svc

    def _to(self, h: Hypothesis, phase: Status, *, look: Any = KEEP, verdict: Any = KEEP, **fields: Any) -> State:
        """The state's update for entering `phase` (with a new look or verdict), and its projection
        onto the row with `fields` (`agent.lifecycle.project`, the one writer of `status`)."""
        update: State = {"phase": phase.value}
        if look is not KEEP:
            update["look"] = look
        if verdict is not KEEP:  # a plain string in the checkpoint (the gate's `Verdict` is an enum)
            update["verdict"] = getattr(verdict, "value", verdict)
        project(self.svc.records, h.id, dict(update), **fields)
        return update

    def _reject(self, h: Hypothesis, kind: str, reason: str, **fields: Any) -> State:
        """Refused before any run: summarized, with the kind and the reason."""
        return self._to(h, Status.SUMMARIZING, decision=Decision.REJECT, reject_kind=kind, reject_reason=reason,
                        **fields)

    def _measuring(self, h: Hypothesis, branch: str, base: str, commit: str) -> State:
        """Committed and tagged: measured from the first look."""
        return self._to(h, Status.MEASURING, look=self.svc.lab.config.gate.looks[0], branch=branch,
                        base_commit=base, commit=commit)

    # propose ----------------------------------------------------------------
    def propose(self, state: State) -> State:
        rec = self.svc.records
        h = rec.get(state["hypothesis_id"])
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
                tree = ws.tree_of(base, candidate)
                ws.check_tree(base, tree)
                check_not_measured(svc, h, tree)
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
                return self._reject(h, _llm_failure_kind(e, "llm"), "; ".join([*attempts, f"{type(e).__name__}: {e}"]))
        if files is None:
            assert last is not None
            reason = str(last) if len(attempts) == 1 else f"{len(attempts)} attempts rejected: " + " | ".join(attempts)
            return self._reject(h, last.kind, reason)
        message = f"hyp {h.id}: {h.title}\n\n{h.rationale}\n\nExpected: {h.expected_effect}"
        commit = ws.commit_files(branch, base, files, message)
        ws.tag(f"exp/{h.id}", commit, experiment_message(h))
        return self._measuring(h, branch, base, commit)

    def _smoke(self, base: str, files: dict[str, str]) -> None:
        """The candidate's whole pipeline on tiny data, sandboxed; `EditRejected` if it fails."""
        svc = self.svc
        if not svc.smoke:
            return
        from pipeline.api import SmokeFailed

        try:
            svc.experiment.smoke(base, files, stop=svc.stop)
        except SmokeFailed as e:
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
        from agent.workspace import PromotionConflict
        from pipeline.api import UserError

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
            self._smoke(commit, {})  # a syntax error costs a second here, not a look of failed runs
        except (EditRejected, UserError) as e:
            kind = e.kind if isinstance(e, EditRejected) else "unknown_branch"
            return self._reject(h, kind, str(e), branch=h.seed_branch, commit=None)
        if commit != tagged:
            ws.point_branch(branch, commit)
        ws.tag(f"exp/{h.id}", tagged, experiment_message(h))
        return self._measuring(h, branch, base, commit)

    # evaluate ---------------------------------------------------------------
    def evaluate(self, state: State) -> State:
        """The look's runs queued (idempotently); the thread waits for them in an interrupt, and is
        then judged by the gate (one record per look)."""
        svc = self.svc
        h = svc.records.get(state["hypothesis_id"])
        look = state.get("look") or h.look or svc.lab.config.gate.looks[0]
        ids = queue_look(svc, h, look)
        if not svc.experiment.finished(ids):
            from langgraph.types import interrupt

            # the thread pauses here, in its checkpoint, until the loop resumes it with the runs in;
            # resumed early, it waits again (a fresh pass of this node: the phase stays `measuring`)
            interrupt({"kind": LOOK, "hypothesis_id": h.id, "look": look, "runs": ids})
            return {}
        result = svc.experiment.judge_look(h.base_commit, h.commit, look, record_as=str(h.id))
        return self._to(h, Status.DECIDING, look=look, verdict=result.verdict or "inconclusive")

    # decide -----------------------------------------------------------------
    def decide(self, state: State) -> State:
        """The policy's choice within what the verdict allows: escalate (→ evaluate the next look),
        promote (→ promote), hold (→ summarize, then wait for a human), abandon or refine (→ summarize)."""
        svc = self.svc
        h = svc.records.get(state["hypothesis_id"])
        look = state.get("look") or h.look or 0
        verdict = state.get("verdict", h.verdict)
        looks = svc.lab.config.gate.looks
        allowed = allowed_decisions(verdict, look, looks, svc.supervised)
        too_good = self._too_good(h, verdict)
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
        if choice.decision == Decision.PROMOTE:
            return self._to(h, Status.PROMOTING, **fields)
        if choice.decision == Decision.HOLD:  # summarized first, then the hold node waits for a human
            return self._to(h, Status.HELD, review="pending", **fields)
        if choice.decision == Decision.REFINE and choice.follow_up:
            queue_refinement(svc, h, choice.follow_up)
        return self._to(h, Status.SUMMARIZING, **fields)

    # hold -------------------------------------------------------------------
    def hold(self, state: State) -> State:
        """A held promotion (`--supervised`, or too good to be true) waits here, as a LangGraph
        interrupt in the thread's checkpoint, until `review --approve/--reject` resumes it."""
        from langgraph.types import interrupt

        h = self.svc.records.get(state["hypothesis_id"])
        if not h.summary_md:  # the reviewer reads a summary, whatever path led here (summarize writes it)
            from agent.summary import write_summary

            write_summary(self.svc, h)
        answer = interrupt({"kind": HOLD, "hypothesis_id": h.id, "reason": h.rationale_decision or ""})
        if answer == "approve":
            return self._to(h, Status.PROMOTING, decision=Decision.PROMOTE)
        return self._to(h, Status.SUMMARIZING, decision=Decision.ABANDON)

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
        h = self.svc.records.get(state["hypothesis_id"])
        if h.promoted_tag:  # promoted by a pass that died before its checkpoint
            return {**self._to(h, Status.SUMMARIZING), "champion": h.promoted_tag}
        if base_moved(self.svc, h):
            update, fields = rebase(self.svc, h)
            return self._to(h, Status(update.pop("phase")), **update, **fields)
        fields = promote(self.svc, h)
        return {**self._to(h, Status.SUMMARIZING, **fields), "champion": fields.get("promoted_tag")}

    def _too_good(self, h: Hypothesis, verdict: str | None) -> str | None:
        if verdict != "improvement":
            return None
        from pipeline.api import implausible

        return implausible(self.svc.records.latest_verdict(h.id), self.svc.lab.config)

    def _choice(self, h: Hypothesis, look: int, verdict: str | None, allowed: list[str]) -> Choice:
        """The policy's choice at this look, within `allowed`; stored before any side effect, so a
        re-run after a crash carries out the same decision instead of asking again."""
        svc = self.svc
        done = svc.records.decision_at(h.id, look)
        if done is not None and done.decision in allowed:  # an unknown decision string is in no allowed list
            return Choice(done.decision, done.rationale, done.follow_up)
        from pipeline.api import render_markdown

        from agent import prompts
        from agent.verdicts import DecisionRecord

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
        h = rec.update(h.id, review="pending" if h.review == "none" else h.review)
        write_summary(svc, h)
        if h.commit and not h.promoted_tag:  # a champion's worktree serves its baseline runs
            svc.experiment.release(h.commit)
        return self._to(h, Status.DONE, finished_at=time.time())

    # reverify ---------------------------------------------------------------
    def reverify(self, state: State) -> State:
        """After a promotion: the new champion's own runs (queued by `promote`, on seeds it was not
        selected on) are waited for in an interrupt, and how it held up is recorded (a `reverify`
        gate record and a loop event). The thread ends here; the hypothesis was decided before."""
        from agent.verdicts import reverify_record

        svc = self.svc
        h = svc.records.get(state["hypothesis_id"])
        tag = state.get("champion") or h.promoted_tag
        if not tag or reverify_record(svc.store, h.id) is not None:
            return {"champion": None}
        ids = svc.experiment.queue_champion(tag, tag)  # idempotent: the runs `promote` queued
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
        expected_effect=h.expected_effect, expected_tasks=list(h.expected_tasks or [])))


def promote(svc: Services, h: Hypothesis) -> dict[str, Any]:
    """Fast-forward the baseline to the measured commit, tag `baseline/vN`, and queue the new
    champion's own runs. Refused (an abandon, with the reason) when the commit is not exactly what
    the gate measured against the current head, or when its tree changes a path the agent may not
    change (`Workspace.check_tree`, against the head it would replace)."""
    from agent.workspace import PromotionConflict

    ws = svc.workspace
    head = ws.baseline_head()
    try:
        if h.commit != head and ws.repo.is_ancestor(head, h.commit):  # the tree a fast-forward takes
            ws.check_tree(head, h.commit)  # (any other: promoted already, or refused by `promote` below)
        new, tag = ws.promote(h.commit, f"promote hyp {h.id}: {h.title}", base=h.base_commit or "")
    except (PromotionConflict, EditRejected) as e:
        return {"decision": Decision.ABANDON, "rationale_decision": f"promotion refused: {e}"}
    svc.experiment.queue_champion(new, tag)
    return {"promoted_tag": tag}


def base_moved(svc: Services, h: Hypothesis) -> bool:
    """Whether the baseline moved since the hypothesis was measured against `base_commit` (not a
    re-run of a promotion that already landed: then its commit is in the baseline's history)."""
    ws = svc.workspace
    head = ws.baseline_head()
    return bool(h.base_commit and h.commit) and h.base_commit != head and not ws.repo.is_ancestor(h.commit, head)


def rebase(svc: Services, h: Hypothesis) -> tuple[State, dict[str, Any]]:
    """A hypothesis about to be promoted whose base moved: its commit merged onto the current
    baseline head (no working tree, as promotion does), measured again from its first look.

    A conflict, a merge that leaves the baseline as it is, or one that changes a path the agent may
    not change (`Workspace.check_tree`: the merge follows renames) is an `abandon` with the reason
    and nothing written but unreferenced objects. Otherwise the merge (deterministic for the same head
    and commit) becomes the hypothesis's commit and its branch moves there (a seeded branch is left
    alone: `hyp/<id>-<slug>` is made); the old commit stays in the merge's history and under its
    tag `exp/<id>`. The earlier comparison's gate records are moved aside, to the key
    `<id>@<old base>`, so no verdict or decision against the old base can promote it: the policy's
    evidence and the gate's looks start over against the new base, on its generation's seed block.
    A record `rebase` (and a loop event) says from where to where, and what the old base's verdict
    was. Each step is idempotent; the hypothesis's row changes last: the state's update and the
    row's fields are returned, for the promote node to project."""
    from agent.verdicts import rebases
    from agent.workspace import PromotionConflict

    ws, rec, store = svc.workspace, svc.records, svc.store
    head = ws.baseline_head()
    old_base, old_commit = h.base_commit or "", h.commit or ""
    frm, onto = ws.baseline_name(old_base), ws.baseline_name(head)
    earlier = f"its verdict {h.verdict} at look {h.look} against {frm}"
    payload: dict[str, Any] = {"from_base": old_base, "from_commit": old_commit, "from_tag": frm, "to_base": head,
                               "to_tag": onto, "verdict": h.verdict, "look": h.look,
                               "archived_as": f"{h.id}@{old_base[:12]}"}
    new, why = None, ""
    try:
        new = ws.merge_onto(head, old_commit, f"hyp {h.id} re-based onto {onto}: {h.title}")
        if ws.tree(new) == ws.tree(head):
            why = f"merged onto {onto} it changes nothing: its change is in the baseline already"
        else:
            ws.check_tree(head, new)
    except PromotionConflict as e:
        why = str(e)
    except EditRejected as e:  # e.g. an editable file the baseline moved to a locked path: the merge follows
        why = f"merged onto {onto} it changes {e}"
    done = rebases(store, h.id)
    if not any(r.get("to_base") == head and r.get("from_commit") == old_commit for r in done):
        store.put_gate_record(str(h.id), len(done) + 1, {**payload, "commit": None if why else new,
                                                         "outcome": why or "re-measured"}, kind="rebase")
        said = (f"#{h.id} re-based from {frm} onto {onto}: " +
                (f"abandoned, {why}" if why else f"{earlier} does not count; measured again against {onto}"))
        rec.event("rebase", said)
    if why:
        return {"phase": Status.SUMMARIZING.value}, {
            "decision": Decision.ABANDON,
            "rationale_decision": f"Re-based from {frm} onto {onto} before its promotion ({earlier}): {why}. "
                                  f"Abandoned: never measured against {onto}."}
    assert new is not None
    branch = h.branch if h.branch and h.branch != h.seed_branch else f"hyp/{h.id}-{slugify(h.title)}"
    if branch == h.seed_branch:
        branch = f"hyp/{h.id}-rebased"
    ws.point_branch(branch, new)
    store.move_gate_records(str(h.id), payload["archived_as"], ("verdict",))
    rec.archive_decisions(h.id, payload["archived_as"])
    if old_commit != new:
        svc.experiment.release(old_commit)
    return {"phase": Status.MEASURING.value, "look": svc.lab.config.gate.looks[0], "verdict": None}, {
        "commit": new, "base_commit": head, "branch": branch, "decision": None, "follow_up": None, "review": "none",
        "rationale_decision": f"Re-based from {frm} onto {onto} before its promotion: {earlier} does not "
                              f"count; measured again against {onto}."}


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


def queue_look(svc: Services, h: Hypothesis, look: int) -> list[int]:
    """Queue (idempotently) the runs of the hypothesis's look: the baseline's and its own."""
    return svc.experiment.queue_look(h.base_commit, h.commit, look, label=h.branch, rank=queue_rank(h))


# ----------------------------------------------------------------------------- graph

END = "__end__"  # langgraph.graph.END, without importing langgraph where only the routers are needed


# the routers: where a thread goes after each node, from its state alone (named, so that a node can be
# put between two others by moving a router: `GraphSpec.insert_after`)

def from_start(s: State) -> str:
    """A new thread (the loop gives it the row's status as its phase), or one an earlier version
    ended while its hypothesis was still active: to the node that works in its phase. A hold goes
    through `summarize` first (it writes the summary the reviewer reads; written again, it is the
    same), so no path reaches `hold` without one."""
    return _NODE_OF_PHASE.get(s.get("phase") or "", "reverify" if s.get("champion") else END)


_NODE_OF_PHASE = {Status.QUEUED: "propose", Status.PROPOSING: "propose", Status.IMPLEMENTING: "implement",
                  Status.MEASURING: "evaluate", Status.DECIDING: "decide", Status.PROMOTING: "promote",
                  Status.HELD: "summarize", Status.SUMMARIZING: "summarize"}


def _routed(step: dict[str, str]) -> Callable[[State], str]:
    """A router: the node after this one for the phases it leaves the thread in (`step`), and for any
    other phase the node that works in it (`from_start`). A node re-run after a crash takes the row's
    update (`_replayed`), and the row may be any number of steps ahead of the checkpoint (a kill -9
    lands between a projection and the checkpoint; LangGraph writes checkpoints asynchronously by
    default, so one may be lost besides): the thread goes on from where the row is."""
    def route(s: State) -> str:
        return step.get(s.get("phase") or "") or from_start(s)

    return route


# the phases a node leaves its thread in, and the next node for each; any other phase: `from_start`
after_propose = _routed({Status.IMPLEMENTING: "implement", Status.SUMMARIZING: "summarize"})
after_implement = _routed({Status.MEASURING: "evaluate", Status.SUMMARIZING: "summarize"})
after_evaluate = _routed({Status.DECIDING: "decide", Status.MEASURING: "evaluate"})  # resumed early: waits again
after_decide = _routed({Status.MEASURING: "evaluate", Status.PROMOTING: "promote", Status.HELD: "summarize",
                        Status.SUMMARIZING: "summarize"})  # a hold is summarized first, then waits in `hold`
after_promote = _routed({Status.MEASURING: "evaluate", Status.SUMMARIZING: "summarize"})  # re-based: measured again
after_summarize = _routed({Status.HELD: "hold"})  # done: to `reverify` (a champion) or the end
after_hold = _routed({Status.PROMOTING: "promote", Status.SUMMARIZING: "summarize", Status.HELD: "hold"})
after_reverify = _routed({})  # a champion's thread waits again (resumed early), then ends


@dataclass
class GraphSpec:
    """The graph as data: its nodes and, for each, its router (`graph_spec` fills both). `build_graph` compiles it;
    a new step is a node and one `insert_after`, and no other node changes."""

    nodes: dict[str, Callable[[State], State]]
    routes: dict[str, Callable[[State], str]]

    def insert_after(self, after: str, name: str, node: Callable[[State], State]) -> None:
        """Put `node` right after `after`: it takes over `after`'s router, and `after` leads to it."""
        self.nodes[name] = node
        self.routes[name] = self.routes[after]
        self.routes[after] = lambda _s: name

    def compile(self, checkpointer: Any, projection: Records | None = None):
        from langgraph.graph import START, StateGraph

        g = StateGraph(State)
        for name, node in self.nodes.items():
            g.add_node(name, node if projection is None else _replayed(name, node, projection))
        g.add_conditional_edges(START, from_start, [*self.nodes, END])
        for name, router in self.routes.items():
            g.add_conditional_edges(name, router, [*self.nodes, END])
        return g.compile(checkpointer=checkpointer)


def graph_spec(svc: Services) -> GraphSpec:
    nodes = Nodes(svc)
    return GraphSpec(
        nodes={"propose": nodes.propose, "implement": nodes.implement, "evaluate": nodes.evaluate,
               "decide": nodes.decide, "promote": nodes.promote, "summarize": nodes.summarize, "hold": nodes.hold,
               "reverify": nodes.reverify},
        routes={"propose": after_propose, "implement": after_implement, "evaluate": after_evaluate,
                "decide": after_decide, "promote": after_promote, "summarize": after_summarize, "hold": after_hold,
                "reverify": after_reverify})


# the phases in which each node does its step: a row in any other phase had it done already
ENTRY_PHASES: dict[str, tuple[Status, ...]] = {
    "propose": (Status.QUEUED, Status.PROPOSING), "implement": (Status.IMPLEMENTING,),
    "evaluate": (Status.MEASURING,), "decide": (Status.DECIDING,), "promote": (Status.PROMOTING,),
    "summarize": (Status.SUMMARIZING, Status.HELD), "hold": (Status.HELD,), "reverify": (Status.DONE,)}


def _replayed(name: str, node: Callable[[State], State], records: Records) -> Callable[[State], State]:
    """A node run again after a crash between its projection and its checkpoint finds the row a step
    ahead (the row is written first, in a phase this node does not work in): the step is done, and
    its update is the row's. Every node's side effects come before its projection, so nothing of
    the step is lost, and nothing is done twice (a promotion, a re-base). A thread checkpointed by
    an earlier version, with no phase in its state, is judged by its row the same way. A node
    added from outside (`GraphSpec.insert_after`) has no entry phases and always runs."""
    entry = ENTRY_PHASES.get(name)

    def run(state: State) -> State:
        if entry is not None:
            h = records.get(state["hypothesis_id"])
            if h.status not in entry:
                return thread_input(h)
        out = node(state)
        if not state.get("phase") and "phase" not in out:  # a thread with no phase yet: the row's, for the routers
            out = {**out, "phase": records.get(state["hypothesis_id"]).status}
        return out

    run.__name__ = getattr(node, "__name__", name)
    return run


def build_graph(svc: Services, checkpointer: Any):
    """One hypothesis's graph, checkpointed by `checkpointer`:
    propose → implement → evaluate ⇄ decide → [promote] → summarize → [reverify]; decide → summarize
    → hold → promote (a held promotion); promote → evaluate (a re-based hypothesis)."""
    return graph_spec(svc).compile(checkpointer, projection=svc.records)


def claim(records: Records, h: Hypothesis) -> Hypothesis:
    """A queued hypothesis taken off the queue by the loop: its thread starts at its first node
    (`implement` for one with a title: a seed or a refinement; else `propose`)."""
    return project(records, h.id, {"phase": Status.IMPLEMENTING if h.title else Status.PROPOSING})


def open_proposal(records: Records, origin: str) -> Hypothesis:
    """An empty hypothesis whose thread proposes (the loop asks for one when it has room)."""
    h = records.add(Hypothesis(origin=origin))
    return project(records, h.id, {"phase": Status.PROPOSING})


def give_up(records: Records, hid: int, reason: str) -> Hypothesis:
    """A hypothesis whose graph failed too often (the loop counts): ended, rejected with the reason."""
    return project(records, hid, {"phase": Status.DONE}, decision=Decision.REJECT, reject_kind="internal_error",
                   reject_reason=reason, finished_at=time.time())


def thread_input(h: Hypothesis) -> State:
    """What a thread starts from (a new one, or one an earlier version ended): the row's lifecycle."""
    state: State = {"hypothesis_id": h.id, "phase": h.status, "look": h.look, "verdict": h.verdict}
    if h.promoted_tag:
        state["champion"] = h.promoted_tag
    return state


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
