"""The review page's views of issue 23 in a real headless Chromium: the per-seed picture on a
hypothesis page, the directions table, the compare page and the baseline's timeline.

The lab is the tiny one of tests/test_web.py; no model is trained: hypotheses are seeded with real
edits of config.toml, implemented, queued and decided by the real loop (offline policy), and their
runs are finished through the store's claim/finish API with chosen values (test_agent_decide's
`plant`), so every number on the pages comes from real gate records. One promotion (baseline/v1,
re-verified on its fresh seeds, with holdout scores for both champions), then two more hypotheses on
the same key (`finetune.lr`) and one on another (`finetune.lora_rank`); the last is recorded as a
refinement of the one before (`parent_id`), so the hypothesis page links to the compare page.

`AUTORESEARCH_SCREENSHOTS=DIR` keeps the screenshots (docs/ has them).
"""

from __future__ import annotations

import json
import urllib.error
from pathlib import Path

import pytest

from agent_fixtures import Server, make_loop, one_pass
from test_agent_decide import plant
from test_web import browser, shot  # noqa: F401  (the fixture, reused)

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


@pytest.fixture(scope="module")
def views_lab(lab_template, tmp_path_factory) -> dict:
    from agent_fixtures import copy_lab

    lab = copy_lab(lab_template, tmp_path_factory.mktemp("views") / "lab")
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


def test_the_four_views_in_a_browser(views_lab: dict, browser) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By

    lab, (h1, h2, h3) = views_lab["lab"], views_lab["ids"]
    server = Server(lab).wait()
    try:
        browser.get(server.tokened)

        # per-seed view: a picture drawn from the store's runs, on the hypothesis page
        browser.get(f"{server.url}/hypotheses/{h1}")
        img = browser.find_element(By.ID, "seeds")
        assert img.get_attribute("src").endswith(f"/files/{h1}.seeds.png")
        assert browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth", img) > 0
        assert all(browser.execute_script("return arguments[0].naturalWidth", i) > 0
                   for i in browser.find_elements(By.TAG_NAME, "img"))
        browser.execute_script("arguments[0].scrollIntoView()", img)
        shot(browser, "seeds.png")

        # directions: grouped by the config key each commit changed
        browser.get(f"{server.url}/directions")
        rows = {r.find_element(By.CLASS_NAME, "key").text: r.text
                for r in browser.find_elements(By.CSS_SELECTOR, "#directions tr.direction")}
        assert set(rows) == {"finetune.lr", "finetune.lora_rank"}, rows
        assert f"#{h1}" in rows["finetune.lr"] and f"#{h2}" in rows["finetune.lr"]
        assert f"#{h3}" in rows["finetune.lora_rank"] and f"#{h1}" not in rows["finetune.lora_rank"]
        shot(browser, "directions.png")

        # compare: reached from the refinement's link to its parent; both diffs, both histories
        browser.get(f"{server.url}/hypotheses/{h3}")
        browser.find_element(By.LINK_TEXT, f"parent #{h2}").click()
        assert "/compare?a=" in browser.current_url
        d1, d2 = browser.find_element(By.ID, "diff-1").text, browser.find_element(By.ID, "diff-2").text
        assert d1.startswith("diff --git") and d2.startswith("diff --git")
        assert "lr = 1e-3" in d1 and "lora_rank = 16" in d2  # the parent first
        assert browser.find_element(By.ID, "looks-1").text.count("\n") >= 1
        assert browser.find_element(By.ID, "looks-2").text.count("\n") >= 1
        assert "churn_60d" in browser.find_element(By.ID, "tasks").text
        shot(browser, "compare.png")

        # timeline: the promotion, its gate gain with interval, holdout gain, re-verification
        browser.get(f"{server.url}/timeline")
        rows = browser.find_elements(By.CSS_SELECTOR, "#timeline tr.promotion")
        assert len(rows) == 1
        text = rows[0].text
        assert "baseline/v1" in text and f"#{h1}" in text and "fresh seeds" in text and "[" in text
        assert "+0.0200" in text  # the holdout step: 0.630 - 0.610
        shot(browser, "timeline.png")

        # bad input is a page, never a traceback
        for path, code, words in ((f"/compare?a={h1}&b=999", 404, "no hypothesis 999"),
                                  ("/compare?a=x&b=1", 400, "two hypothesis ids"),
                                  ("/files/999.seeds.png", 404, "no hypothesis 999")):
            with pytest.raises(urllib.error.HTTPError) as e:
                server.get(path)
            body = e.value.read().decode()
            assert e.value.code == code and words in body and "Traceback" not in body, (path, body[-500:])
        browser.get(f"{server.url}/compare")
        assert browser.find_element(By.ID, "a") is not None  # the picker
    finally:
        server.stop()
