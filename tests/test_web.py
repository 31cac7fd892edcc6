"""`autoresearch serve` in a real headless Chromium (Debian's chromium and chromium-driver, driven by
selenium): open the overview of a lab with decided hypotheses, open a held one, post a comment,
approve the held promotion, let the loop run, see the new baseline — and the comment in the next
propose prompt the fake OpenAI server receives. The browser first opens the URL `serve` printed
(`?token=`), then its cookie serves every later page: on loopback too, a request without the token
gets 403, and the lab's token lives in runs/serve.token (0600, never through a link). A POST
without the CSRF token is refused; a non-loopback bind without a token refuses to start; errors are
pages. Real server process, real lab, real gate records (summary_fixtures), the real loop.

`AUTORESEARCH_SCREENSHOTS=DIR` keeps the overview and hypothesis screenshots there (docs/ has them).
"""

from __future__ import annotations

import http.client
import os
import shutil
import stat
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from support.lab import (RoutedOpenAI, Server, cli, cli_env, edit, edits, free_port, llm_env, proposal,
                            user_texts)
from support.fake_openai import content
from support.summary import BETTER, SAME, decided, implemented, measured, services

pytestmark = pytest.mark.system

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
    svc.experiment.smoke(held.commit, {}, hypothesis=str(held.id))  # these services skip smoke: one, for the books
    server = Server(lab).wait()
    try:
        browser.get(server.tokened)  # the URL `serve` printed: the token becomes a cookie, then a redirect
        assert browser.current_url == server.url + "/" and "token" not in browser.current_url
        assert [c["httpOnly"] for c in browser.get_cookies() if c["name"] == f"ar_token_{server.port}"] == [True]
        assert browser.find_element(By.ID, "lab").text == svc.lab.config.lab.name
        assert "autoresearch/baseline" in browser.find_element(By.ID, "baseline").text
        recent = browser.find_element(By.ID, "recent").text
        assert f"#{held.id}" in recent and f"#{other.id}" in recent
        assert browser.find_element(By.ID, "smoke").text.startswith("smoke runs: 1 (0 rejected), ")
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
        with pytest.raises(urllib.error.HTTPError) as e:  # the token's cookie, but no CSRF token
            urllib.request.urlopen(urllib.request.Request(f"{server.url}/hypotheses/{h.id}/review", data=data,
                                                          headers={"Cookie": server.cookie}))
        assert e.value.code == 403 and b"CSRF" in e.value.read()
        assert not svc.records.comments(h.id)  # nothing was written
        with pytest.raises(urllib.error.HTTPError) as e:  # DNS rebinding: another site's name for 127.0.0.1
            server.get(f"/hypotheses/{h.id}", headers={"Host": "evil.example:80"})
        assert e.value.code == 400
        page = server.get("/").read().decode()
        assert "postgresql" not in page and "sqlite" not in page and "OPENAI" not in page
        assert '<p id="environment">environment: CPython' in page  # where the lab measures (`pipeline.environment`)
    finally:
        server.stop()


def get_raw(port: int, path: str, cookie: str = "") -> tuple[int, dict[str, str], str]:
    """One GET, redirects not followed: (status, headers, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path, headers={"Cookie": cookie} if cookie else {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read().decode(errors="replace")
    finally:
        conn.close()


def test_on_loopback_a_token_is_required_and_kept_in_a_0600_file(lab: Path) -> None:
    svc = services(lab)
    h = decided(svc, measured(svc, implemented(svc), SAME))
    token_file = lab / "runs" / "serve.token"
    assert not token_file.exists()
    server = Server(lab).wait()  # loopback, no --token: the lab's own, made now
    try:
        assert f"token made and kept {token_file}, mode 0600" in server.log.read_text()
        st = token_file.lstat()
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
        assert token_file.read_text().strip() == server.token and len(server.token) >= 40
        for path, cookie in (("/", ""), (f"/hypotheses/{h.id}", ""), ("/?token=wrong-token-wrong-token", ""),
                             ("/", f"ar_token_{server.port}=wrong-token-wrong-token"),
                             ("/", f"ar_token_{server.port + 1}={server.token}")):  # another server's cookie
            status, _, body = get_raw(server.port, path, cookie)
            assert status == 403 and "needs its token" in body and svc.lab.config.lab.name not in body, (path, cookie)
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)  # a form POST without the token
        conn.request("POST", f"/hypotheses/{h.id}/review", body="csrf=c&action=comment&comment=no+token",
                     headers={"Content-Type": "application/x-www-form-urlencoded", "Cookie": "ar_csrf=c",
                              "Origin": server.url})
        assert conn.getresponse().status == 403
        conn.close()
        assert not svc.records.comments(h.id)
        status, headers, _ = get_raw(server.port, f"/hypotheses?review=pending&token={server.token}")
        assert status == 303 and headers["location"] == "/hypotheses?review=pending"  # the token leaves the URL
        set_cookie = headers["set-cookie"]
        assert set_cookie.startswith(f"ar_token_{server.port}={server.token};") and "HttpOnly" in set_cookie
        assert "SameSite=strict" in set_cookie
        status, _, body = get_raw(server.port, f"/hypotheses/{h.id}", server.cookie)
        assert status == 200 and f"#{h.id}" in body
    finally:
        server.stop()
    again = Server(lab).wait()  # a restart reuses the file's token
    try:
        assert again.token == server.token and "token read from" in again.log.read_text()
        assert get_raw(again.port, "/", again.cookie)[0] == 200
    finally:
        again.stop()


def test_the_token_file_is_never_followed_through_a_link_nor_taken_when_others_can_read_it(lab: Path,
                                                                                          tmp_path: Path) -> None:
    token_file = lab / "runs" / "serve.token"
    token_file.parent.mkdir(exist_ok=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("x" * 43 + "\n")
    elsewhere.chmod(0o600)
    token_file.symlink_to(elsewhere)  # e.g. planted to read a token someone else made, or to write one there
    out = cli(lab, "serve", "--port", str(free_port()), timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "serve.token: a symlink; not read" in out.stderr
    assert elsewhere.read_text() == "x" * 43 + "\n" and token_file.is_symlink()
    token_file.unlink()
    dangling = tmp_path / "made-through-a-link"
    token_file.symlink_to(dangling)  # a dangling link: serve must not create its target
    out = cli(lab, "serve", "--port", str(free_port()), timeout=60)
    assert out.returncode == 2 and "a symlink" in out.stderr and not dangling.exists()
    token_file.unlink()
    token_file.write_text("y" * 43 + "\n")
    token_file.chmod(0o644)  # readable by other users: not a secret any more
    out = cli(lab, "serve", "--port", str(free_port()), timeout=60)
    assert out.returncode == 2 and "mode 0644; expected ours and 0600" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_off_loopback_a_token_is_required(lab: Path) -> None:
    port = free_port()
    refused = cli(lab, "serve", "--host", "0.0.0.0", "--port", str(port))
    assert refused.returncode == 2 and "not loopback" in refused.stderr and "Traceback" not in refused.stderr
    short = cli(lab, "serve", "--host", "0.0.0.0", "--port", str(port), "--token", "abc")
    assert short.returncode == 2 and "--token: expected 16 to 512" in short.stderr
    server = Server(lab, "--host", "0.0.0.0", "--generate-token").wait()
    try:
        assert server.token == (lab / "runs" / "serve.token").read_text().strip()  # the lab's own
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(server.url + "/")
        assert e.value.code == 403
        status, headers, _ = get_raw(server.port, f"/?token={server.token}")
        assert status == 303 and headers["location"] == "/"
        assert server.get("/").status == 200
    finally:
        server.stop()
    given = Server(lab, "--host", "0.0.0.0", "--token", "a-token-the-team-chose").wait()
    try:
        assert given.token == "a-token-the-team-chose"
        assert given.get("/").status == 200
    finally:
        given.stop()


def test_the_overview_lists_the_latest_baselines_in_order_and_the_timeline_every_one(lab: Path) -> None:
    """A year of promotions is hundreds of baseline tags: the overview (redrawn every 10 s) lists the
    latest, by number (v10 after v9, not after v1), and points to the timeline for the rest."""
    import re
    import subprocess

    from agent.web import OVERVIEW_BASELINES

    n = OVERVIEW_BASELINES + 3
    for k in range(1, n + 1):
        subprocess.run(["git", "tag", "-f", f"baseline/v{k}", "autoresearch/baseline"], cwd=lab, check=True,
                       capture_output=True)
    server = Server(lab).wait()
    try:
        page = server.get("/").read().decode()
    finally:
        server.stop()
    listed = [int(t) for t in re.findall(r"<td>baseline/v(\d+)</td>", page)]
    assert listed == list(range(n, n - OVERVIEW_BASELINES, -1))  # newest first, by number
    assert f"the latest {OVERVIEW_BASELINES} of {n} baselines" in page and 'href="/timeline"' in page


def test_a_page_that_takes_long_to_make_refreshes_less_often(lab: Path, monkeypatch) -> None:
    """An open overview refreshes every 10 s; a page that took t s to make (a year-old lab's status)
    refreshes after REFRESH_COST × t s instead, so one open tab keeps the server busy a tenth of the
    time at most; the time is in the Server-Timing header."""
    import math
    import re

    from starlette.testclient import TestClient

    from agent import web

    def refresh_and_took(resp) -> tuple[int, float]:
        assert resp.status_code == 200
        took = float(resp.headers["server-timing"].split("dur=")[1])
        return int(re.search(r'http-equiv="refresh" content="(\d+)"', resp.text).group(1)), took

    with TestClient(web.make_app(lab, None, "tok"), base_url="http://127.0.0.1") as client:
        refresh, took = refresh_and_took(client.get("/?token=tok"))
        assert refresh == max(10, math.ceil(took / 1000 * web.REFRESH_COST))
        monkeypatch.setattr(web, "REFRESH_COST", 1_000_000)  # as if the page were slow
        refresh, took = refresh_and_took(client.get("/"))
        assert refresh == math.ceil(took / 1000 * 1_000_000) > 10
