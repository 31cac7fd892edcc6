"""The offline policy: no LLM, no network. It proposes one `[search_space]` value at a time
(coarse to fine around the baseline's), as an edit of the lab's `config.toml`, and follows the gate.

One of the policies of `agent.policy.POLICIES` (`run --offline`, `--policy offline`).
"""

from __future__ import annotations

import itertools
import json
import re
import tomllib
from typing import Any

from agent.lifecycle import Decision
from agent.policy import Choice, Context, Feedback, Proposal
from agent.workspace import EditRejected, FileEdit

CONFIG_FILE = "config.toml"


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


def make(lab: Any, store: Any) -> OfflinePolicy:
    """The registry's factory: always configured."""
    return OfflinePolicy()
