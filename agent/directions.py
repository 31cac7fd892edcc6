"""Directions: the lab's hypotheses grouped by what they changed, and what each group paid.

A hypothesis's direction is derived from its commit's diff against the fork point with its base
(the same diff the hypothesis page shows): the `config.toml` keys whose values changed (`section.key`,
when the lab's editable config is that TOML file and it parses), and every other changed file by its
path. A hypothesis with no commit yet (queued, or rejected before one was made) is grouped by the
search-space keys it proposed (`Hypothesis.change`), else as "(no change)". The records carry no
direction label of the policy's own, so none is used; no LLM is asked.

Per group: counts by verdict and by decision, the gain it banked (the sum of the horizontal Δ, in
σ units, of the last verdict record of each promoted hypothesis), the runs it spent (its challenger
runs that finished or failed), and its last result (the newest decided hypothesis). Every number
comes from the store's records. Read by the web page (`/directions`); `directions_lines` words it
for a prompt or a terminal.
"""

from __future__ import annotations

import tomllib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from agent.lifecycle import Decision, Status
from agent.verdicts import latest_verdict

CONFIG_FILE = "config.toml"
NO_CHANGE = "(no change)"
_CACHE: dict[tuple[str, str], tuple[str, ...]] = {}  # (base, commit) -> direction; commits never change
_CACHE_MAX = 4096


MAX_CONFIG_BYTES = 1 << 20  # a branch's config.toml larger than this has no keys worth a direction
MAX_DEPTH = 32  # tables nested deeper are one key (a branch may nest 1000 deep to break a recursion)
TOO_DEEP = "(tables nested too deep)"


def _flat(d: dict[str, Any]) -> dict[str, Any]:
    """`section.key` → value, without recursion; a table deeper than MAX_DEPTH is one value, TOO_DEEP
    (comparing or printing it would recurse)."""
    out: dict[str, Any] = {}
    stack: list[tuple[str, dict[str, Any], int]] = [("", d, 0)]
    while stack:
        prefix, table, depth = stack.pop()
        for k, v in table.items():
            key = f"{prefix}{k}"
            if not isinstance(v, dict):
                out[key] = v
            elif depth < MAX_DEPTH:
                stack.append((key + ".", v, depth + 1))
            else:
                out[key] = TOO_DEEP
    return out


def _config_text(workspace: Any, rev: str) -> str | None:
    """The commit's config.toml as text, or None: missing, over MAX_CONFIG_BYTES, or not UTF-8 (a
    branch wrote it: read with a bound, never trusted to decode)."""
    try:
        blob = workspace.repo.commit(rev).tree / CONFIG_FILE
        if blob.type != "blob" or blob.size > MAX_CONFIG_BYTES:
            return None
        return blob.data_stream.read().decode("utf-8")
    except (KeyError, ValueError, UnicodeDecodeError):
        return None


def changed_keys(workspace: Any, base: str | None, commit: str | None) -> dict[str, str]:
    """`section.key` → new value (as text, at most 500 characters) for every `config.toml` value the
    commit changed from `base`; {} without both commits, the file, or with a file that does not parse."""
    if not base or not commit:
        return {}
    texts = [_config_text(workspace, rev) for rev in (base, commit)]
    if any(t is None for t in texts):
        return {}
    try:  # a branch's arrays may nest deep too: parsing, comparing or printing them can recurse
        old, new = (_flat(tomllib.loads(t)) for t in texts)  # type: ignore[arg-type]
        out = {k: str(v)[:500] for k, v in new.items() if old.get(k) != v}
    except (tomllib.TOMLDecodeError, RecursionError, ValueError):
        return {}
    out |= {k: "(removed)" for k in old if k not in new}
    return out


def fork_point(workspace: Any, base: str, commit: str) -> str | None:
    fork = workspace.repo.merge_base(base, commit)
    return fork[0].hexsha if fork else None


def direction_of(workspace: Any, h: Any) -> tuple[str, ...]:
    """The sorted config keys and file paths the hypothesis's commit changed (see the module doc);
    a finished hypothesis's as recorded (`Records.keep_directions`)."""
    if getattr(h, "direction", None):
        return tuple(h.direction)
    if not (h.commit and h.base_commit):
        keys = tuple(sorted(str(k) for k in (h.change or {})))
        return keys or (NO_CHANGE,)
    hit = _CACHE.get((h.base_commit, h.commit))  # before merge_base: one git process per hypothesis saved
    if hit is not None:
        return hit
    fork = fork_point(workspace, h.base_commit, h.commit)
    if fork is None:
        return (NO_CHANGE,)
    parts: set[str] = set()
    for path in workspace.changed_paths(fork, h.commit):
        keys = changed_keys(workspace, fork, h.commit) if path == CONFIG_FILE else {}
        parts |= set(keys) if keys else {path}
    out = tuple(sorted(parts)) or (NO_CHANGE,)
    while len(_CACHE) >= _CACHE_MAX:  # the oldest first (finished hypotheses keep theirs in the store)
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[(h.base_commit, h.commit)] = out
    return out


def label(direction: tuple[str, ...]) -> str:
    return " + ".join(direction)


@dataclass
class Group:
    direction: tuple[str, ...]
    hypotheses: list[int] = field(default_factory=list)
    verdicts: Counter = field(default_factory=Counter)
    decisions: Counter = field(default_factory=Counter)
    banked_sigma: float = 0.0  # Σ horizontal Δ (σ units) of the promoted
    promoted: int = 0
    runs: int = 0
    last: dict[str, Any] | None = None  # the newest decided hypothesis: id, title, verdict, decision

    @property
    def label(self) -> str:
        return label(self.direction)


def group_directions(workspace: Any, store: Any, records: Any) -> list[Group]:
    """Every proposed hypothesis in its direction's group; groups in order of first appearance. A
    finished hypothesis's direction is found once and recorded (git is asked nothing for it again),
    and the runs of all of them are counted in one query: this runs at every proposal, over months
    of hypotheses."""

    groups: dict[tuple[str, ...], Group] = {}
    finished = store.finished_runs_by_commit()
    found: dict[int, list[str]] = {}
    for h in records.briefs():
        if not h.title:
            continue
        d = direction_of(workspace, h)
        if h.direction is None and h.status == Status.DONE and h.commit:
            found[h.id] = list(d)
        g = groups.setdefault(d, Group(d))
        g.hypotheses.append(h.id)
        g.verdicts[h.verdict or "not measured"] += 1
        g.decisions[h.decision or ("held" if h.status == Status.HELD else "in flight" if h.status != Status.DONE else "none")] += 1
        if h.commit:
            g.runs += finished.get(h.commit, 0)
        if h.decision == Decision.PROMOTE:
            g.promoted += 1
            last = latest_verdict(store, h.id)
            delta = last.horizontal.delta if last is not None else None
            if delta is not None:
                g.banked_sigma += float(delta)
        if h.decision or h.verdict:
            g.last = {"id": h.id, "title": h.title, "verdict": h.verdict, "decision": h.decision}
    records.keep_directions(found)
    return list(groups.values())


def directions_lines(groups: list[Group], limit: int = 20) -> list[str]:
    """One line per group, most banked first: for a prompt's context or a terminal."""
    out = []
    for g in sorted(groups, key=lambda g: (-g.banked_sigma, -len(g.hypotheses)))[:limit]:
        dec = ", ".join(f"{n} {k}" for k, n in sorted(g.decisions.items()))
        out.append(f"{g.label}: {len(g.hypotheses)} hypotheses ({dec}), banked {g.banked_sigma:+.3f}σ "
                   f"in {g.promoted} promotions, {g.runs} runs")
    return out
