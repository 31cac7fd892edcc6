"""Renderings of a look: table, Markdown, JSON; no "significant" wording between looks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.gate import evaluate, render_markdown, render_text

pytestmark = pytest.mark.unit


def data(m: int, effect: float = 0.03) -> dict:
    rng = np.random.default_rng(9)
    tasks = []
    for j in range(6):
        b = list(0.8 + 0.01 * rng.standard_normal(5))
        c = list(0.8 + effect + 0.01 * rng.standard_normal(m))
        tasks.append({"task": f"t{j}", "baseline": b, "challenger": c, "history": b})
    return {"tasks": tasks}


def test_renderings_at_a_look_carry_the_numbers():
    r = evaluate(data(5))
    md, text = render_markdown(r), render_text(r)
    assert f"verdict: {r.verdict.value}" in md and f"verdict: {r.verdict.value}" in text
    for t in r.tasks:
        assert t.task in md and f"{t.delta:+.4f}" in md
    assert "horizontal" in md and "boundary" in md and "runs used: 30 baseline, 30 challenger" in md
    assert "next look at 10 runs" in md
    json.dumps(r.to_json(), allow_nan=False)


def test_between_looks_renderings_have_no_significance_labels():
    r = evaluate(data(4, effect=0.05))
    for out in (render_markdown(r), render_text(r)):
        low = out.lower()
        assert "between looks" in low
        for word in ("significant", "win", "harm", "improvement", "verdict:"):
            assert word not in low
    assert "significant" not in json.dumps(r.to_json()).lower()
