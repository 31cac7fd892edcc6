"""Who has the ideas: an LLM over prompts/ templates, or the offline policy over `[search_space]`.

A policy proposes, implements, decides within the choices the gate allows, and (optionally)
words the summary. It never computes a number that reaches a human: those come from the gate.
"""

from __future__ import annotations

import itertools
import json
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from agent.errors import NotConfigured
from agent.lifecycle import Decision
from agent.workspace import EditRejected, FileEdit
from pipeline.registry import Registry

CONFIG_FILE = "config.toml"


@dataclass
class Proposal:
    title: str
    rationale: str
    expected_effect: str
    expected_tasks: list[str]
    change: dict[str, Any] | None = None  # search-space values (offline policy)
    plan: list[dict[str, Any]] | None = None  # ready edits (offline policy)
    notes: str = ""


@dataclass
class Choice:
    decision: str
    rationale: str
    follow_up: str = ""


@dataclass
class Context:
    """What a policy may read: filled by the graph from the store and the baseline commit."""

    lab_name: str
    program: str
    metric: str
    tasks: list[str]
    editable: list[str]
    baseline: str  # tag, commit, score line
    files: dict[str, str]  # the baseline's editable files
    history: list[dict[str, Any]] = field(default_factory=list)
    comments: list[str] = field(default_factory=list)
    search_space: dict[str, list[Any]] = field(default_factory=dict)
    tried_states: list[dict[str, Any]] = field(default_factory=list)  # the hypotheses' search values
    key_costs: dict[str, int] = field(default_factory=dict)  # search key -> stages its change re-runs
    baseline_states: list[dict[str, Any]] = field(default_factory=list)  # earlier baselines' search values
    plateau: int | None = None  # measured hypotheses in a row without a promotion, once past [agent] plateau_after
    directions: list[str] = field(default_factory=list)  # one line per direction tried (agent.directions), when proposing


@dataclass
class Feedback:
    """Why the previous implementation was rejected, for a repair round."""

    stage: str  # paths | apply | compile | smoke
    error: str
    round: int  # this repair round, from 1
    max_rounds: int
    previous: list[FileEdit] = field(default_factory=list)  # the rejected edits


class Policy(Protocol):
    name: str
    can_repair: bool  # whether `implement` can answer a rejection with other edits
    llm: Any  # its `agent.llm.LLMClient` (summaries are then LLM-written; spend is guarded), or None

    def propose(self, ctx: Context) -> Proposal | None: ...

    def implement(self, ctx: Context, hyp: Any, feedback: Feedback | None) -> list[FileEdit]: ...

    def decide(self, ctx: Context, hyp: Any, verdict: str, evidence: str, allowed: list[str], look: str) -> Choice: ...


# ----------------------------------------------------------------------------- config.toml edits

def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise ValueError(f"unsupported value {v!r}")


def config_values(text: str, keys: list[str]) -> dict[str, Any]:
    data = tomllib.loads(text)
    out = {}
    for key in keys:
        section, name = key.split(".", 1)
        out[key] = data.get(section, {}).get(name)
    return out


def config_edit(text: str, key: str, value: Any) -> FileEdit:
    """A search/replace that sets `section.name = value` in config.toml, keeping its comments.

    The search block runs from the section header to the key's line, so it is unique even when
    two sections hold the same `name = value` line.
    """
    section, name = key.split(".", 1)
    header = re.search(rf"(?m)^\[{re.escape(section)}\][ \t]*$", text)
    if header is None:
        raise EditRejected("not_applying", f"{CONFIG_FILE}: no [{section}] section")
    rest = text[header.end():]
    nxt = re.search(r"(?m)^\[", rest)
    body = rest[: nxt.start()] if nxt else rest
    line = re.search(rf"(?m)^(?P<lhs>{re.escape(name)}\s*=\s*)(?P<value>[^#\n]*?)(?P<tail>\s*(#.*)?)$", body)
    if line is None:
        raise EditRejected("not_applying", f"{CONFIG_FILE}: no key {name!r} in [{section}]")
    search = text[header.start(): header.end() + line.end()]
    new_line = line.group("lhs") + toml_value(value) + line.group("tail")
    replace = search[: len(search) - len(line.group(0))] + new_line
    return FileEdit(CONFIG_FILE, replace, search)


# ----------------------------------------------------------------------------- offline policy

def coarse_to_fine(values: list[Any], current: Any) -> list[Any]:
    """The values other than `current`, farthest from it in the list's order first (ties: list order).
    A current value that is not listed leaves the list's order as it is."""
    others = [v for v in values if v != current]
    if current not in values:
        return others
    at = values.index(current)
    return sorted(others, key=lambda v: -abs(values.index(v) - at))


class OfflinePolicy:
    """Untried combinations of `[search_space]`, applied as config.toml edits; decisions by verdict.

    Candidates change one key at a time, round-robin across keys (diverse evidence early; the keys
    whose change re-runs fewer stages first, so a fine-tuning knob is tried before one that costs
    pretraining), then two keys at once. Within a key, coarse to fine: the listed value farthest
    from the current one first (a big step shows whether the knob matters at all; the values in
    between come after). Going back to a value an earlier baseline had comes last. A candidate is
    skipped when the whole resulting configuration was measured before.
    """

    name = "offline"
    can_repair = False
    llm = None

    def propose(self, ctx: Context) -> Proposal | None:
        space = ctx.search_space
        if not space:
            return None
        base_text = ctx.files.get(CONFIG_FILE)
        if base_text is None:
            return None
        keys = sorted(space, key=lambda k: ctx.key_costs.get(k, 0))  # stable: ties keep the listed order
        current = config_values(base_text, keys)
        tried = [tuple(json.dumps(s.get(k)) for k in keys) for s in [*ctx.tried_states, *ctx.baseline_states]]
        tried.append(tuple(json.dumps(current[k]) for k in keys))

        per_key = [[[(k, v)] for v in coarse_to_fine(space[k], current[k])] for k in keys]
        candidates = [c for group in itertools.zip_longest(*per_key) for c in group if c]  # round-robin
        for (k1, v1s), (k2, v2s) in itertools.combinations([(k, space[k]) for k in keys], 2):
            candidates += [[(k1, a), (k2, b)] for a in v1s for b in v2s if a != current[k1] and b != current[k2]]
        # a value some earlier baseline had and a promotion moved away from: last, not never
        moved_from = {(k, json.dumps(s.get(k))) for s in ctx.baseline_states for k in keys
                      if json.dumps(s.get(k)) != json.dumps(current[k])}
        candidates.sort(key=lambda c: any((k, json.dumps(v)) in moved_from for k, v in c))  # stable
        for cand in candidates:
            state = dict(current) | dict(cand)
            if tuple(json.dumps(state[k]) for k in keys) in tried:
                continue
            try:
                edits = [config_edit(base_text, k, v) for k, v in cand]
                if len(cand) == 2:  # the second search block must be cut from the text after the first edit
                    first = base_text.replace(edits[0].search, edits[0].replace, 1)
                    edits[1] = config_edit(first, cand[1][0], cand[1][1])
            except EditRejected:  # a key config.toml no longer has (a promotion removed it): not a candidate
                continue
            what = " and ".join(f"{k} = {toml_value(v)}" for k, v in cand)
            was = " and ".join(f"{k} = {toml_value(current[k])}" for k, _ in cand)
            return Proposal(
                title=f"Set {what}"[:70],
                rationale=(f"Offline search over [search_space]: the baseline has {was}; this configuration "
                           f"has not been measured yet."),
                expected_effect="unknown sign; any gain expected to be horizontal",
                expected_tasks=list(ctx.tasks),
                change=state,
                plan=[e.to_dict() for e in edits],
            )
        return None

    def implement(self, ctx: Context, hyp: Any, feedback: Feedback | None) -> list[FileEdit]:
        if not hyp.plan:
            raise EditRejected("needs_llm", "no edits to apply: a hypothesis in words needs an LLM endpoint to "
                                            "implement it (set OPENAI_BASE_URL / OPENAI_API_KEY), or seed it with "
                                            "--file edits or --branch")
        if feedback is not None:
            raise EditRejected("no_repair", "the offline policy has no other implementation to offer")
        return [FileEdit.from_dict(d) for d in hyp.plan]

    def decide(self, ctx: Context, hyp: Any, verdict: str, evidence: str, allowed: list[str], look: str) -> Choice:
        for preferred in (Decision.PROMOTE, Decision.HOLD, Decision.ESCALATE):
            if preferred in allowed:
                return Choice(preferred, f"The gate's verdict is {verdict}; the offline policy follows it.")
        return Choice(Decision.ABANDON, f"The gate's verdict is {verdict}: no promotion is allowed and no further look "
                                 "is warranted.")


# ----------------------------------------------------------------------------- LLM policy

PROPOSAL_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 3, "maxLength": 120},
        "rationale": {"type": "string", "minLength": 1},
        "expected_effect": {"type": "string", "minLength": 1},
        "tasks_expected": {"type": "array", "items": {"type": "string"}},
        "change": {"type": "string"},
    },
    "required": ["title", "rationale", "expected_effect", "tasks_expected", "change"],
    "additionalProperties": False,
}
EDITS_SCHEMA = {
    "type": "object",
    "properties": {
        "edits": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "search": {"type": ["string", "null"]},
                    "replace": {"type": ["string", "null"]},
                    "content": {"type": ["string", "null"]},
                },
                "required": ["path", "search", "replace", "content"],
                "additionalProperties": False,
            },
        },
        "notes": {"type": "string"},
    },
    "required": ["edits", "notes"],
    "additionalProperties": False,
}


def decision_schema(allowed: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "decision": {"type": "string", "enum": [str(a) for a in allowed]},
            "rationale": {"type": "string", "minLength": 1},
            "follow_up": {"type": "string"},
        },
        "required": ["decision", "rationale", "follow_up"],
        "additionalProperties": False,
    }


def _md_files(files: dict[str, str]) -> str:
    from agent import prompts

    return "\n\n".join(prompts.phrase("file_block", path=p, text=t) for p, t in sorted(files.items()))


def history_table(history: list[dict[str, Any]]) -> str:
    from agent import prompts

    if not history:
        return prompts.phrase("none_yet")
    rows = [prompts.phrase("history_header")]
    for h in history:
        rows.append(prompts.phrase("history_row", id=h["id"], title=h["title"], status=h["status"],
                                   verdict=h.get("verdict") or "-", decision=h.get("decision") or "-",
                                   mean_delta=h.get("mean_delta", "-"), improved=h.get("improved", "-")))
    return "\n".join(rows)


def choices_text(allowed: list[str]) -> str:
    """The decisions allowed at this look, each with what it does (prompts/phrases.toml)."""
    from agent import prompts

    return "\n".join(prompts.phrase("choice_item", text=prompts.phrase(f"choice_{a}")) for a in allowed)


class LLMPolicy:
    """Every word through `prompts/`, every call through the audited, budgeted `LLMClient`."""

    name = "llm"
    can_repair = True

    def __init__(self, client: Any):
        self.client = client

    @property
    def llm(self) -> Any:
        return self.client

    def _messages(self, ctx: Context, name: str, **values: Any) -> list[dict[str, str]]:
        from agent import prompts

        system = prompts.render("system", lab_name=ctx.lab_name, editable=prompts.md_list(ctx.editable),
                                metric=ctx.metric)
        return [{"role": "system", "content": system}, {"role": "user", "content": prompts.render(name, **values)}]

    def propose(self, ctx: Context) -> Proposal | None:
        from agent import prompts

        msgs = self._messages(
            ctx, "propose", program=ctx.program, metric=ctx.metric, tasks=prompts.md_list(ctx.tasks),
            baseline=ctx.baseline, files=_md_files(ctx.files), history=history_table(ctx.history),
            comments=prompts.md_list(ctx.comments) if ctx.comments else prompts.phrase("none"),
            plateau=prompts.phrase("plateau", n=ctx.plateau) if ctx.plateau else "",
            directions=prompts.md_list(ctx.directions) if ctx.directions else prompts.phrase("none_yet"),
        )
        out = self.client.complete_json("propose", msgs, PROPOSAL_SCHEMA, "hypothesis")
        tasks = [t for t in out["tasks_expected"] if t in ctx.tasks] or list(ctx.tasks)
        return Proposal(out["title"].strip()[:120], out["rationale"].strip(), out["expected_effect"].strip(), tasks,
                        notes=out["change"].strip())

    def implement(self, ctx: Context, hyp: Any, feedback: Feedback | None) -> list[FileEdit]:
        from agent import prompts

        msgs = self._messages(
            ctx, "implement", title=hyp.title, rationale=hyp.rationale, expected_effect=hyp.expected_effect,
            change=hyp.seed_text or hyp.rationale, editable=prompts.md_list(ctx.editable), files=_md_files(ctx.files),
        )
        if feedback is not None:  # the conversation continues: the model sees what it sent and why it failed
            if feedback.previous:
                previous = {"edits": [e.to_dict() for e in feedback.previous], "notes": ""}
                msgs.append({"role": "assistant", "content": json.dumps(previous)})
            msgs.append({"role": "user", "content": prompts.render(
                "repair", stage=feedback.stage, error=feedback.error[-4000:], round=feedback.round,
                max_rounds=feedback.max_rounds)})
        out = self.client.complete_json("implement", msgs, EDITS_SCHEMA, "edits", hypothesis_id=str(hyp.id))
        edits = []
        for d in out["edits"]:
            d = {k: v for k, v in d.items() if v is not None}
            edits.append(FileEdit.from_dict(d))
        if not edits:
            raise EditRejected("empty", f"the model returned no edits: {out.get('notes', '')}")
        return edits

    def decide(self, ctx: Context, hyp: Any, verdict: str, evidence: str, allowed: list[str], look: str) -> Choice:
        from agent import prompts

        msgs = self._messages(
            ctx, "decide", title=hyp.title, rationale=hyp.rationale,
            expected_effect=prompts.phrase("expected_effect", effect=hyp.expected_effect,
                                           tasks=", ".join(hyp.expected_tasks or [])),
            look=look, verdict=verdict, evidence=evidence, choices=choices_text(allowed),
            comments=prompts.md_list(ctx.comments) if ctx.comments else prompts.phrase("none"),
        )
        out = self.client.complete_json("decide", msgs, decision_schema(allowed), "decision", hypothesis_id=str(hyp.id))
        if out["decision"] not in allowed:  # the schema's enum should prevent it; the gate's bounds win anyway
            fallback = Decision.ABANDON if Decision.ABANDON in allowed else allowed[-1]
            return Choice(fallback, f"the model chose {out['decision']!r}, which the verdict does not allow")
        return Choice(out["decision"], out["rationale"].strip(), out.get("follow_up", "").strip())


# ----------------------------------------------------------------------------- registry

PolicyFactory = Callable[[Any, Any], Policy]
"""(lab, store) → a policy; raises `NotConfigured` where it cannot work here (no endpoint)."""


def _offline(lab: Any, store: Any) -> Policy:
    return OfflinePolicy()


def _llm(lab: Any, store: Any) -> Policy:
    from agent.ledger import Ledger
    from agent.llm import LLMClient

    if not LLMClient.configured():
        raise NotConfigured("no LLM endpoint: set OPENAI_BASE_URL and/or OPENAI_API_KEY")
    client = LLMClient.from_env(lab.config.agent.model, Ledger(store.engine),
                                max_usd_per_day=lab.config.agent.max_usd_per_day,
                                max_output_tokens=lab.config.agent.max_output_tokens,
                                timeout_s=lab.config.agent.request_timeout_s,
                                max_attempts=lab.config.agent.request_attempts)
    return LLMPolicy(client)


# name → factory, in order of preference when none is named: the first that is configured wins.
# A new policy is one module and one line here (a plugin or a test: `POLICIES.register(name, factory)`).
POLICIES: Registry[PolicyFactory] = Registry("policy", {"llm": _llm, "offline": _offline})


def make_policy(lab: Any, store: Any, name: str | None = None) -> Policy:
    """The policy `name`, or the first configured one (the LLM with an endpoint, else offline)."""
    from pipeline.errors import UserError

    if name is not None:
        factory = POLICIES.get(name)
        try:
            return factory(lab, store)
        except NotConfigured as e:
            raise UserError(f"policy {name!r}: {e}") from None
    for each in POLICIES:
        try:
            return POLICIES.get(each)(lab, store)
        except NotConfigured:
            continue
    return OfflinePolicy()
