"""A plateau: `[agent] plateau_after` measured hypotheses in a row without a promotion is an event
in `status` and the digest, is said to the LLM policy in its proposal prompt (from
prompts/phrases.toml), and with `run --pause-on-plateau` stops the loop. Real lab, real gate
records (summary_fixtures), the real loop, the real openai SDK against the fake server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.lab import RoutedOpenAI, cli, proposal, set_research, user_texts
from support.fake_openai import content
from support.summary import SAME, decided, implemented, measured, services

pytestmark = pytest.mark.system


def two_without_promotion(lab: Path):
    set_research(lab, "max_in_flight = 1", "max_in_flight = 1\nplateau_after = 2")
    svc = services(lab)
    for _ in range(2):
        h = decided(svc, measured(svc, implemented(svc), SAME))
        assert h.status == "done" and h.verdict and not h.promoted_tag
    return svc


def test_a_plateau_is_an_event_in_status_and_digest_and_pauses_the_loop(lab: Path) -> None:
    from agent.loop import Loop, LoopOptions

    svc = two_without_promotion(lab)
    assert svc.records.since_promotion() == 2
    said: list[str] = []
    loop = Loop(svc.lab, LoopOptions(offline=True, smoke=False, pause_on_plateau=True), progress=said.append)
    try:
        out = loop.run()
    finally:
        loop.close()
    assert out["stopped"] == "plateau" and out["this_run"] == []  # nothing new started
    assert any("plateau: 2 measured hypotheses in a row" in m for m in said)
    st = json.loads(cli(lab, "status", "--json").stdout)
    assert st["plateau"] == {"since_promotion": 2, "after": 2}
    assert [e["kind"] for e in st["events"]].count("plateau") == 1
    assert "plateau" in cli(lab, "status").stdout
    digest = cli(lab, "digest")
    assert "**plateau**: 2 measured hypotheses in a row" in digest.stdout, digest.stdout
    # a human seed is the new direction the pause asks for: with one queued, the loop does not stop
    assert cli(lab, "seed", "Try a different architecture", "--title", "New direction").returncode == 0
    again = Loop(svc.lab, LoopOptions(offline=True, smoke=False, pause_on_plateau=True), progress=said.append)
    try:
        assert again.plateau() is True and not again.stop.is_set()
    finally:
        again.close()


def test_the_llm_is_told_of_the_plateau_in_its_proposal_prompt(lab: Path, llm: RoutedOpenAI) -> None:
    from agent.graph import build_context
    from agent.policy import make_policy

    svc = two_without_promotion(lab)
    llm.on("hypothesis", content(proposal("Try a different mechanism")))
    policy = make_policy(svc.lab, svc.store, "llm")
    ctx = build_context(svc)
    assert ctx.plateau == 2
    assert policy.propose(ctx).title == "Try a different mechanism"
    (body,) = llm.asked("hypothesis")
    assert "The last 2 measured hypotheses in a row were not promoted" in user_texts(body)
    # below the threshold the prompt says nothing of it
    ctx.plateau = None
    llm.on("hypothesis", content(proposal("Another")))
    policy.propose(ctx)
    assert "plateau" not in user_texts(llm.asked("hypothesis")[-1]).lower()
