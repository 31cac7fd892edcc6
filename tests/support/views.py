"""A lab with decided hypotheses and their runs, for the review page's views and the MLflow export.

The tiny lab of tests/support/lab.py; no model is trained: hypotheses are seeded with real edits of
config.toml, implemented, queued and decided by the real loop (offline policy), and their runs are
finished through the store's claim/finish API with chosen values (test_agent_decide's `plant`), so
every number comes from real gate records. #1 raises the fine-tuning lr and is promoted (baseline/v1),
then re-verified on its fresh seeds, with holdout scores for both champions (0.610, then 0.630); #2
changes the same key (`finetune.lr`) and #3 another (`finetune.lora_rank`), both abandoned; #3 is
recorded as a refinement of #2 (`parent_id`).
"""

from __future__ import annotations

import json
from pathlib import Path

from support.lab import copy_lab, make_loop, one_pass
from test_agent_decide import plant

BASE = [0.600, 0.604, 0.598]
BETTER = [0.700, 0.703, 0.698]
LR_TASK_SHIFT = {"churn_60d": 0.05}


def seed(lab: Path, name: str, title: str, search: str, replace: str) -> None:
    from agent.commands import seed as seed_cmd

    spec = lab.parent / f"{name}.json"
    spec.write_text(json.dumps({"title": title, "rationale": "planted for the page's views",
                                "edits": [{"path": "config.toml", "search": search, "replace": replace}]}))
    seed_cmd(lab, None, None, None, 10, None, spec)


def decide(loop, base_values: list[float], chal_values: list[float]):
    """The next hypothesis through the real graph, its runs planted look by look until it is decided."""
    h = one_pass(loop)
    assert h.status == "measuring", h.reject_reason
    for _ in range(4):
        plant(loop.store, h.base_commit, base_values, LR_TASK_SHIFT)
        plant(loop.store, h.commit, chal_values, LR_TASK_SHIFT)
        h = loop.advance(h)
        if h.status != "measuring":
            return h
    raise AssertionError(f"#{h.id} still measuring")


def build_views_lab(template: Path, dst: Path) -> dict:
    """A copy of the tiny lab with three decided hypotheses (see the module doc): {"lab", "ids"}."""
    lab = copy_lab(template, dst)
    seed(lab, "lr", "Fine-tune with lr 3e-3", "lr = 3e-4", "lr = 3e-3")
    loop = make_loop(lab, offline=True)
    try:
        h1 = decide(loop, BASE, BETTER)
        assert (h1.decision, h1.promoted_tag) == ("promote", "baseline/v1")
        plant(loop.store, h1.commit, [0.690, 0.695, 0.688], LR_TASK_SHIFT)  # the champion's fresh seeds
        for commit, value, own in ((h1.base_commit, 0.610, (0, 1, 2)), (h1.commit, 0.630, (1000, 1001, 1002))):
            for r in loop.store.runs(commit=commit):
                if r.seed in own:
                    loop.store.holdout_put(r.id, r.commit, r.task, r.seed, value)
        loop.note_reverifications()
        assert loop.store.gate_records(str(h1.id), kind="reverify")
        seed(lab, "lr2", "Fine-tune with lr 1e-3", "lr = 3e-3", "lr = 1e-3")
        h2 = decide(loop, [0.690, 0.695, 0.688], [0.689, 0.696, 0.687])
        seed(lab, "rank", "LoRA rank 16", "lora_rank = 4 ", "lora_rank = 16 ")
        h3 = decide(loop, [0.690, 0.695, 0.688], [0.600, 0.601, 0.602])
        loop.records.update(h3.id, parent_id=h2.id)
    finally:
        loop.close()
    assert h2.decision != "promote" and h3.decision != "promote", (h2.decision, h3.decision)
    return {"lab": lab, "ids": (h1.id, h2.id, h3.id)}
