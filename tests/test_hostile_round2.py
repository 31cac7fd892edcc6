"""Hostile branches, round two (issue 20): what a branch, or the LLM that wrote it, can put in front
of the driver and the review page. Every string it writes is hostile. Real server process (`Server`
from agent_fixtures), real HTTP requests, real stage subprocesses, real files; no mocks.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import pytest
from support.lab import REPO, Server
from support.summary import BETTER, decided, implemented, measured, services

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def post(server: Server, path: str, fields: dict[str, str], headers: dict[str, str]) -> tuple[int, str]:
    """One POST as a browser (or another site's page) would send it, with the server's token cookie
    beside any cookie in `headers` (the browser holds it once the printed URL was opened; a forged
    cross-site POST carries it too); redirects are not followed."""
    cookie = "; ".join(filter(None, [headers.get("Cookie"), server.cookie]))
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("POST", path, body=urllib.parse.urlencode(fields),
                     headers={"Content-Type": "application/x-www-form-urlencoded", **headers, "Cookie": cookie})
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


# ----------------------------------------------------------------------------- CSRF: Origin check

def test_a_post_from_another_origin_with_a_planted_csrf_cookie_is_refused(lab: Path) -> None:
    svc = services(lab, supervised=True)
    held = decided(svc, measured(svc, implemented(svc), BETTER))
    assert held.status == "held" and held.review == "pending"
    server = Server(lab).wait()
    try:
        planted = {"Cookie": "ar_csrf=planted-by-another-port"}  # cookies ignore ports: any local page can set one
        form = {"csrf": "planted-by-another-port", "action": "approve"}
        path = f"/hypotheses/{held.id}/review"
        for foreign in ({"Origin": "http://evil.example"}, {"Origin": "null"},
                        {"Origin": f"http://127.0.0.1:{server.port + 1}"},  # another port of the same host
                        {"Referer": "http://evil.example/page"}, {}):  # no Origin: the Referer decides; neither: no
            status, body = post(server, path, form, {**planted, **foreign})
            assert status == 403, (foreign, status)
            assert "Origin" in body and "Traceback" not in body, body
        assert svc.records.get(held.id).review == "pending" and not svc.records.comments(held.id)  # nothing recorded

        status, _ = post(server, path, form, {**planted, "Origin": server.url})  # the page's own form
        assert status == 303
        assert svc.records.get(held.id).review == "approved"
        assert [c.action for c in svc.records.comments(held.id)] == ["approve"]
        status, _ = post(server, path, {**form, "action": "comment", "comment": "via a same-origin Referer"},
                         {**planted, "Referer": f"{server.url}/hypotheses/{held.id}"})
        assert status == 303
    finally:
        server.stop()


# ----------------------------------------------------------------------------- untrusted strings on the page

BEACON = "![t](http://127.0.0.1:9/track.png)"
HOSTILE = (f"{BEACON} <script>alert(1)</script> [approve](javascript:alert(2)) "
           "![d](data:image/png;base64,AAAA) <http://127.0.0.1:9/auto> [ref][r]\n\n[r]: http://127.0.0.1:9/ref")


class Tags(HTMLParser):
    """Every element the page would make live: its tag and attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, {k: v or "" for k, v in attrs}))


def test_branch_and_llm_strings_are_inert_on_the_review_page(lab: Path) -> None:
    from agent.graph import Nodes

    svc = services(lab)
    h = implemented(svc)
    svc.records.update(h.id, title=f"Faster {BEACON} <script>alert(0)</script>", rationale=HOSTILE,
                       follow_up=f"see {BEACON}", status="summarizing", decision="reject", reject_kind="smoke",
                       reject_reason=f"smoke run failed (exit 1); stderr tail:\n```\n{HOSTILE}\n```\n{BEACON}")
    Nodes(svc).summarize({"hypothesis_id": h.id})
    svc.records.comment(h.id, "comment", f"<script>alert(3)</script> {BEACON}")
    server = Server(lab).wait()
    try:
        html = server.get(f"/hypotheses/{h.id}").read().decode()
    finally:
        server.stop()
    parser = Tags()
    parser.feed(html)
    assert "track.png" in html and "alert(1)" in html  # the strings are shown, as text
    assert not [t for t, _ in parser.tags if t in ("script", "iframe", "object", "embed")]
    for tag, attrs in parser.tags:
        for name in ("src", "href"):
            url = attrs.get(name, "")
            assert not url or (url.startswith("/") and not url.startswith("//")), (tag, attrs)  # same origin only
    assert all(a.get("src", "").startswith("/files/") for t, a in parser.tags if t == "img")


# ----------------------------------------------------------------------------- the stage environment: an allow-list

SECRETS = {"MYSQL_PWD": "hunter2", "PGPASS": "pg-secret", "REDIS_URL": "redis://:redis-secret@cache:6379/0",
           "SERVICE_URL": "https://svc:pa/ss-secret@svc.example/api"}  # all passed the old deny-list

PROBE = """import json, os, sys
with open('/proc/self/environ', 'rb') as fh:  # the warm worker's own environment, which a fork inherits
    initial = [e.split(b'=', 1)[0].decode() for e in fh.read().split(b'\\0') if e]
json.dump({"env": dict(os.environ), "initial": initial}, open(sys.argv[1], "w"))
"""


def test_a_stage_sees_only_the_allow_list_and_the_labs_run_env(tmp_path: Path, monkeypatch) -> None:
    from pipeline.executors import StageJob
    from pipeline.executors.base import lab_env
    from pipeline.executors.local import LocalExecutor
    from pipeline.lab import LabConfigError, parse_config

    template = (REPO / "pipeline" / "templates" / "command" / "research.toml").read_text()
    run = parse_config(template.replace("[run]", '[run]\nenv = ["STAGE_VISIBLE"]', 1)).run
    assert run.env == ("STAGE_VISIBLE",)
    for bad in ('"STAGE_VISIBLE"', "[1]", '["A B"]', '["AUTORESEARCH_DB"]'):  # one line each, no traceback
        with pytest.raises(LabConfigError, match=r"^research.toml: run.env: [^\n]+$"):
            parse_config(template.replace("[run]", f"[run]\nenv = {bad}", 1))

    for name, value in {**SECRETS, "STAGE_VISIBLE": "yes", "UNLISTED": "no"}.items():
        monkeypatch.setenv(name, value)
    (tmp_path / "probe.py").write_text(PROBE)
    with LocalExecutor(preload=(), slots=1) as ex:
        for name, argv in (("py", ["python", "probe.py", str(tmp_path / "py.json")]),  # forked from the warm worker
                           ("sh", ["sh", "-c", f"env > {tmp_path}/sh.env"])):  # exec'd
            ex.submit(StageJob(job_id=name, argv=argv, cwd=tmp_path, commit="0" * 40, out=tmp_path,
                               log_path=tmp_path / f"{name}.log", timeout_s=30, env=lab_env(run.env)))
            deadline, done = time.monotonic() + 30, []
            while not done and time.monotonic() < deadline:
                done = ex.poll(0.5)
            assert [r.status for r in done] == ["ok"], (tmp_path / f"{name}.log").read_text()
    py = json.loads((tmp_path / "py.json").read_text())
    sh = dict(line.split("=", 1) for line in (tmp_path / "sh.env").read_text().splitlines() if "=" in line)
    for env in (py["env"], sh):
        assert env["STAGE_VISIBLE"] == "yes" and "PATH" in env and env["OMP_NUM_THREADS"] == "1"
        assert not set(env) & {*SECRETS, "UNLISTED"}, sorted(env)
        assert not [v for v in env.values() if "secret" in v or "hunter2" in v]
    assert not set(py["initial"]) & {*SECRETS, "UNLISTED"}, py["initial"]


# ----------------------------------------------------------------------------- limits that hold: smoke timeout

def test_a_smoke_stage_is_stopped_at_the_labs_timeout_not_at_300_s(lab: Path) -> None:
    from pipeline.errors import MethodFailure
    from pipeline.lab import load_lab
    from pipeline.smoke import SMOKE_TIMEOUT_S, smoke_run, smoke_timeout

    research = lab / "research.toml"
    research.write_text(research.read_text().replace("timeout_s = 900", "timeout_s = 3", 1))
    the_lab = load_lab(lab)
    assert smoke_timeout(the_lab) == 3 and SMOKE_TIMEOUT_S < 900  # a long lab limit is capped for smoke
    started = time.monotonic()
    with pytest.raises(MethodFailure, match=r"stage pretrain timed out after 3 s"):
        smoke_run(the_lab, "autoresearch/baseline", {"train.py": "import time\ntime.sleep(600)\n"})
    assert time.monotonic() - started < 150  # not the old hard-coded 300 s (a 3 s limit; slack for loaded cores)


# ----------------------------------------------------------------------------- bounded reads

BIG = 20 << 20  # a 20 MB log


def test_a_log_tail_is_read_with_a_seek_not_whole(tmp_path: Path) -> None:
    import tracemalloc

    from pipeline.disk import read_tail

    log = tmp_path / "stage.log"
    with open(log, "wb") as fh:
        fh.write(b"early line\n" * (BIG // 11))
        fh.write(b"the last words\n")
    tracemalloc.start()
    try:
        text, size = read_tail(log, 3000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert size > BIG - 16 and len(text) == 3000 and text.endswith("the last words\n")
    assert peak < 200_000, peak  # the old read_text()[-3000:] held all 20 MB
    (tmp_path / "link.log").symlink_to(log)
    assert read_tail(tmp_path / "link.log", 3000) == ("", 0)  # never through a link


def test_a_smoke_stage_that_floods_its_log_gives_a_bounded_reason(lab: Path) -> None:
    from pipeline.errors import MethodFailure
    from pipeline.lab import load_lab
    from pipeline.smoke import TAIL_BYTES, smoke_run

    flood = "import sys\nfor _ in range(2 << 10):\n    sys.stderr.write('x' * 10239 + '\\n')\nsys.exit(3)\n"
    with pytest.raises(MethodFailure) as e:
        smoke_run(load_lab(lab), "autoresearch/baseline", {"train.py": flood})
    assert "stage pretrain exited with 3" in str(e.value) and len(str(e.value)) < TAIL_BYTES + 200
    (log,) = (lab / "runs" / "logs" / "smoke").glob("*/pretrain.log")
    assert log.stat().st_size >= BIG  # 20 MB written, 3 KB quoted


def test_the_log_page_serves_only_the_last_2_mb_with_a_notice(lab: Path) -> None:
    from support.lab import BASELINE

    from pipeline import experiment

    svc = services(lab)
    log = svc.lab.state / "logs" / "big" / "finetune.log"
    log.parent.mkdir(parents=True)
    with open(log, "wb") as fh:
        fh.write(b"a line of a chatty stage\n" * (BIG // 25))
        fh.write(b"Traceback: the error at the end\n")
    (run_id,) = experiment.ensure_runs(svc.store, svc.lab, BASELINE, ["default_90d"], [0])
    eid = svc.store.stage_started(run_id, "finetune", "k" * 16, executor="local", log_path=str(log))
    server = Server(lab).wait()
    try:
        with server.get(f"/logs/{eid}") as resp:
            body = resp.read().decode()
    finally:
        server.stop()
    first, _, rest = body.partition("\n")
    assert len(body.encode()) <= (2 << 20) + 200 and first == "[the log is 20 MB: its last 2 MB follow]"
    assert rest.startswith("a line of a chatty stage\n") and body.endswith("Traceback: the error at the end\n")


def test_a_huge_diff_is_shown_as_its_stat(lab: Path) -> None:
    from support.lab import BASELINE, git, make_branch

    from agent.records import Hypothesis

    padding = "".join(f"# committed data row {i:06d} " + "z" * 40 + "\n" for i in range(8000))  # ~500 KB
    commit = make_branch(lab, "exp/huge", [("config.toml", "max_events = 8", "max_events = 8\n" + padding)])
    svc = services(lab)
    h = svc.records.add(Hypothesis(status="done", origin="human", title="a committed data file", commit=commit,
                                   base_commit=git(lab, "rev-parse", BASELINE), branch="exp/huge"))
    server = Server(lab).wait()
    try:
        page = server.get(f"/hypotheses/{h.id}").read().decode()
    finally:
        server.stop()
    assert len(page) < 100_000 and "committed data row" not in page
    assert "over 256 KB: its summary only" in page and "config.toml | 800" in page and "1 file changed" in page
