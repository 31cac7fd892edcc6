"""Progress champion by champion, on the gate split and on the sealed holdout.

The gate decides on the `gate` split every time, so over many promotions the baseline can fit that
split's noise (adaptive overfitting, test-set reuse). A harness with a `holdout` split scores each
baseline's own runs on it too (`pipeline.runner`, table `holdout_score`); here the first baseline
and every champion since are measured on their own runs on both splits, and the cumulative gains are
set side by side. The gap between them is the test-reuse gap.

Read by `status`, the digest, the progress chart and the web page only: nothing here reaches the gate,
the agent's context or a prompt (tests/test_holdout.py checks it).
"""

from __future__ import annotations

import logging
from typing import Any

from agent.lifecycle import Decision
from pipeline.api import baseline_number

log = logging.getLogger("autoresearch.progress")


def champions(records: Any, briefs: list[Any] | None = None) -> list[tuple[str, str, int | None]]:
    """(label, revision, hypothesis id) of the first baseline and of each promotion since, in the
    order of promotion (the tag's number: with hypotheses in flight together, ids need not be);
    from `briefs` where the caller read them already."""
    hyps = sorted((h for h in (records.champion_briefs() if briefs is None else briefs) if h.base_commit),
                  key=lambda h: h.id)
    if not hyps:
        return []
    promoted = [h for h in hyps if h.decision == Decision.PROMOTE and h.promoted_tag and h.commit]


    def number(h: Any) -> int:
        n = baseline_number(h.promoted_tag)
        return n if n is not None else 1 << 30

    start = [("start", hyps[0].base_commit, None)]
    return start + [(h.promoted_tag, h.promoted_tag, h.id) for h in sorted(promoted, key=number)]


def split_progress(lab: Any, store: Any, records: Any, briefs: list[Any] | None = None,
                   latest: int | None = None) -> dict[str, Any]:
    """The champions' levels on both splits and the cumulative gains since the first baseline.

    A champion's level is the mean over tasks of its own runs (its seed block: the fresh runs it
    re-verified on), so the gate-split figure is already free of the selection on seeds; what is left
    between the two gains is the reuse of the gate's test rows. `holdout` is None where the harness
    has none; a champion whose own runs are not all in yet has no point (the gains then run to the
    latest champion that has one). `latest`: the first baseline and only the latest that many
    champions (`status`: a year's are hundreds, each a few reads); the gains are the same.
    """
    from pipeline.api import Experiment

    exp = Experiment(lab, store)
    points = []
    champs = champions(records, briefs)
    promoted = len(champs) - 1 if champs else 0
    if latest is not None:
        champs = champs[:1] + champs[1:][-latest:] if latest > 0 else champs[:1]
    known = exp.standings([rev for _, rev, _ in champs])  # in one read each, not a few per champion
    for label, rev, hid in champs:
        st = known[rev]
        if isinstance(st, Exception):  # a tag deleted by hand, a commit not in this clone: no point for it
            log.warning("progress: %s (%s) left out: %s", label, rev, st)
            st = None
        if st is None:
            if label == "start":  # gains "since the first baseline" need the first baseline
                break
            continue
        points.append({"label": label, "hypothesis": hid, "commit": st["commit"][:10], "gate": st["gate"],
                       "holdout": st["holdout"], "runs": st["runs"]})
    sign = 1.0 if lab.config.benchmark.higher_is_better else -1.0
    out: dict[str, Any] = {"points": points, "gate_gain": None, "holdout_gain": None, "reuse_gap": None,
                           "oriented": "+ is better", "champions": promoted,
                           "champions_read": max(len(champs) - 1, 0)}
    for p in points:
        p["gate_gain"] = sign * (p["gate"] - points[0]["gate"])
        p["holdout_gain"] = (sign * (p["holdout"] - points[0]["holdout"])
                             if p["holdout"] is not None and points[0]["holdout"] is not None else None)
    if len(points) >= 2:  # the headline: the latest champion's gains
        last = points[-1]
        out["gate_gain"], out["holdout_gain"] = last["gate_gain"], last["holdout_gain"]
        if last["holdout_gain"] is not None:
            out["reuse_gap"] = last["gate_gain"] - last["holdout_gain"]
    return out
