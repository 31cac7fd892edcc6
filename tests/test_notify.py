"""Notifications (`[notify]`, `run --notify`): every event delivered once per target, through an outbox
in the store that survives `kill -9`, a sender that never blocks the loop or changes its decisions.

Everything is real: the loop on a numpy lab (`autoresearch init --harness command`, no torch), the
store, an HTTP server on 127.0.0.1 (http.server in a thread) and an SMTP server (aiosmtpd) with
login; `autoresearch run` as a subprocess killed with SIGKILL.
"""

from __future__ import annotations

import email
import json
import socket
import sqlite3
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.system,
              pytest.mark.filterwarnings("ignore:Requiring AUTH while not requiring TLS:UserWarning")]
from support.lab import RunProcess, Server, cli, cli_env, free_port, git

from agent.config import agent_config
from agent.labinit import init_lab

BASELINE = "autoresearch/baseline"
ALL_KINDS = {"hold", "promote", "abandon", "plateau", "llm_down", "llm_up", "guard", "takeover", "disk", "digest"}
SMTP_PASSWORD = "s3cret-smtp-pw-9d1e"


class Hook:
    """A webhook receiver on 127.0.0.1. Per path: `ok` answers 200, `fail` 500, `echo` 500 with its
    path in the reason phrase (an error quoting the URL), `hang` holds the request past any client
    timeout; `flaky` answers 200 to its first `flaky_ok` requests, then 500 until `heal()`. Every
    request is recorded with the status it got (None: hung)."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.flaky_ok, self.healed, self.release = 1, False, threading.Event()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                mode = self.path.strip("/").split("/")[0]
                with hook.lock:
                    n_flaky = sum(1 for r in hook.requests if r["mode"] == "flaky")
                    status: int | None = 200
                    if mode in ("fail", "echo") or (mode == "flaky" and not hook.healed and n_flaky >= hook.flaky_ok):
                        status = 500
                    elif mode == "hang":
                        status = None
                    elif mode == "redirect":
                        status = 302
                    hook.requests.append({"mode": mode, "status": status, "body": body,
                                          "idem": self.headers.get("Idempotency-Key"), "at": time.time()})
                if status is None:
                    hook.release.wait(10)
                    return
                self.send_response(status, f"boom at {self.path}" if mode == "echo" else None)
                if status == 302:  # to another path of this server: a follower would GET it
                    self.send_header("Location", f"{hook.url}/ok/landed")
                self.end_headers()
                self.wfile.write(b"ok" if status == 200 else b"boom")

            def do_GET(self) -> None:  # noqa: N802  (a redirect followed: recorded, then 200)
                with hook.lock:
                    hook.requests.append({"mode": "get:" + self.path, "status": 200, "body": None,
                                          "idem": self.headers.get("Idempotency-Key"), "at": time.time()})
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def heal(self) -> None:
        with self.lock:
            self.healed = True

    def got(self, mode: str, status: int | None = 200) -> list[dict[str, Any]]:
        with self.lock:
            return [r for r in self.requests if r["mode"] == mode and r["status"] == status]

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


class Mailbox:
    """aiosmtpd on 127.0.0.1 with AUTH LOGIN/PLAIN (the password from the test's environment)."""

    def __init__(self) -> None:
        from aiosmtpd.controller import Controller
        from aiosmtpd.smtp import AuthResult

        self.messages: list[email.message.Message] = []
        self.logins: list[tuple[str, str]] = []
        box = self

        class Handler:
            async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:  # noqa: N802
                box.messages.append(email.message_from_bytes(envelope.content))
                return "250 OK"

        def auth(server: Any, session: Any, envelope: Any, mechanism: str, data: Any) -> Any:
            login, password = data.login.decode(), data.password.decode()
            box.logins.append((login, password))
            return AuthResult(success=(login, password) == ("bot", SMTP_PASSWORD))

        self.port = free_port()
        self.controller = Controller(Handler(), hostname="127.0.0.1", port=self.port, authenticator=auth,
                                     auth_require_tls=False, auth_required=True)
        self.controller.start()

    def close(self) -> None:
        self.controller.stop()


@pytest.fixture
def hook():
    h = Hook()
    yield h
    h.close()


@pytest.fixture
def mailbox():
    m = Mailbox()
    yield m
    m.close()


def command_lab(root: Path, research_extra: str, run_extra: str = "", agent_extra: str = "") -> Path:
    """The numpy lab of `autoresearch init --harness command`, research.toml extended, committed."""
    init_lab(root, harness="command")
    path = root / "research.toml"
    text = path.read_text()
    if run_extra:
        text = text.replace("network = false", "network = false\n" + run_extra)
    if agent_extra:
        text = text.replace('model = "gpt-4.1-mini"', 'model = "gpt-4.1-mini"\n' + agent_extra)
    path.write_text(text + "\n" + research_extra)
    git(root, "commit", "-qam", "notify settings")
    git(root, "branch", "-f", BASELINE, "HEAD")
    return root


def make_loop(root: Path, **opts: Any):
    from agent.loop import Loop, LoopOptions
    from pipeline.api import ExecutorOptions, load_lab

    said: list[str] = []
    loop = Loop(load_lab(root), LoopOptions(**{"offline": True, "smoke": False, "executor": ExecutorOptions(workers=2),
                                               **opts}),
                progress=said.append)
    loop.said = said  # type: ignore[attr-defined]
    return loop


def outbox(root: Path) -> list[dict[str, Any]]:
    db = root / "runs" / "autoresearch.db"
    try:
        con = sqlite3.connect(db, timeout=30)
        con.row_factory = sqlite3.Row
        return [dict(r) for r in con.execute("SELECT * FROM notify_outbox ORDER BY id")]
    except sqlite3.OperationalError:
        return []


def a_dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


# ----------------------------------------------------------------------------- bad config

def test_bad_notify_config_is_one_line_and_exit_2_through_the_cli(tmp_path: Path) -> None:
    root = init_lab(tmp_path / "lab", harness="command")
    good = (root / "research.toml").read_text()
    cases = [
        ("[notify]\nsend_to = 1", "research.toml: notify.send_to: unknown key"),
        ('[notify]\ndigest_at = "8am"', 'research.toml: notify.digest_at: expected a local time "HH:MM"'),
        ('[notify]\nevents = ["hold", "lunch"]', "research.toml: notify.events: expected an event among"),
        ('[[notify.target]]\nkind = "webhook"', "notify.target[0]: expected exactly one of url or url_env"),
        ('[[notify.target]]\nkind = "email"\nsmtp_host = "127.0.0.1"', "expected at least one address in to"),
        ('[[notify.target]]\nkind = "slack"\nurl = "ftp://x/T0K3N"', "notify.target[0].url: expected an http://"),
        ('[notify]\nmax_attempts = 0', "notify.max_attempts: expected input should be greater than or equal to 1"),
    ]
    for extra, said in cases:
        (root / "research.toml").write_text(good + "\n" + extra)
        for args in (("check",), ("run", "--offline", "--max-hypotheses", "1")):
            out = cli(root, *args)
            assert out.returncode == 2, (extra, out.stderr)
            assert said in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
            assert "Traceback" not in out.stderr and "T0K3N" not in out.stderr
    (root / "research.toml").write_text(good)
    # a --notify URL that is none of the three forms; a secret's variable that is not set
    out = cli(root, "run", "--offline", "--notify", "ftp://127.0.0.1/x")
    assert out.returncode == 2 and out.stderr.startswith("error: --notify: an unknown scheme"), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    out = cli(root, "run", "--offline", "--notify", "smtp://bot:pw@127.0.0.1:25?to=a@b.c")
    assert out.returncode == 2 and "no password in the URL" in out.stderr and "Traceback" not in out.stderr
    (root / "research.toml").write_text(good + '\n[[notify.target]]\nkind = "email"\nsmtp_host = "127.0.0.1"\n'
                                        'to = ["a@b.c"]\nusername = "bot"\npassword_env = "NOTIFY_TEST_UNSET"\n')
    out = cli(root, "run", "--offline", "--max-hypotheses", "1")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == ("error: [notify] e-mail target 127.0.0.1: password_env NOTIFY_TEST_UNSET is not set in "
                                  "the environment"), out.stderr
    st = json.loads(cli(root, "status", "--json").stdout)
    assert st["driver"] is None  # the refused run left the lab free


# ----------------------------------------------------------------------------- every event, once per target

def test_each_event_is_delivered_once_to_each_target(tmp_path: Path, hook: Hook, mailbox: Mailbox,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import agent.notify as notify
    from agent.errors import LLMUnavailable
    from agent.graph import Nodes
    from agent.lifecycle import Decision
    from agent.records import Hypothesis
    from agent.verdicts import DecisionRecord
    from pipeline import lease
    from pipeline.store import Owner

    monkeypatch.setattr(notify, "DISK_CHECK_S", 0.5)
    monkeypatch.setenv("NOTIFY_SMTP_PASSWORD", SMTP_PASSWORD)
    monkeypatch.setenv("NOTIFY_SLACK_URL", f"{hook.url}/ok/slack/T0K3N")
    root = command_lab(tmp_path / "lab", f"""
[notify]
web_url = "http://review.example:8765/"
digest_at = "00:00"
backoff_s = 0.2

[[notify.target]]
kind = "webhook"
name = "ops-json"
url = "{hook.url}/ok/json"

[[notify.target]]
kind = "slack"
url_env = "NOTIFY_SLACK_URL"

[[notify.target]]
kind = "email"
smtp_host = "127.0.0.1"
smtp_port = {mailbox.port}
starttls = false
username = "bot"
password_env = "NOTIFY_SMTP_PASSWORD"
from = "loop@lab.example"
to = ["team@lab.example"]
""", run_extra="cache_max_gb = 0.000001", agent_extra="plateau_after = 1")

    # a hold (supervised), the digest (00:00 has passed today), the cache over 90 % of its cap
    loop = make_loop(root, supervised=True, max_hypotheses=1)
    try:
        out = loop.run()
    finally:
        loop.close()
    assert [(r["id"], r["decision"]) for r in out["this_run"]] == [(1, "hold")], loop.said

    # a driver that died holding the lab: the next loop takes over
    rec = loop.records
    lease.acquire(loop.store, Owner(socket.gethostname(), a_dead_pid(), 0.0))
    rec.decide_review(1, "approved")
    loop = make_loop(root, max_hypotheses=0)
    try:
        loop.run()  # releases the approved hold: a promotion (and starts nothing new)
        assert rec.get(1).promoted_tag
        # an abandon after an escalation (look 5 > the first look), through the graph's own decide node
        h = rec.add(Hypothesis(title="Planted: escalated and futile", status="deciding", look=5, verdict="futile",
                               origin="human", base_commit=rec.get(1).commit))
        rec.put_decision(h.id, DecisionRecord(5, Decision.ABANDON, "futile at look 5"))
        Nodes(loop.svc).decide({"hypothesis_id": h.id})
        assert rec.get(h.id).decision == "abandon"
        rec.update(h.id, status="done", finished_at=time.time())
        assert loop.plateau()  # plateau_after = 1 measured hypothesis without a promotion
        # three rejections in a row: the guard holds proposals back
        for i in range(3):
            rec.add(Hypothesis(title=f"Planted reject {i}", status="done", decision="reject",
                               reject_kind="smoke_failed", origin="offline", finished_at=time.time()))
        loop.guard()
        assert loop.guard_holds()
        # the LLM down, then back
        waiting = rec.add(Hypothesis(title="Planted: waits for the LLM", status="done", origin="llm"))
        loop._llm_failed(waiting, LLMUnavailable("propose", 2, "connection refused"))
        loop._llm_back()
    finally:
        loop.close()

    rows = outbox(root)
    kinds = {r["kind"] for r in rows}
    assert kinds == ALL_KINDS, kinds
    assert all(r["state"] == "sent" for r in rows), [(r["key"], r["target"], r["state"], r["last_error"]) for r in rows]
    json_posts = [r for r in hook.got("ok") if "event" in r["body"]]
    slack_posts = [r for r in hook.got("ok") if "event" not in r["body"]]
    # each event exactly once per target
    assert sorted(p["body"]["event"] for p in json_posts) == sorted(ALL_KINDS)
    assert len(slack_posts) == len(ALL_KINDS) and all(set(p["body"]) == {"text"} for p in slack_posts)
    assert len({p["idem"] for p in slack_posts + json_posts}) == 2 * len(ALL_KINDS)
    events = [m["X-Autoresearch-Event"] for m in mailbox.messages]
    assert sorted(events) == sorted(ALL_KINDS), events
    assert len({m["Message-ID"] for m in mailbox.messages}) == len(ALL_KINDS)
    assert mailbox.logins and all(lg == ("bot", SMTP_PASSWORD) for lg in mailbox.logins)
    # the hold links to its page; a promotion names the tag; the digest is a digest
    hold = next(p["body"] for p in json_posts if p["body"]["event"] == "hold")
    assert hold["key"].startswith("hold:1@") and hold["link"] == "http://review.example:8765/hypotheses/1"
    assert "autoresearch review 1 --approve" in hold["text"]
    assert "http://review.example:8765/hypotheses/1" in next(p["body"]["text"] for p in slack_posts
                                                            if "held for review" in p["body"]["text"])
    promo = next(p["body"] for p in json_posts if p["body"]["event"] == "promote")
    assert "baseline/v1" in promo["subject"]
    assert "abandoned after escalation to 5 runs" in next(p["body"]["text"] for p in json_posts
                                                          if p["body"]["event"] == "abandon")
    assert "took over the lab from pid" in next(p["body"]["text"] for p in json_posts
                                                if p["body"]["event"] == "takeover")
    assert "awaiting review" in next(p["body"]["text"] for p in json_posts if p["body"]["event"] == "digest")
    assert "cache_max_gb" in next(p["body"]["text"] for p in json_posts if p["body"]["event"] == "disk")
    # status: each target, no secret
    st = cli(root, "status", "--json", env=cli_env())
    for secret in ("T0K3N", SMTP_PASSWORD):
        assert secret not in st.stdout and secret not in cli(root, "status").stdout
    targets = {t["target"]: t for t in json.loads(st.stdout)["notify"]["targets"]}
    assert targets["ops-json"]["sent"] == len(ALL_KINDS) and not targets["ops-json"]["dead"]
    assert {t["kind"] for t in targets.values()} == {"webhook", "slack", "email"}


# ----------------------------------------------------------------------------- kill -9 with events pending

def test_kill_9_with_notifications_pending_then_restart_delivers_each_exactly_once(tmp_path: Path,
                                                                                   hook: Hook) -> None:
    root = command_lab(tmp_path / "lab", """
[notify]
digest_at = "00:00"
backoff_s = 0.2
backoff_max_s = 0.5
max_attempts = 100
""")
    target = f"{hook.url}/flaky/hook"
    first = RunProcess(root, "--offline", "--supervised", "--max-hypotheses", "2", "--notify", target, tag="first")
    try:
        # one delivered (the first request is answered 200), one or more pending and already retried
        first.wait_until("one sent, one failing", lambda: (
            any(r["state"] == "sent" for r in outbox(root))
            and any(r["state"] != "sent" and r["attempts"] >= 2 for r in outbox(root))), timeout=240)
        first.kill9()
    finally:
        first.cleanup()
    before = outbox(root)
    sent_before = {r["key"] for r in before if r["state"] == "sent"}
    pending_before = {r["key"] for r in before if r["state"] != "sent"}
    assert sent_before and pending_before, before
    hook.heal()
    again = RunProcess(root, "--offline", "--supervised", "--max-hypotheses", "1", "--notify", target, tag="again")
    try:
        again.wait_until("everything sent, the takeover too", lambda: (
            any(r["kind"] == "takeover" for r in outbox(root))
            and all(r["state"] == "sent" for r in outbox(root))), timeout=240)
        again.proc.terminate()
        assert again.wait(120) == 0, again.stderr()
    finally:
        again.cleanup()
    after = outbox(root)
    assert all(r["state"] == "sent" for r in after)
    delivered = [r["body"]["key"] for r in hook.got("flaky", 200)]
    assert sorted(delivered) == sorted({r["key"] for r in after}), delivered  # each once, none lost
    assert (sent_before | pending_before) <= set(delivered)
    # the retries of one notification carry one idempotency key, the receiver's to dedupe on
    keys: dict[str, set[str]] = {}
    for r in hook.got("flaky", 200) + hook.got("flaky", 500):
        keys.setdefault(r["body"]["key"], set()).add(r["idem"])
    assert all(len(v) == 1 for v in keys.values()), keys
    assert len({next(iter(v)) for v in keys.values()}) == len(keys)


# ----------------------------------------------------------------------------- a target that fails or hangs

NOTIFY_FAST = """
[notify]
max_attempts = 3
backoff_s = 0.05
backoff_max_s = 0.2
timeout_s = 0.5
dead_after = 2
"""


def test_a_target_answering_500_or_hanging_is_retried_bounded_and_changes_no_decision(tmp_path: Path,
                                                                                      hook: Hook) -> None:
    twin = command_lab(tmp_path / "twin", "")
    loop = make_loop(twin, max_hypotheses=2)
    try:
        plain = loop.run()["this_run"]
    finally:
        loop.close()

    root = command_lab(tmp_path / "lab", NOTIFY_FAST + f"""
[[notify.target]]
kind = "webhook"
name = "always-500"
url = "{hook.url}/fail/x"

[[notify.target]]
kind = "slack"
name = "hangs"
url = "{hook.url}/hang/T0K3N"
""")
    loop = make_loop(root, max_hypotheses=2)
    try:
        noisy = loop.run()["this_run"]
        t_close = time.monotonic()
    finally:
        loop.close()
    closing = time.monotonic() - t_close

    def decisions(rows: list[dict[str, Any]]) -> list[tuple]:
        # not the look a decision came at: the twin draws its own sealed holdout rows (secret entropy),
        # so its t differs (86 against 122 for the same gain, measured) and a margin can move a look
        return [(r["title"], r["verdict"], r["decision"], r["promoted_tag"]) for r in rows]

    assert decisions(noisy) == decisions(plain) and len(plain) == 2
    rows = outbox(root)
    events = {r["key"] for r in rows}
    assert {r["kind"] for r in rows} == {"promote"} and len(events) == sum(1 for r in plain if r["promoted_tag"])
    # retried, bounded: at most max_attempts per (event, target); every row given up after them
    for key in events:
        assert 1 <= len([r for r in hook.got("fail", 500) if r["body"]["key"] == key]) <= 3
        assert 1 <= len([r for r in hook.got("hang", None) if "text" in r["body"]]) <= 3 * len(events)
    done = [r for r in rows if r["state"] == "failed"]
    pending = [r for r in rows if r["state"] == "pending"]
    assert len(done) + len(pending) == len(rows) and all(r["attempts"] <= 3 for r in rows)
    assert closing < 20, closing  # the close's flush is bounded (FLUSH_S and the timeouts)
    # both targets dead in status, by name and host; the token of the hanging URL never shown
    st = json.loads(cli(root, "status", "--json").stdout)
    assert sorted(st["notify"]["dead"]) == ["always-500", "hangs"], st["notify"]
    assert any(e["kind"] == "notify_dead" for e in st["events"])
    text = cli(root, "status").stdout
    assert "notify: always-500 (webhook, http://127.0.0.1:" in text and "DEAD: " in text and "HTTP 500" in text
    assert "T0K3N" not in text and "T0K3N" not in json.dumps(st)


# ----------------------------------------------------------------------------- the outbox on PostgreSQL
# (pg_url: tests/conftest.py)

def test_the_outbox_on_postgresql_stages_once_and_resends_only_a_claim_a_dead_sender_left(
        tmp_path: Path, hook: Hook, pg_url: str) -> None:
    from sqlalchemy import update

    from agent.notify import attach
    from agent.records import Hypothesis, Notification, Records
    from pipeline.lab import load_lab
    from pipeline.store import Store

    lab = load_lab(init_lab(tmp_path / "lab", harness="command"))
    store = Store(pg_url)
    rec = Records(store)
    sender = attach(lab, store, rec, [f"{hook.url}/ok/pg"])
    assert sender is not None
    rec.event("plateau", "plateau: 3 measured hypotheses in a row without a promotion")
    rec.event("mlflow", "#1 not exported")  # not a notification's kind
    h = rec.add(Hypothesis(title="Held one", status="deciding", look=2, verdict="improvement"))
    rec.update(h.id, status="held", decision="hold", review="pending")
    rec.update(h.id, status="held")  # no new transition: nothing staged
    deadline = time.monotonic() + 30
    while len(hook.got("ok")) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    sender.close()
    assert sorted(r["body"]["event"] for r in hook.got("ok")) == ["hold", "plateau"]
    # the one window: a claim (pending -> sending) whose sender died before marking it sent is sent
    # again at the next start, with the same idempotency key
    with store.session() as s:
        s.exec(update(Notification).where(Notification.kind == "hold").values(state="sending"))
        s.commit()
    again = attach(lab, store, Records(store), [f"{hook.url}/ok/pg"])
    deadline = time.monotonic() + 30
    while len(hook.got("ok")) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    again.close()
    posts = hook.got("ok")
    assert [p["body"]["event"] for p in posts].count("hold") == 2 and len(posts) == 3
    assert len({p["idem"] for p in posts if p["body"]["event"] == "hold"}) == 1
    with store.session() as s:
        from sqlmodel import select

        assert {r.state for r in s.exec(select(Notification))} == {"sent"}


def test_a_targets_rate_limit_holds_the_rest_back_and_the_next_start_keeps_counting(tmp_path: Path,
                                                                                   hook: Hook) -> None:
    from agent.notify import attach
    from agent.records import Records
    from pipeline import experiment
    from pipeline.lab import load_lab

    root = command_lab(tmp_path / "lab", "[notify]\nrate_per_hour = 2\n")
    lab = load_lab(root)
    store = experiment.open_store(lab)
    rec = Records(store)
    sender = attach(lab, store, rec, [f"{hook.url}/ok/rate"])
    for i in range(4):
        rec.event("guard", f"guard {i}")
    deadline = time.monotonic() + 20
    while len(hook.got("ok")) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.5)  # a tick more: nothing else may go
    sender.close(flush_s=1)
    assert [p["body"]["text"] for p in hook.got("ok")] == ["guard 0", "guard 1"]
    # a restart counts the attempts of the last hour from the store: still nothing
    again = attach(lab, store, Records(store), [f"{hook.url}/ok/rate"])
    time.sleep(1.5)
    again.close(flush_s=1)
    assert len(hook.got("ok")) == 2
    assert [r["state"] for r in outbox(root)] == ["sent", "sent", "pending", "pending"]
    assert json.loads(cli(root, "status", "--json").stdout)["notify"]["targets"][0]["pending"] == 2


def test_notify_urls_parse_into_targets_that_show_no_secret() -> None:
    from agent.notify_targets import cli_target, resolve

    spec = cli_target("smtp://bot@127.0.0.1:2525?to=a@b.example,c@d.example&from=x@y.example"
                      "&password_env=NOTIFY_PW&starttls=false")
    assert (spec.kind, spec.smtp_host, spec.smtp_port, spec.username, spec.password_env, spec.sender, spec.to,
            spec.starttls) == ("email", "127.0.0.1", 2525, "bot", "NOTIFY_PW", "x@y.example",
                               ["a@b.example", "c@d.example"], False)
    t = resolve(spec, ["hold"], {"NOTIFY_PW": "pw-77"})
    assert t.password == "pw-77" and "pw-77" not in repr(t) and t.events == frozenset({"hold"})
    slack = resolve(cli_target("slack+https://hooks.example/services/T0K3N"), ["promote"], {})
    assert (slack.kind, slack.where) == ("slack", "https://hooks.example") and "T0K3N" not in repr(slack)
    assert slack.id == resolve(cli_target("slack+https://hooks.example/services/T0K3N"), [], {}).id  # stable


def test_a_redirect_is_a_failed_attempt_never_followed(tmp_path: Path, hook: Hook) -> None:
    """A 302 to the POST would turn it into a body-less GET to wherever `Location` points and count
    as delivered: it is a failure, and the row waits for its retry."""
    from agent.notify import attach
    from agent.records import Records
    from pipeline import experiment
    from pipeline.lab import load_lab

    root = command_lab(tmp_path / "lab", "[notify]\nbackoff_s = 60\n")
    lab = load_lab(root)
    store = experiment.open_store(lab)
    sender = attach(lab, store, Records(store), [f"{hook.url}/redirect/x"])
    Records(store).event("guard", "held back")  # a Records without the outbox stages nothing
    rec = sender.records
    rec.event("guard", "held back")
    deadline = time.monotonic() + 20
    while not hook.got("redirect", 302) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    sender.close(flush_s=1)
    assert len(hook.got("redirect", 302)) == 1
    assert not [r for r in hook.requests if r["mode"].startswith("get:")]  # never followed
    (row,) = outbox(root)
    assert (row["state"], row["attempts"]) == ("pending", 1) and "302" in row["last_error"], row


def test_a_title_with_line_breaks_reaches_e_mail_as_one_line(tmp_path: Path, mailbox: Mailbox,
                                                              monkeypatch) -> None:
    """An LLM-written title may hold line breaks, which an e-mail header refuses (the target would
    fail, then die): the subject is one line, and no header can be injected through it."""
    from agent.notify import attach
    from agent.records import Hypothesis, Records
    from pipeline import experiment
    from pipeline.lab import load_lab

    monkeypatch.setenv("NOTIFY_PW", SMTP_PASSWORD)
    root = command_lab(tmp_path / "lab", "")
    lab = load_lab(root)
    store = experiment.open_store(lab)
    url = f"smtp://bot@127.0.0.1:{mailbox.port}?to=team@lab.example&password_env=NOTIFY_PW&starttls=false"
    sender = attach(lab, store, Records(store), [url])
    rec = sender.records
    h = rec.add(Hypothesis(title="Raise the LoRA lr\r\nBcc: spy@evil.example", origin="llm"))
    rec.update(h.id, status="held", verdict="improvement", look=2, review="pending")  # as the hold node asks
    deadline = time.monotonic() + 20
    while not mailbox.messages and time.monotonic() < deadline:
        time.sleep(0.05)
    sender.close(flush_s=2)
    (msg,) = mailbox.messages
    assert msg["Subject"].endswith("held for review: Raise the LoRA lr Bcc: spy@evil.example"), msg["Subject"]
    assert msg["Bcc"] is None and [r["state"] for r in outbox(root)] == ["sent"]


def test_a_url_from_the_environment_is_shown_by_its_host_alone() -> None:
    from agent.notify_targets import resolve
    from agent.config import NotifyTarget

    t = resolve(NotifyTarget(kind="webhook", url_env="HOOK"), ["hold"], {"HOOK": "https://hooks.example:8443/x/T0K3N"})
    assert t.where == "$HOOK (hooks.example:8443)" and "T0K3N" not in t.where and "T0K3N" not in repr(t)


# ----------------------------------------------------------------------------- secrets in URLs and errors

USER_INFO_URL = "http://bot:S3cretPW@127.0.0.1/hook/T0K3N"  # urllib: InvalidURL: nonnumeric port: 'S3cretPW@127.0.0.1'


def test_a_url_with_user_info_is_refused_in_one_line(tmp_path: Path) -> None:
    """Its password would sit in every error quoting the host: `run` refuses it (`url_env`, `url` or
    `--notify`) in one line, exit code 2, the secret not echoed; `check_urls` (for `check`)
    refuses it too, and leaves an unset `url_env` to `run`."""
    from agent.notify_targets import check_urls
    from pipeline.errors import UserError
    from pipeline.lab import load_lab

    root = command_lab(tmp_path / "lab", '[[notify.target]]\nkind = "slack"\nurl_env = "NOTIFY_HOOK"\n')
    env = cli_env() | {"NOTIFY_HOOK": USER_INFO_URL}
    out = cli(root, "run", "--offline", "--max-hypotheses", "1", env=env)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("error: [notify] slack target NOTIFY_HOOK: the url_env NOTIFY_HOOK holds user "
                                 "info (user:password@host), refused"), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "S3cretPW" not in out.stderr and "Traceback" not in out.stderr
    config = agent_config(load_lab(root)).notify
    with pytest.raises(UserError, match="holds user info") as e:
        check_urls(config, {"NOTIFY_HOOK": USER_INFO_URL})
    assert "S3cretPW" not in str(e.value)
    check_urls(config, {})  # unset: `run` says so
    check_urls(config, {"NOTIFY_HOOK": "http://127.0.0.1/hook/T0K3N"})
    for i, url in enumerate((USER_INFO_URL, "slack+" + USER_INFO_URL)):
        out = cli(command_lab(tmp_path / f"cli{i}", ""), "run", "--offline", "--notify", url)
        assert out.returncode == 2 and "holds user info" in out.stderr and "S3cretPW" not in out.stderr, out.stderr
    inline = command_lab(tmp_path / "inline", f'[[notify.target]]\nkind = "webhook"\nurl = "{USER_INFO_URL}"\n')
    out = cli(inline, "run", "--offline", "--max-hypotheses", "1")
    assert out.returncode == 2 and "the url holds user info" in out.stderr and "S3cretPW" not in out.stderr
    for args, env in ((("check",), None), (("check",), cli_env() | {"NOTIFY_HOOK": USER_INFO_URL})):
        out = cli(inline if env is None else root, *args, env=env)  # `autoresearch check`: the same line
        assert out.returncode == 2 and "holds user info" in out.stderr and "S3cretPW" not in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1


def test_an_error_is_stored_and_shown_without_any_part_of_the_urls(tmp_path: Path, hook: Hook) -> None:
    """Defence in depth, should a URL with user info get past the check (a store written before it):
    the real sender's errors — urllib's `nonnumeric port: 'PASSWORD@host'`, a server's reason phrase
    quoting the URL's path — are stored with every part of the configured URLs scrubbed, so neither
    `status` (text and JSON, `last_error` and the `notify_dead` event) nor the review page shows them."""
    from agent.notify import Outbox, Sender
    from agent.notify_targets import Target
    from agent.records import Records
    from pipeline import experiment
    from pipeline.lab import load_lab

    root = command_lab(tmp_path / "lab", "[notify]\ndead_after = 1\nmax_attempts = 1\n")
    lab = load_lab(root)
    store = experiment.open_store(lab)
    rec = Records(store)
    targets = [Target("userinfo", "webhook", "http://127.0.0.1", frozenset({"guard"}), url=USER_INFO_URL),
               Target("echoes", "slack", hook.url, frozenset({"guard"}), url=f"{hook.url}/echo/T0K3N-path")]
    box = Outbox(lab, agent_config(lab).notify, targets)
    rec.outbox = box
    sender = Sender(lab, store, rec, box, agent_config(lab).notify).start()
    rec.event("guard", "held back")
    deadline = time.monotonic() + 20
    while len([r for r in outbox(root) if r["state"] == "failed"]) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    sender.close(flush_s=1)
    assert hook.got("echo", 500)  # the server did quote the path back
    rows = {r["target"]: r for r in outbox(root)}
    assert "nonnumeric port: '***@127.0.0.1'" in rows["userinfo"]["last_error"], rows
    assert rows["echoes"]["last_error"] == "HTTP 500 boom at ***", rows
    st = cli(root, "status", "--json")
    text = cli(root, "status").stdout
    server = Server(root).wait()
    try:
        page = server.get("/").read().decode()
    finally:
        server.stop()
    dead = [e["message"] for e in json.loads(st.stdout)["events"] if e["kind"] == "notify_dead"]
    assert len(dead) == 2 and "DEAD" in text and "notification target userinfo" in page
    for secret in ("S3cretPW", "bot:", "T0K3N", "/hook", "/echo"):
        for shown in (st.stdout, text, page, json.dumps(rows)):
            assert secret not in shown, (secret, shown[:3000])


def test_a_slack_title_with_mentions_and_links_is_posted_inert(tmp_path: Path, hook: Hook) -> None:
    """An LLM-written title with `<!channel>`, `@here`, `@everyone`, a `<url|text>` link and a Markdown
    link reaches a Slack-compatible endpoint as text: no mention and no disguised link survives, even
    read by a receiver that decodes the escapes first (Mattermost, Teams); the review page's own link
    is the one link."""
    import html
    import re

    from agent.notify import attach
    from agent.records import Hypothesis, Records
    from pipeline import experiment
    from pipeline.lab import load_lab

    root = command_lab(tmp_path / "lab", '[notify]\nweb_url = "http://review.example:8765"\n')
    lab = load_lab(root)
    store = experiment.open_store(lab)
    sender = attach(lab, store, Records(store), [f"slack+{hook.url}/ok/slack"])
    rec = sender.records
    title = ("<!channel> <!here|here> @here @everyone @channel <@U024BE7LH> see <http://evil.example|click> "
             "[docs](http://evil.example)")
    h = rec.add(Hypothesis(title=title, origin="llm", rationale_decision="ping @all <!everyone>"))
    rec.update(h.id, status="held", verdict="improvement", look=2, review="pending")  # as the hold node asks
    deadline = time.monotonic() + 20
    while not hook.got("ok") and time.monotonic() < deadline:
        time.sleep(0.05)
    sender.close(flush_s=2)
    (post,) = hook.got("ok")
    text = post["body"]["text"]
    for shown in (text, html.unescape(text)):  # as Slack reads it, and as a receiver that decodes first
        assert not re.search(r"<[!@#]", shown), shown
        assert not re.search(r"@(channel|here|everyone|all)\b", shown), shown
        assert "<http://evil.example|click>" not in shown and "](http" not in shown, shown
        assert re.findall(r"<(http[^|>]*)\|", shown) == [f"http://review.example:8765/hypotheses/{h.id}"]
    assert "@\u200bhere" in text and "@\u200beveryone" in text and "click" in text  # still readable


def test_a_held_promotion_is_announced_when_its_reviewer_is_asked_and_an_early_answer_stands(
        tmp_path: Path, hook: Hook) -> None:
    """A promotion held while it waits for its replication (review none) is not announced; the
    hold node's `ask_review` turns it pending and stages the hold notification once; an answer a
    human gave first is never overwritten by it, and nothing is announced for it."""
    from agent.notify import attach
    from agent.records import Hypothesis, Records
    from pipeline import experiment
    from pipeline.lab import load_lab

    root = command_lab(tmp_path / "lab", "")
    lab = load_lab(root)
    store = experiment.open_store(lab)
    sender = attach(lab, store, Records(store), [f"{hook.url}/ok/ask"])
    rec = sender.records
    waiting, early = (rec.add(Hypothesis(title=t, status="deciding", look=2, verdict="improvement"))
                      for t in ("waits for its replication", "approved early"))
    for h in (waiting, early):
        rec.update(h.id, status="held", decision="hold", review="none")
    assert not [r for r in outbox(root) if r["kind"] == "hold"]
    assert rec.ask_review(waiting.id).review == "pending"
    assert rec.ask_review(waiting.id).review == "pending"  # a node run again: nothing new
    assert rec.decide_review(early.id, "approved")
    assert rec.ask_review(early.id).review == "approved"
    sender.close(flush_s=5)
    holds = [r for r in outbox(root) if r["kind"] == "hold"]
    assert [r["key"] for r in holds] == [f"hold:{waiting.id}"], holds
    store.dispose()


def test_a_hold_re_based_and_held_again_is_announced_again_once(tmp_path: Path, hook: Hook) -> None:
    """A held hypothesis approved while the baseline moved is re-based, measured again and may be
    held again: its reviewer is asked again, about a new comparison, so the hold is announced again
    (once per base: a node run again after a crash stages nothing new)."""
    from agent.notify import attach
    from agent.records import Hypothesis, Records
    from pipeline import experiment
    from pipeline.lab import load_lab

    root = command_lab(tmp_path / "lab", "")
    lab = load_lab(root)
    store = experiment.open_store(lab)
    sender = attach(lab, store, Records(store), [f"{hook.url}/ok/rebased"])
    rec = sender.records
    h = rec.add(Hypothesis(title="held twice", status="deciding", look=2, verdict="improvement",
                           base_commit="a" * 40, commit="c" * 40))
    rec.update(h.id, status="held", decision="hold", review="none")
    rec.ask_review(h.id)
    rec.decide_review(h.id, "approved")  # approved; the promote node finds the base moved: re-based
    rec.update(h.id, status="measuring", decision=None, review="none", base_commit="b" * 40, commit="d" * 40,
               rationale_decision="Re-based from baseline/v1 onto baseline/v2 before its promotion: ...")
    rec.update(h.id, status="held", decision="hold")
    rec.ask_review(h.id)
    rec.ask_review(h.id)  # the hold node run again after a crash
    sender.close(flush_s=5)
    holds = [r for r in outbox(root) if r["kind"] == "hold"]
    assert [r["key"] for r in holds] == [f"hold:{h.id}@{'a' * 12}", f"hold:{h.id}@{'b' * 12}"], holds
    assert all(r["state"] == "sent" for r in holds)
    assert "Re-based from baseline/v1 onto baseline/v2" in holds[1]["body"]
    store.dispose()
