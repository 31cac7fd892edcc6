"""The review page's views of issue 23 in a real headless Chromium: the per-seed picture on a
hypothesis page, the directions table, the compare page and the baseline's timeline.

The lab (tests/support/views.py): three hypotheses decided by the real loop on planted runs, no
training; one promotion (re-verified, with holdout scores), two hypotheses on `finetune.lr` and one on
`finetune.lora_rank`, the last a refinement of the one before (so its page links to the compare page).

`AUTORESEARCH_SCREENSHOTS=DIR` keeps the screenshots (docs/ has them).
"""

from __future__ import annotations

import urllib.error

import pytest

from support.lab import Server
from support.views import build_views_lab
from test_web import browser, shot  # noqa: F401  (the fixture, reused)

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def views_lab(lab_template, tmp_path_factory) -> dict:
    return build_views_lab(lab_template, tmp_path_factory.mktemp("views") / "lab")


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
