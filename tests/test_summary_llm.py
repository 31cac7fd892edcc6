"""Summaries: the LLM writes the prose, the gate's record the numbers; an altered number is rejected.

The LLM is the real client against the fake OpenAI server (tests/support/fake_openai.py); the hypothesis is
a real branch in a real lab with the gate's real record (tests/support/summary.py).
"""

from __future__ import annotations

import pytest
from support.fake_openai import content, server_error
from support.summary import BETTER, SAME, decided, implemented, make_lab, measured, services

from agent.ledger import Ledger
from agent.llm import LLMClient
from agent.policy_llm import LLMPolicy
from agent.summary import allowed_numbers, foreign_numbers, latest_result, numbers_in, summary_path
from pipeline.gate import render_markdown

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def lab(tmp_path):
    return make_lab(tmp_path / "lab")


def llm_services(root, server, **kw):
    svc = services(root)
    client = LLMClient("gpt-4.1-mini", Ledger(svc.store.engine), **server.client_kwargs(), backoff_s=0.001,
                       timeout_s=5, **kw)
    svc.policy = LLMPolicy(client)
    return svc


def abandoned(svc):
    """A measured hypothesis with no effect, decided by the offline rules (abandon), not yet summarized."""
    from agent.graph import Nodes
    from agent.policy_offline import OfflinePolicy

    h = measured(svc, implemented(svc), SAME)
    llm, svc.policy = svc.policy, OfflinePolicy()
    Nodes(svc).decide({"hypothesis_id": h.id})
    svc.policy = llm
    return svc.records.get(h.id)


def summarized(svc, h):
    """The graph's summarize node, with the LLM policy."""
    from agent.graph import Nodes

    Nodes(svc).summarize({"hypothesis_id": h.id})
    return svc.records.get(h.id)


# ----------------------------------------------------------------------------- the rule itself

def test_numbers_in_reads_numbers_not_identifiers():
    text = ("On default_90d and churn_60d (baseline/v2, #3, gpt-4.1-mini, hyp/1-set) Δ was −0.0230 "
            "[-0.2435, +0.1974], p 1.10e-04, 95% interval, +10.167σ with 3 runs; lr 3e-4.")
    got = [(q.text, q.value, q.integer) for q in numbers_in(text)]
    assert got == [("−0.0230", -0.023, False), ("-0.2435", -0.2435, False), ("+0.1974", 0.1974, False),
                   ("1.10e-04", pytest.approx(1.1e-4), False), ("95%", 0.95, False),
                   ("+10.167", 10.167, False), ("3", 3.0, True), ("3e-4", pytest.approx(3e-4), False)]


def test_tolerant_matching_and_rejection():
    from support.summary import gate_result

    r = gate_result(BETTER, 2)
    allowed = allowed_numbers(r, [render_markdown(r)])
    d = r.tasks[0].delta  # +0.1050
    ok = (f"Δ {d:+.4f}, about {d:.2f}, or {d * 100:.1f}%; p {r.tasks[0].p:.3f}; CI upper {r.tasks[0].ci_high:.3f}; "
          f"horizontal {r.horizontal.delta:.1f}σ; {r.look} challenger runs per task, {r.baseline_runs_used} baseline "
          f"runs; both 2 tasks; a 95% interval; dropped sign -{d:.3f}")
    assert foreign_numbers(ok, allowed) == []
    assert foreign_numbers(f"Δ {d + 0.2:+.4f} on default_90d", allowed) == [f"{d + 0.2:+.4f}"]
    assert foreign_numbers("it used 7 runs", allowed) == ["7"]  # counts must be exact
    assert foreign_numbers("t was 12.7", allowed) == []  # rounding of t 12.72
    assert foreign_numbers("a gain of 41.3%", allowed) == ["41.3%"]


# ----------------------------------------------------------------------------- LLM-written summaries

def test_llm_prose_with_the_gates_numbers_is_used(lab, fake_openai):
    svc = llm_services(lab, fake_openai)
    h = abandoned(svc)
    r = latest_result(svc, h)
    d0 = r.tasks[0].delta
    answer = {
        "tried": "The offline search changed the fine-tuning learning rate in config.toml.",
        "interpretation": f"default_90d moved by {d0:+.4f}, well inside its interval; the gate called it "
                          f"{h.verdict} at look {h.look}.",
        "follow_ups": ["Try a larger LoRA rank instead.", "Revisit with more customers."],
    }
    fake_openai.script(content(answer))
    assert summarized(svc, h).summary_author == "llm"
    text = summary_path(svc.lab, h.id).read_text()
    assert answer["interpretation"] in text and answer["tried"] in text
    assert "- Try a larger LoRA rank instead." in text
    assert render_markdown(r).strip() in text  # the evidence is the gate's table, inserted by code
    assert "the LLM (gpt-4.1-mini)" in text
    # the model was shown the gate's table and asked for the three fields
    sent = fake_openai.requests[-1]
    prompt = sent["messages"][-1]["content"]
    assert render_markdown(r).strip() in prompt and "follow_ups" in prompt
    assert sent["response_format"]["json_schema"]["name"] == "summary"


def test_llm_answer_altering_a_number_is_rejected(lab, fake_openai):
    svc = llm_services(lab, fake_openai)
    h = abandoned(svc)
    r = latest_result(svc, h)
    true_delta = r.tasks[0].delta
    altered = f"{true_delta + 0.0871:+.4f}"
    fake_openai.script(content({
        "tried": "The offline search changed the fine-tuning learning rate.",
        "interpretation": f"default_90d improved by {altered}, a clear gain.",
        "follow_ups": [],
    }))
    h = summarized(svc, h)
    text = summary_path(svc.lab, h.id).read_text()
    assert h.summary_author == "template"
    assert altered not in text.replace(f"it quoted {altered}", "")  # only in the note that says why
    assert f"the LLM's prose was rejected: it quoted {altered}" in text
    assert "a clear gain" not in text
    assert f"{true_delta:+.4f}" in text  # the gate's number stands
    assert "The offline policy changed config.toml" in text  # the template's prose replaced it
    events = [e.message for e in svc.records.events(10) if e.kind == "summary"]
    assert any(altered in m and "rejected" in m for m in events)


def test_follow_up_with_an_invented_number_is_dropped(lab, fake_openai):
    svc = llm_services(lab, fake_openai)
    h = abandoned(svc)
    fake_openai.script(content({
        "tried": "The learning rate in config.toml was changed.",
        "interpretation": "No task moved beyond its interval.",
        "follow_ups": ["Set the learning rate to 0.0427.", "Try the PIX source."],
    }))
    h = summarized(svc, h)
    text = summary_path(svc.lab, h.id).read_text()
    assert h.summary_author == "llm"
    assert "0.0427" not in text and "- Try the PIX source." in text
    assert "1 follow-up(s) quoting numbers not given to it dropped" in text


def test_endpoint_failure_falls_back_to_the_template(lab, fake_openai):
    svc = llm_services(lab, fake_openai, max_attempts=1)
    h = abandoned(svc)
    fake_openai.script(server_error(503))
    h = summarized(svc, h)
    text = summary_path(svc.lab, h.id).read_text()
    assert h.summary_author == "template" and h.status == "done"
    assert "the LLM gave no summary: LLMUnavailable" in text
    assert "## Evidence" in text and "| default_90d |" in text


def test_offline_summary_is_template_written(lab):
    svc = services(lab)
    h = decided(svc, measured(svc, implemented(svc), SAME))
    assert h.summary_author == "template" and h.summary_md == summary_path(svc.lab, h.id).read_text()
    assert "Prose by:** the templates" in h.summary_md
    assert "Tasks the gate flags as wins: none" in h.summary_md
