"""The LLM policy through the real loop and graph, against a real HTTP server speaking OpenAI's protocol.

The openai SDK talks to `RoutedOpenAI` on 127.0.0.1 (scripted answers per requested object); the lab
is a real git repo with a real SQLite store; smoke runs and benchmark runs are real processes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.lab import (
    DUMMY_KEY,
    LR_EDIT,
    TASKS,
    RoutedOpenAI,
    cli,
    decision,
    edit,
    edits,
    git,
    make_loop,
    one_pass,
    proposal,
    set_research,
    user_texts,
)
from support.fake_openai import content, garbage

pytestmark = pytest.mark.system


def ledger_purposes(loop) -> list[str]:
    from agent.ledger import Ledger

    return [c.purpose for c in Ledger(loop.store.engine).calls()]


def test_a_whole_hypothesis_over_structured_output_and_no_key_reaches_any_stage(lab: Path, llm: RoutedOpenAI,
                                                                               tmp_path: Path) -> None:
    # the implementation prints every stage's environment (smoke run and benchmark runs) to its log:
    # in the sandbox, that is the one way out
    spy = ("import os as _os, json as _json\n"
           "print('ENVDUMP ' + _json.dumps(dict(_os.environ)))\n"
           "import argparse\n")
    llm.on("hypothesis", content(proposal()))
    llm.on("edits", content(edits(LR_EDIT, edit("train.py", "import argparse\n", spy), notes="lr up")))
    llm.on("decision", content(decision("abandon", "Not enough evidence for a promotion.")))

    loop = make_loop(lab, max_hypotheses=1, smoke=True)
    try:
        out = loop.run()
    finally:
        loop.close()

    assert out["started"] == 1
    assert loop.policy.name == "llm"
    h = loop.records.get(1)
    assert (h.status, h.decision, h.origin) == ("done", "abandon", "llm")
    assert h.title == proposal()["title"] and h.expected_tasks == TASKS and h.verdict
    assert h.rationale_decision == "Not enough evidence for a promotion."
    # structured output: every request asked for a json_schema object, and the key went only to the server
    for body in llm.requests:
        assert body["response_format"]["type"] == "json_schema" and "tools" not in body
    names = [b["response_format"]["json_schema"]["name"] for b in llm.requests]
    assert names[:3] == ["hypothesis", "edits", "decision"]
    assert all(hd["authorization"] == f"Bearer {DUMMY_KEY}" for hd in llm.request_headers)
    assert not llm.unscripted
    # the decision request carries the gate's verdict and only the choices it allows
    asked = llm.asked("decision")[0]
    allowed = asked["response_format"]["json_schema"]["schema"]["properties"]["decision"]["enum"]
    assert "abandon" in allowed and ("promote" in allowed) == (h.verdict == "improvement")
    assert f"Verdict: **{h.verdict}**" in user_texts(asked)
    # the experiment is a commit on its branch, tagged; the lab's checkout is untouched
    assert h.branch == "hyp/1-raise-the-fine-tuning-learning-rate"
    assert git(lab, "rev-parse", h.branch) == h.commit == git(lab, "rev-parse", "exp/1^{commit}")
    assert git(lab, "diff", "--name-only", h.base_commit, h.commit).split() == ["config.toml", "train.py"]
    assert "lr = 3e-3" in git(lab, "show", f"{h.commit}:config.toml")
    assert git(lab, "status", "--porcelain") == ""
    # every stage that ran the edited code — 2 smoke stages, 2 pretrainings, 4 fine-tunings — saw no key
    envs = [json.loads(line.removeprefix("ENVDUMP ")) for p in (lab / "runs" / "logs").rglob("*.log")
            for line in p.read_text().splitlines() if line.startswith("ENVDUMP ")]
    assert len(envs) >= 8
    for env in envs:
        assert DUMMY_KEY not in json.dumps(env)
        assert "OPENAI_API_KEY" not in env
    # every request and answer is in the ledger, and the spend shows in status
    assert ledger_purposes(loop)[:3] == ["propose", "implement", "decide"]
    from agent.commands import status

    st = status(lab, None)
    assert st["llm"]["spent_today_usd"] > 0
    assert st["hypotheses"][0]["decision"] == "abandon"


def test_an_endpoint_without_response_format_falls_back_to_a_forced_tool_call(lab: Path, llm: RoutedOpenAI) -> None:
    llm.supports_response_format = False
    llm.on("hypothesis", content(proposal()))
    llm.on("edits", content(edits(LR_EDIT)))
    loop = make_loop(lab)
    try:
        h = one_pass(loop)
    finally:
        loop.close()
    assert h.status == "measuring" and h.commit
    first, second, third = llm.requests
    assert "response_format" in first  # rejected with OpenAI's 400 error body
    assert second["tool_choice"] == {"type": "function", "function": {"name": "hypothesis"}}
    # the mode is learned: implement asks with a tool call straight away
    assert third["tool_choice"]["function"]["name"] == "edits" and "response_format" not in third
    assert loop.policy.client.mode == "tool"
    from agent.ledger import Ledger

    calls = Ledger(loop.store.engine).calls()
    assert [(c.mode, c.status_code) for c in calls] == [("json_schema", 400), ("tool", 200), ("tool", 200)]


def test_garbage_is_repaired_then_skipped_with_a_reason_and_bad_paths_are_rejected_and_recorded(
        lab: Path, llm: RoutedOpenAI) -> None:
    # hypothesis 1: three answers that are not JSON (one answer and two repair rounds)
    llm.on("hypothesis", garbage(), garbage("{not json"), garbage("I'd rather not."))
    # hypothesis 2: a fine proposal, then edits outside `editable`, escaping the lab, and to the harness
    llm.on("hypothesis", content(proposal("Tune the learning rate")))
    llm.on("edits", content(edits(edit("data.py", content_="x = 1\n"))),
           content(edits(edit("../escape.py", content_="print('out')\n"))),
           content(edits(edit("research.toml", "baseline_runs = 3", "baseline_runs = 1"))))
    before = {p.name for p in lab.parent.iterdir()}
    loop = make_loop(lab, max_hypotheses=2)
    try:
        out = loop.run()
    finally:
        loop.close()

    assert out["started"] == 2  # the loop went on after each rejection
    h1, h2 = loop.records.get(1), loop.records.get(2)
    assert (h1.status, h1.decision, h1.reject_kind) == ("done", "reject", "propose")
    assert "no valid hypothesis after 3 answer(s)" in h1.reject_reason
    repairs = llm.asked("hypothesis")[1:3]
    assert all("That answer could not be used" in user_texts(b) for b in repairs)
    assert (h2.status, h2.decision, h2.reject_kind) == ("done", "reject", "harness")
    for kind in ("outside_editable", "escapes_lab", "harness"):
        assert f"({kind})" in h2.reject_reason
    # each rejection was fed back for repair
    implement = llm.asked("edits")
    assert len(implement) == 3
    assert "rejected at the paths check" in user_texts(implement[1])
    assert "data.py: not editable" in user_texts(implement[1])
    assert "../escape.py: leaves the lab" in user_texts(implement[2])
    # nothing was written: no branch, no file outside the lab, research.toml as it was
    assert git(lab, "branch", "--list", "hyp/*") == ""
    assert {p.name for p in lab.parent.iterdir()} == before
    assert git(lab, "status", "--porcelain") == ""
    from agent.commands import status

    st = status(lab, None)
    assert [h["reject_kind"] for h in st["hypotheses"]] == ["propose", "harness"]
    assert st["rejected"] == {"harness": 1, "propose": 1}
    assert not llm.unscripted


def test_a_compile_error_then_a_failing_smoke_run_are_repaired(lab: Path, llm: RoutedOpenAI) -> None:
    llm.on("hypothesis", content(proposal()))
    broken = edit("train.py", "import argparse\n", "import argparse\ndef oops(:\n")
    crashes = edit("train.py", "import argparse\n",
                   "raise SystemExit('deliberately broken on tiny data')\nimport argparse\n")
    llm.on("edits", content(edits(LR_EDIT, broken)), content(edits(LR_EDIT, crashes)), content(edits(LR_EDIT)))
    loop = make_loop(lab, smoke=True)
    try:
        h = one_pass(loop)
    finally:
        loop.close()

    assert h.status == "measuring", h.reject_reason
    first, second, third = llm.asked("edits")
    assert "rejected at the compile check" in user_texts(second) and "SyntaxError" in user_texts(second)
    assert "repair round 1 of 2" in user_texts(second)
    # the conversation continues: the model sees the edits it sent before
    assert second["messages"][-2]["role"] == "assistant" and "def oops(:" in second["messages"][-2]["content"]
    assert "rejected at the smoke check" in user_texts(third)
    assert "deliberately broken on tiny data" in user_texts(third)
    assert git(lab, "diff", "--name-only", h.base_commit, h.commit).split() == ["config.toml"]
    assert h.look == 2 and len(loop.store.runs(commit=h.commit)) == 2 * len(TASKS)


def test_the_dollar_cap_stops_llm_calls_and_the_loop(lab: Path, llm: RoutedOpenAI) -> None:
    set_research(lab, "max_usd_per_day = 20", "max_usd_per_day = 0.25")
    # one answer billed at 1M prompt tokens (gpt-4.1-mini: $0.40) spends the day's budget
    llm.on("hypothesis", content(proposal(), usage=(1_000_000, 10)))
    llm.on("edits", content(edits(LR_EDIT)))
    llm.on("hypothesis", content(proposal("Another idea")))
    loop = make_loop(lab, max_hypotheses=3)
    try:
        out = loop.run()
    finally:
        loop.close()

    assert len(llm.requests) == 1  # nothing reached the server after the cap
    assert out["started"] == 1 and [h.id for h in loop.records.all()] == [1]
    h = loop.records.get(1)
    assert (h.decision, h.reject_kind) == ("reject", "budget")
    assert "LLM budget reached" in h.reject_reason
    from agent.commands import status

    st = status(lab, None)
    assert st["llm"]["spent_today_usd"] >= st["llm"]["cap_usd"] == 0.25
    assert [e["kind"] for e in st["events"]] == ["budget"]
    assert any("LLM budget reached" in s for s in loop.said)


def test_code_measured_before_is_refused_as_a_duplicate_without_runs_or_repair(lab: Path, llm: RoutedOpenAI) -> None:
    llm.on("hypothesis", content(proposal("Raise the LoRA learning rate")))
    llm.on("edits", content(edits(LR_EDIT)))
    # the same edit again, under other words: the same tree, so the same experiment
    llm.on("hypothesis", content(proposal("Adapters learn too slowly: speed them up")))
    llm.on("edits", content(edits(LR_EDIT)))
    loop = make_loop(lab)
    try:
        first = one_pass(loop)
        assert first.status == "measuring" and first.commit
        n_runs = len(loop.store.runs())
        second = one_pass(loop)
    finally:
        loop.close()
    assert (second.decision, second.reject_kind, second.commit) == ("reject", "duplicate", None)
    assert f"the same code as #{first.id}" in second.reject_reason
    assert len(llm.asked("edits")) == 2  # no repair round asked for: another wording would not help
    assert len(loop.store.runs()) == n_runs  # nothing queued for it
    assert git(lab, "branch", "--list", "hyp/*").split() == [first.branch]
    # the second proposal saw the first's direction (the config key its commit changed)
    asks = [user_texts(b) for b in llm.asked("hypothesis")]
    assert "## Directions tried\n\nnone yet" in asks[0]
    assert "- finetune.lr: 1 hypotheses (1 in flight), banked +0.000σ in 0 promotions" in asks[1], asks[1]


def test_a_model_on_a_slow_local_server_streams_into_the_loop_and_is_counted_in_tokens(
        lab: Path, llm: RoutedOpenAI) -> None:
    """A model without a price on a server writing 60 tokens/s: the proposal takes longer than the
    idle timeout allows for any one wait, arrives once, and the loop goes on to the edits; `status`
    shows tokens and the server's rate, no dollars, and a $0 dollar cap holds nothing back."""
    set_research(lab, 'model = "gpt-4.1-mini"', 'model = "gemma-3-270m"\nidle_timeout_s = 1\nrequest_timeout_s = 30')
    set_research(lab, "max_usd_per_day = 20", "max_usd_per_day = 0")  # would stop a priced model at once
    slow = {**proposal(), "rationale": "The adapters' learning rate was never tuned. " + "x" * 400}
    llm.on("hypothesis", content(slow, rate=60.0))
    llm.on("edits", content(edits(LR_EDIT)))
    loop = make_loop(lab)
    try:
        h = one_pass(loop)
    finally:
        loop.close()

    assert h.status == "measuring" and h.title == slow["title"]
    assert len(llm.asked("hypothesis")) == 1 and len(llm.asked("edits")) == 1  # each asked once
    from agent.commands import status
    from agent.ledger import Ledger
    from agent.views import llm_line

    propose = Ledger(loop.store.engine).calls(purpose="propose")[0]
    assert propose.latency_s > 2 > 1 and propose.usd == 0 and propose.completion_tokens > 120
    st = status(lab, None)["llm"]
    assert (st["model"], st["priced"], st["cap_usd"], st["spent_today_usd"]) == ("gemma-3-270m", False, None, 0)
    assert st["tokens_today"]["completion"] >= propose.completion_tokens
    assert 40 < st["rate"]["tokens_per_s"] < 70
    line = llm_line(st)
    assert "$" not in line and line.startswith("LLM use today: ") and "gemma-3-270m has no known price" in line
    assert "tokens/s" in line
    shown = cli(lab, "status").stdout  # what a user sees
    (spend,) = [x for x in shown.splitlines() if x.startswith("LLM ")]
    assert spend.startswith("LLM use today: ") and "$" not in spend and "no dollar cap" in spend
