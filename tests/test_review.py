"""Human review: listing, approve/reject/comment through the real CLI, comments in the next
proposal's prompt, and supervised holds released by the loop once approved.

A real lab (git repo, SQLite store), the real graph nodes, the console entry point in a subprocess,
and the LLM through the real client against the fake OpenAI server.
"""

from __future__ import annotations

import json

import git
import pytest
from support.fake_openai import content
from support.summary import BETTER, SAME, cli, decided, implemented, make_lab, measured, services

from agent.graph import Nodes
from agent.ledger import Ledger
from agent.llm import LLMClient
from agent.loop import Loop, LoopOptions
from agent.policy_llm import LLMPolicy
from agent.records import ACTIVE, Hypothesis
from agent.summary import summary_path
from pipeline.lab import BASELINE_BRANCH

pytestmark = pytest.mark.system


@pytest.fixture
def lab(tmp_path):
    return make_lab(tmp_path / "lab")


def test_review_lists_pending_and_records_actions(lab):
    svc = services(lab)
    a = decided(svc, measured(svc, implemented(svc), SAME))
    b = decided(svc, measured(svc, implemented(svc), SAME))
    assert a.review == b.review == "pending"

    out = cli(lab, "review").stdout.splitlines()
    assert [line.split()[0] for line in out] == [str(a.id), str(b.id)]
    assert str(summary_path(svc.lab, a.id)) in out[0] and a.title in out[0]

    got = json.loads(cli(lab, "review", str(a.id), "--approve", "--comment", "clean result, keep the lr").stdout)
    assert got["review"] == "approved"
    got = json.loads(cli(lab, "review", str(b.id), "--reject").stdout)
    assert got["review"] == "rejected"
    empty = cli(lab, "review")
    assert empty.stdout.strip() == "" and "nothing awaits review" in empty.stderr

    cli(lab, "review", str(b.id), "--comment", "the LoRA rank idea deserves a second try")
    actions = [(c.hypothesis_id, c.action, c.text) for c in reversed(svc.records.comments())]
    assert actions == [(a.id, "comment", "clean result, keep the lr"), (a.id, "approve", "clean result, keep the lr"),
                       (b.id, "reject", ""), (b.id, "comment", "the LoRA rank idea deserves a second try")]
    assert svc.records.get(b.id).review == "rejected"

    # bad input is one line and exit code 2
    for args in ((str(a.id), "--approve"), ("999", "--comment", "x")):
        proc = cli(lab, "review", *args, check=False)
        assert proc.returncode == 2 and proc.stderr.startswith("error:"), (args, proc.stderr)


def test_a_review_comment_reaches_the_next_proposal_prompt(lab, fake_openai):
    svc = services(lab)
    done = decided(svc, measured(svc, implemented(svc), SAME))
    comment = "Stop tuning the learning rate; the PIX source is where the signal is."
    cli(lab, "review", str(done.id), "--reject", "--comment", comment)

    client = LLMClient("gpt-4.1-mini", Ledger(svc.store.engine), **fake_openai.client_kwargs(), backoff_s=0.001)
    svc.policy = LLMPolicy(client)
    fake_openai.script(content({"title": "Read the PIX source", "rationale": "The reviewer asked for it.",
                                "expected_effect": "+0.01 AUC on churn tasks", "tasks_expected": ["churn_60d"],
                                "change": "add pix to data.sources"}))
    h = svc.records.add(Hypothesis(status="proposing", origin="llm"))
    Nodes(svc).propose({"hypothesis_id": h.id})

    assert svc.records.get(h.id).title == "Read the PIX source"
    prompt = fake_openai.requests[-1]["messages"][-1]["content"]
    comments = prompt[prompt.index("## Reviewers' comments"):]
    assert f"on #{done.id} (comment): {comment}" in comments


def _baseline(root) -> str:
    return git.Repo(root).commit(BASELINE_BRANCH).hexsha


def test_supervised_holds_a_promotion_until_approved(lab):
    svc = services(lab, supervised=True)
    before = _baseline(lab)
    h = measured(svc, implemented(svc), BETTER)
    assert h.verdict == "improvement"

    h = decided(svc, h)
    assert (h.status, h.decision, h.review) == ("held", "hold", "pending")
    assert _baseline(lab) == before and h.promoted_tag is None
    assert "held for a human's approval" in summary_path(svc.lab, h.id).read_text()
    assert [p.split()[0] for p in cli(lab, "review").stdout.splitlines()] == [str(h.id)]

    # the rest of the loop goes on: the held hypothesis takes no in-flight slot, a new one starts
    loop = Loop(svc.lab, LoopOptions(offline=True, supervised=True, smoke=False))
    assert h.id not in [x.id for x in loop.records.all(ACTIVE)]
    nxt = loop.next_hypothesis()
    Nodes(loop.svc).propose({"hypothesis_id": nxt.id})
    assert loop.records.get(nxt.id).status == "implementing" and loop.records.get(nxt.id).title != h.title
    loop.release_holds()  # not approved yet: nothing moves
    assert loop.records.get(h.id).status == "held" and _baseline(lab) == before

    cli(lab, "review", str(h.id), "--approve", "--comment", "nice")
    loop.release_holds()
    h = loop.records.get(h.id)
    assert (h.status, h.decision, h.promoted_tag) == ("done", "promote", "baseline/v1")
    repo = git.Repo(lab)
    assert _baseline(lab) == h.commit == repo.tags["baseline/v1"].commit.hexsha
    assert repo.tags[f"exp/{h.id}"].commit.hexsha == h.commit
    # the new champion re-verifies: fresh baseline runs are queued for it
    assert len(loop.store.runs(commit=h.commit)) >= 3 * 2
    text = summary_path(svc.lab, h.id).read_text()
    assert "promote (verdict: improvement), now `baseline/v1`" in text


def test_a_rejected_hold_is_abandoned_and_the_baseline_stays(lab):
    svc = services(lab, supervised=True)
    before = _baseline(lab)
    h = decided(svc, measured(svc, implemented(svc), BETTER))
    assert h.status == "held"
    cli(lab, "review", str(h.id), "--reject", "--comment", "the gain is implausible")
    Loop(svc.lab, LoopOptions(offline=True, supervised=True, smoke=False)).release_holds()
    h = svc.records.get(h.id)
    assert (h.status, h.decision, h.promoted_tag) == ("done", "abandon", None)
    assert _baseline(lab) == before and "baseline/v1" not in [t.name for t in git.Repo(lab).tags]


def test_an_approval_given_before_the_replication_says_it_waits_for_it(lab):
    """A held promotion with a replication is not asked yet (review none, not listed); an approval
    given meanwhile is kept, and the CLI says the promotion still waits for its replication."""
    svc = services(lab)
    waiting, asked = (svc.records.add(Hypothesis(title=t, origin="human")) for t in ("waiting", "asked"))
    svc.records.update(waiting.id, status="held", decision="hold", review="none")
    svc.records.update(asked.id, status="held", decision="hold", review="pending")
    assert [line.split()[0] for line in cli(lab, "review").stdout.splitlines()] == [str(asked.id)]
    got = json.loads(cli(lab, "review", str(waiting.id), "--approve").stdout)
    assert got["review"] == "approved" and "if its replication passes" in got["note"], got
    got = json.loads(cli(lab, "review", str(asked.id), "--approve").stdout)
    assert got["note"] == "the running loop promotes it at its next pass", got
