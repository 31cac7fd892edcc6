"""The LLM policy: every word through `prompts/`, every call through the audited, budgeted
`agent.llm.LLMClient` of any OpenAI-compatible endpoint. It proposes, implements (and repairs what
the checks reject), decides within the choices the gate allows, and writes the summaries' prose.

One of the policies of `agent.policy.POLICIES` (`--policy llm`; the first choice where an endpoint
is configured).
"""

from __future__ import annotations

import json
from typing import Any

from agent import prompts
from agent.config import agent_config
from agent.errors import NotConfigured
from agent.ledger import Ledger
from agent.lifecycle import Decision
from agent.llm import LLMClient
from agent.llm_prices import lab_price
from agent.policy import Choice, Context, Feedback, Proposal
from agent.workspace import EditRejected, FileEdit

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

    return "\n\n".join(prompts.phrase("file_block", path=p, text=t) for p, t in sorted(files.items()))


def history_table(history: list[dict[str, Any]], left_out: dict[str, int] | None = None) -> str:

    if not history:
        return prompts.phrase("none_yet")
    rows = []
    if left_out:
        counts = ", ".join(f"{n} {k}" for k, n in sorted(left_out.items(), key=lambda kv: (-kv[1], kv[0])))
        rows.append(prompts.phrase("history_left_out", n=sum(left_out.values()), counts=counts))
    rows.append(prompts.phrase("history_header"))
    for h in history:
        rows.append(prompts.phrase("history_row", id=h["id"], title=h["title"], status=h["status"],
                                   verdict=h.get("verdict") or "-", decision=h.get("decision") or "-",
                                   mean_delta=h.get("mean_delta", "-"), improved=h.get("improved", "-")))
    return "\n".join(rows)


def choices_text(allowed: list[str]) -> str:
    """The decisions allowed at this look, each with what it does (prompts/phrases.toml)."""

    return "\n".join(prompts.phrase("choice_item", text=prompts.phrase(f"choice_{a}")) for a in allowed)


class LLMPolicy:
    """Every word through `prompts/`, every call through the audited, budgeted `LLMClient`."""

    name = "llm"
    can_repair = True

    def __init__(self, client: Any):
        self.client = client

    def _messages(self, ctx: Context, name: str, **values: Any) -> list[dict[str, str]]:

        system = prompts.render("system", lab_name=ctx.lab_name, editable=prompts.md_list(ctx.editable),
                                metric=ctx.metric)
        return [{"role": "system", "content": system}, {"role": "user", "content": prompts.render(name, **values)}]

    def propose(self, ctx: Context) -> Proposal | None:

        msgs = self._messages(
            ctx, "propose", program=ctx.program, metric=ctx.metric, tasks=prompts.md_list(ctx.tasks),
            baseline=ctx.baseline, files=_md_files(ctx.files), history=history_table(ctx.history, ctx.history_left_out),
            comments=prompts.md_list(ctx.comments) if ctx.comments else prompts.phrase("none"),
            plateau=prompts.phrase("plateau", n=ctx.plateau) if ctx.plateau else "",
            directions=prompts.md_list(ctx.directions) if ctx.directions else prompts.phrase("none_yet"),
        )
        out = self.client.complete_json("propose", msgs, PROPOSAL_SCHEMA, "hypothesis")
        tasks = [t for t in out["tasks_expected"] if t in ctx.tasks] or list(ctx.tasks)
        return Proposal(out["title"].strip()[:120], out["rationale"].strip(), out["expected_effect"].strip(), tasks,
                        notes=out["change"].strip())

    def implement(self, ctx: Context, hyp: Any, feedback: Feedback | None) -> list[FileEdit]:

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


def make(lab: Any, store: Any) -> LLMPolicy:
    """The registry's factory: `NotConfigured` without an endpoint (OPENAI_BASE_URL / OPENAI_API_KEY)."""

    if not LLMClient.configured():
        raise NotConfigured("no LLM endpoint: set OPENAI_BASE_URL and/or OPENAI_API_KEY")
    agent = agent_config(lab).agent
    client = LLMClient.from_env(agent.model, Ledger(store.engine),
                                max_usd_per_day=agent.max_usd_per_day, max_tokens_per_day=agent.max_tokens_per_day,
                                price=lab_price(agent), max_output_tokens=agent.max_output_tokens,
                                timeout_s=agent.request_timeout_s, idle_timeout_s=agent.idle_timeout_s,
                                max_attempts=agent.request_attempts)
    return LLMPolicy(client)
