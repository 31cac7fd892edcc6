"""`autoresearch digest`: what was tried, promoted, abandoned; baseline progress; compute, goodput, LLM
spend; what awaits review; the progress chart. Plus one real loop end to end: summaries, pictures,
digest and `report --md` from a real `autoresearch run` on a tiny lab.
"""

from __future__ import annotations

import json
import time

import pytest
from support.fake_openai import content
from support.summary import BETTER, SAME, cli, decided, implemented, make_lab, measured, run_loop, services

from agent.ledger import Ledger
from agent.llm import LLMClient
from agent.pictures import forest_path, progress_path
from agent.policy_llm import LLMPolicy
from agent.records import Hypothesis
from agent.summary import summary_path

pytestmark = pytest.mark.system


def backdate(svc, hid: int, seconds: float) -> None:
    """Move a hypothesis's timestamps `seconds` into the past (`records.update` stamps updated_at now)."""
    with svc.store.session() as s:
        h = s.get(Hypothesis, hid)
        t = time.time() - seconds
        if h.finished_at is not None:
            h.finished_at = t
        h.updated_at = t
        s.add(h)
        s.commit()


def test_digest_of_a_day(tmp_path, fake_openai):
    root = make_lab(tmp_path / "lab")
    svc = services(root)
    promoted = decided(svc, measured(svc, implemented(svc), BETTER))
    old = decided(svc, measured(svc, implemented(svc), SAME, baseline=BETTER))
    svc.records.update(old.id, finished_at=time.time() - 3 * 86400, updated_at=time.time() - 3 * 86400)

    # one summary by the LLM: its spend shows in the digest
    llm = LLMPolicy(LLMClient("gpt-4.1-mini", Ledger(svc.store.engine), **fake_openai.client_kwargs()))
    fake_openai.script(content({"tried": "The learning rate was changed.", "interpretation": "Nothing moved.",
                                "follow_ups": []}, usage=(100_000, 20_000)))
    abandoned = decided(svc, measured(svc, implemented(svc), BETTER, baseline=BETTER), summary_policy=llm)
    assert abandoned.summary_author == "llm" and abandoned.decision == "abandon"

    svc.supervised = True
    held = decided(svc, measured(svc, implemented(svc), {k: [v + 0.1 for v in vs] for k, vs in BETTER.items()},
                                 baseline=BETTER))
    assert held.status == "held"
    rejected = svc.records.add(Hypothesis(title="(search space exhausted)", status="summarizing", decision="reject",
                                          reject_kind="exhausted"))
    decided(svc, rejected)

    d = json.loads(cli(root, "digest", "--since", "24h", "--json").stdout)
    assert [p["id"] for p in d["promoted"]] == [promoted.id] and d["promoted"][0]["tag"] == "baseline/v1"
    assert [a["id"] for a in d["abandoned"]] == [abandoned.id]  # the 3-day-old one is outside the window
    assert [r["id"] for r in d["rejected"]] == [rejected.id]
    assert [h["id"] for h in d["held"]] == [held.id]
    assert set(d["awaiting_review"]) == {promoted.id, old.id, abandoned.id, held.id, rejected.id}
    assert d["llm_usd"] == pytest.approx(0.072, abs=1e-4)  # 100k in, 20k out at gpt-4.1-mini's prices
    base = d["baseline"]
    assert base["tag"] == "baseline/v1"
    assert [p["id"] for p in base["promotions"]] == [promoted.id] and base["promotions"][0]["horizontal_delta"] > 0
    assert base["level_now"] > base["level_start"]
    assert d["progress_chart"] == str(progress_path(svc.lab)) and progress_path(svc.lab).is_file()
    assert set(d["compute"]) >= {"useful_cpu_s", "goodput", "saved_by_cache_cpu_s"}

    md = cli(root, "digest", "--since", "24h").stdout
    assert f"- promoted: 1\n  - #{promoted.id} {promoted.title} (baseline/v1)" in md
    assert f"- abandoned: 1\n  - #{abandoned.id} {abandoned.title} (" in md
    assert "- baseline: baseline/v1, mean auc over tasks" in md and f"#{promoted.id} → baseline/v1: horizontal Δ +" in md
    assert "- LLM spend: $0.0720" in md
    assert f"- held for approval (promotion waits for `autoresearch review ID --approve`): #{held.id}" in md
    assert f"Progress chart: {progress_path(svc.lab)}" in md
    assert "goodput" in md

    # the window of the last second holds none of them: each was decided a minute "ago"
    for h in (promoted, abandoned, held, rejected):
        backdate(svc, h.id, 60)
    narrow = json.loads(cli(root, "digest", "--since", "1s", "--json").stdout)
    assert narrow["promoted"] == narrow["abandoned"] == [] and narrow["baseline"]["promotions"] == []
    assert cli(root, "digest", "--since", "yesterday", check=False).returncode == 2


def test_a_real_loop_leaves_summaries_pictures_and_a_digest(tmp_path):
    root = make_lab(tmp_path / "lab")
    proc = run_loop(root, 2)
    assert json.loads(proc.stdout)["started"] == 2, proc.stderr
    svc = services(root)
    hyps = svc.records.all()
    assert len(hyps) == 2 and all(h.status == "done" for h in hyps), [(h.id, h.status) for h in hyps]
    for h in hyps:
        assert h.summary_author == "template" and h.review == "pending"
        text = summary_path(svc.lab, h.id).read_text()
        assert text == h.summary_md and f"# Hypothesis {h.id}: {h.title}" in text
        if h.verdict:  # measured: the gate's table and the forest plot beside it
            assert "| default_90d |" in text and "| churn_60d |" in text
            assert forest_path(svc.lab, h.id).stat().st_size > 10_000
            assert f"![task deltas]({h.id}.forest.png)" in text
    assert progress_path(svc.lab).stat().st_size > 10_000

    md = cli(root, "digest").stdout
    assert "- hypotheses touched: 2" in md and "awaiting review: #1, #2" in md
    assert f"Progress chart: {progress_path(svc.lab)}" in md
    # the screening and the harness calls, booked apart from goodput: both smoke-run, every run scored
    assert "- smoke runs: 2 (0 rejected), " in md and "- scoring and preparing data: " in md, md
    measured_ids = [h.id for h in hyps if h.verdict]
    if measured_ids:
        report = cli(root, "report", str(measured_ids[0]), "--md").stdout
        assert f"]({forest_path(svc.lab, measured_ids[0])})" in report
    listed = cli(root, "review").stdout.splitlines()
    assert [line.split()[0] for line in listed] == ["1", "2"]
