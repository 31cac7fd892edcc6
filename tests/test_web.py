"""`autoresearch serve` in a real headless Chromium (Debian's chromium and chromium-driver, driven by
selenium): open the overview of a lab with decided hypotheses, open a held one, post a comment,
approve the held promotion, let the loop run, see the new baseline — and the comment in the next
propose prompt the fake OpenAI server receives. A POST without the CSRF token is refused; a
non-loopback bind without a token refuses to start; errors are pages. Real server process, real
lab, real gate records (summary_fixtures), the real loop.

`AUTORESEARCH_SCREENSHOTS=DIR` keeps the overview and hypothesis screenshots there (docs/ has them).
"""

from __future__ import annotations

import os
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from agent_fixtures import (RoutedOpenAI, Server, cli, cli_env, edit, edits, free_port, llm_env, proposal,
                            user_texts)
from fake_openai import content
from summary_fixtures import BETTER, SAME, decided, implemented, measured, services

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
if not (CHROMIUM and CHROMEDRIVER):
    if os.environ.get("CI"):
        raise RuntimeError("CI needs Debian's chromium and chromium-driver (.ci/run installs them)")
    # platform limit: no browser on this machine; CI installs one and fails above instead of skipping
    pytest.skip("chromium and chromedriver are not installed", allow_module_level=True)

COMMENT = "Try a larger LoRA rank next, the adapters look starved"




@pytest.fixture
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1700",
                "--disable-gpu"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def wait_text(driver, element_id: str, ok, timeout: float = 20) -> None:
    """Until the element (on the page the last click led to) has text that `ok` accepts."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, timeout, ignored_exceptions=(StaleElementReferenceException, NoSuchElementException)).until(
        lambda d: ok(d.find_element(By.ID, element_id).text))


def shot(driver, name: str) -> None:
    where = os.environ.get("AUTORESEARCH_SCREENSHOTS")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(where) / name))


def test_review_in_a_browser_steers_the_loop(lab: Path, llm: RoutedOpenAI, browser) -> None:
    from selenium.webdriver.common.by import By

    svc = services(lab, supervised=True)
    held = decided(svc, measured(svc, implemented(svc), BETTER))
    other = decided(svc, measured(svc, implemented(svc), SAME))
    assert held.status == "held" and other.status == "done"
    server = Server(lab).wait()
    try:
        browser.get(server.url + "/")
        assert browser.find_element(By.ID, "lab").text == svc.lab.config.lab.name
        assert "autoresearch/baseline" in browser.find_element(By.ID, "baseline").text
        recent = browser.find_element(By.ID, "recent").text
        assert f"#{held.id}" in recent and f"#{other.id}" in recent
        shot(browser, "overview.png")

        browser.find_element(By.LINK_TEXT, f"#{held.id}").click()
        assert browser.find_element(By.ID, "status").text == "held"
        assert browser.find_element(By.ID, "tasks").text.count("\n") >= 2  # the per-task table
        assert browser.find_element(By.ID, "diff").text.startswith("diff --git")
        pictures = [i.get_attribute("src") for i in browser.find_elements(By.TAG_NAME, "img")]
        assert any(src.endswith(f"/files/{held.id}.forest.png") for src in pictures), pictures
        assert all(browser.execute_script("return arguments[0].naturalWidth", i) > 0
                   for i in browser.find_elements(By.TAG_NAME, "img"))  # every picture loads
        shot(browser, "hypothesis.png")

        browser.find_element(By.ID, "comment").send_keys(COMMENT)
        browser.find_element(By.ID, "do-comment").click()
        wait_text(browser, "comments", lambda t: COMMENT in t)  # the POST, its redirect, the new page
        browser.find_element(By.ID, "do-approve").click()
        wait_text(browser, "review", lambda t: t == "approved")

        # the loop: releases the approved hold (promotion), then proposes with the comment in its prompt
        llm.on("hypothesis", content(proposal("Raise the LoRA rank")))
        outside = content(edits(edit("data.py", content_="x = 1\n")))
        llm.on("edits", outside, outside, outside)
        run = cli(lab, "run", "--max-hypotheses", "1", "--supervised", env=cli_env(**llm_env(llm)))
        assert run.returncode == 0, run.stderr[-3000:]
        (ask,) = llm.asked("hypothesis")
        assert COMMENT in user_texts(ask)

        browser.get(server.url + "/")
        assert "baseline/v1" in browser.find_element(By.ID, "baseline").text
        browser.get(server.url + f"/hypotheses/{held.id}")
        assert browser.find_element(By.ID, "decision").text == "promote"
        browser.get(server.url + "/hypotheses?review=pending")
        assert f"#{held.id}" not in browser.find_element(By.ID, "hypotheses").text
        browser.get(server.url + "/hypotheses/999")
        assert "no hypothesis 999" in browser.find_element(By.ID, "error").text
        assert "Traceback" not in browser.page_source
    finally:
        server.stop()


def test_a_post_without_the_csrf_token_is_refused(lab: Path) -> None:
    svc = services(lab)
    h = decided(svc, measured(svc, implemented(svc), SAME))
    server = Server(lab).wait()
    try:
        data = urllib.parse.urlencode({"action": "comment", "comment": "forged"}).encode()
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(f"{server.url}/hypotheses/{h.id}/review", data=data))
        assert e.value.code == 403 and b"CSRF" in e.value.read()
        assert not svc.records.comments(h.id)  # nothing was written
        rebound = urllib.request.Request(f"{server.url}/hypotheses/{h.id}", headers={"Host": "evil.example:80"})
        with pytest.raises(urllib.error.HTTPError) as e:  # DNS rebinding: another site's name for 127.0.0.1
            urllib.request.urlopen(rebound)
        assert e.value.code == 400
        page = urllib.request.urlopen(f"{server.url}/").read().decode()
        assert "postgresql" not in page and "sqlite" not in page and "OPENAI" not in page
    finally:
        server.stop()


def test_off_loopback_a_token_is_required(lab: Path) -> None:
    port = free_port()
    refused = cli(lab, "serve", "--host", "0.0.0.0", "--port", str(port))
    assert refused.returncode == 2 and "not loopback" in refused.stderr and "Traceback" not in refused.stderr
    server = Server(lab, "--host", "0.0.0.0", "--generate-token").wait()
    try:
        deadline = time.monotonic() + 10
        while "token=" not in server.log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        token = server.log.read_text().split("token=")[1].split()[0]
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(server.url + "/")
        assert e.value.code == 401
        assert urllib.request.urlopen(f"{server.url}/?token={token}").status == 200
    finally:
        server.stop()
