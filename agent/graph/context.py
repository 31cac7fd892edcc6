"""What the policy reads before it proposes, implements or decides: the lab, the baseline's editable
files, the history with each decided hypothesis's effect, the humans' comments."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from agent.config import agent_config
from agent.graph.state import Services
from agent.lifecycle import Decision, Status
from agent.policy import Context
from agent.verdicts import VERDICT
from pipeline.api import BASELINE_BRANCH, GateResult, Lab, glob_match

log = logging.getLogger("autoresearch.agent")

# A prompt lists the latest decided hypotheses and the latest promoted ones, and counts the rest: a
# table of every one grows ~30 tokens a hypothesis, past a 128k context in about 4,000 (weeks of a
# busy lab), after which every proposal would be refused. The directions tried cover them all.
HISTORY_ROWS = 60
HISTORY_PROMOTED = 30


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
    decided = [h for h in briefs if h.status in (Status.DONE, Status.HELD)]
    promoted = [h.id for h in decided if h.decision == Decision.PROMOTE]
    listed = {h.id for h in decided[-HISTORY_ROWS:]} | set(promoted[-HISTORY_PROMOTED:])
    effects = _effect_summaries(svc, [h for h in decided if h.id in listed])
    left_out: Counter[str] = Counter()
    for h in briefs:
        if h.change:
            tried_states.append(h.change)
        if h.base_commit:
            base_commits.add(h.base_commit)
        if h.status in (Status.DONE, Status.HELD):
            if h.id in listed:
                history.append({"id": h.id, "title": h.title, "status": h.status, "verdict": h.verdict,
                                "decision": h.decision, **effects.get(h.id, {})})
            else:
                left_out[str(h.decision or h.status)] += 1
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
        history_left_out=dict(left_out),
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
    return n if n >= agent_config(svc.lab).agent.plateau_after else None


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
    out, missing = {}, []
    for h in hs:
        if h.id in svc.effects:
            out[h.id] = svc.effects[h.id]
        else:
            missing.append(h)
    if len(missing) > 8:
        recs = svc.store.latest_gate_records(VERDICT, [str(h.id) for h in missing])
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

