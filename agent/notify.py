"""Notifications (`[notify]` in research.toml, `run --notify URL`): tell the humans who are not watching.

Targets: a generic JSON webhook (POST), a Slack-compatible webhook (`{"text": …}`: Slack, Mattermost,
Teams) and e-mail over SMTP (STARTTLS and login when configured). Secrets come from the environment
only (`url_env`, `password_env`) and are never stored, logged or shown: `status` names a target by
its name, kind and host. A URL with user info (`user:password@host`) is refused (`resolve`, at
`run`; `check_urls` for a check without a run); and an error is stored, logged and shown only with every part of every
configured URL that may hold a secret (user info, path and its segments, query and its values,
fragment) and every password replaced by `***` (`Scrubber`). A Slack-compatible target's text is made
inert (`slack_text`): no `@channel`/`<!here>` mention, no disguised link, whatever an LLM-written
title says.

Delivery goes through an outbox in the store (`agent.records.Notification`):

- **Written with the event.** `Records.event` (a loop event: plateau, LLM down/up, guard, takeover,
  disk) and `Records.update` (a hold, a promotion, an abandon after escalation) call the `Outbox`
  inside their own transaction, so the event and its notifications commit together: a `kill -9`
  loses neither. Each row is keyed (event key, target) and unique, so an event is staged once.
- **Sent by a thread** (`Sender`) the loop starts: it never blocks the loop, and every network
  operation has a timeout (`timeout_s`). It claims a row by a state transition in the store
  (pending → sending, attempts + 1), sends it, and marks it sent in one small transaction right after
  the target accepted it. A failure puts it back with an exponential back-off (`backoff_s`, doubling,
  at most `backoff_max_s`); after `max_attempts` it is failed. At most `rate_per_hour` attempts per
  target; `dead_after` failed attempts in a row make the target dead in `status` (and a loop event).
- **Exactly once, with one window.** One driver holds a lab (its lease), so one sender. At start
  it puts back the rows a dead predecessor left in `sending`: they are sent again. That is the one
  window where a notification can arrive twice: the target accepted it and the process died
  before the row was marked sent (a few milliseconds). Every request carries a stable idempotency
  key for the receiver to dedupe: the `Idempotency-Key` header (webhooks) and the `Message-ID`
  (e-mail), the same on every attempt.
- **The daily digest** at `digest_at` (local time) and the **disk check** (the stage cache over 90 %
  of `[run] cache_max_gb`, said at most once a day) are the sender's own timers: the digest's key is
  its date, so a restart does not send it twice.

What is left at exit (a back-off not yet over, a target down) is sent by the next `run`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import socket
import threading
import time
import urllib.parse
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import update
from sqlmodel import select

from agent.lifecycle import Decision, Review, Status
from agent.records import LoopEvent, Notification, NotifyTargetState, Records
from pipeline.api import UserError

log = logging.getLogger("autoresearch.notify")

TICK_S = 1.0  # the sender's poll when nothing wakes it
DISK_CHECK_S = 60.0
DISK_SHARE = 0.9
DISK_REPEAT_S = 86400.0  # the disk warning at most once a day
FLUSH_S = 10.0  # at close: how long the loop waits for due notifications to go out
ERROR_MAX = 300

TITLES = {
    "plateau": "plateau", "llm_down": "LLM unreachable", "llm_up": "LLM reachable again",
    "guard": "guard: proposals held back", "takeover": "driver takeover", "disk": "disk near its cap",
    "budget": "budget", "reverified": "champion re-verified", "error": "error in a hypothesis",
    "notify_dead": "a notification target is dead",
}


SUBJECT_MAX = 200
SECRET_MIN = 4  # a URL's path segment or query value shorter than this is no secret (and `***` would mangle words)
ZWSP = "\u200b"  # breaks a mention or a link in a Slack-compatible text without a visible change
STALE_CLAIM_TIMEOUTS = 10  # a claim older than this many timeouts is a sender that died mid-attempt


def one_line(text: str) -> str:
    """A subject: an LLM-written title may hold line breaks, which an e-mail header refuses."""
    return " ".join(text.split())[:SUBJECT_MAX]


# ----------------------------------------------------------------------------- targets

@dataclass(frozen=True)
class Target:
    id: str
    kind: str  # webhook | slack | email
    where: str  # shown in status: no path, no query, no password
    events: frozenset[str]
    url: str | None = field(default=None, repr=False)
    smtp_host: str | None = None
    smtp_port: int = 587
    starttls: bool = True
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    sender: str | None = None
    to: tuple[str, ...] = ()


def cli_target(url: str) -> Any:
    """`--notify URL` as a `[notify]` target: `https://…` (JSON webhook), `slack+https://…`
    (Slack-compatible), `smtp://[user@]host[:port]?to=a@b,c@d&from=me@x&password_env=VAR&starttls=false`."""
    from pydantic import ValidationError

    from pipeline.api import NotifyTarget

    def bad(why: str) -> UserError:
        return UserError(f"--notify: {why}; expected https://… (JSON webhook), slack+https://… (Slack-compatible) "
                           "or smtp://[user@]host[:port]?to=ADDR&from=ADDR[&password_env=VAR][&starttls=false]")

    try:
        if url.startswith(("http://", "https://")):
            raw: dict[str, Any] = {"kind": "webhook", "url": url}
        elif url.startswith(("slack+http://", "slack+https://")):
            raw = {"kind": "slack", "url": url.removeprefix("slack+")}
        elif url.startswith("smtp://"):
            u = urllib.parse.urlsplit(url)
            if u.password:
                raise bad("no password in the URL (it would show in ps); name its variable with password_env")
            q = {k: v[-1] for k, v in urllib.parse.parse_qs(u.query, strict_parsing=False).items()}
            unknown = set(q) - {"to", "from", "password_env", "starttls"}
            if unknown:
                raise bad(f"unknown parameter {sorted(unknown)[0]!r}")
            starttls = q.get("starttls", "true").lower()
            if starttls not in ("true", "false", "1", "0"):
                raise bad("starttls is true or false")
            raw = {"kind": "email", "smtp_host": u.hostname, "smtp_port": u.port or 587,
                   "to": [a for a in q.get("to", "").split(",") if a], "starttls": starttls in ("true", "1")}
            if u.username:
                raw["username"] = urllib.parse.unquote(u.username)
            for key in ("from", "password_env"):
                if key in q:
                    raw[key] = q[key]
        else:
            raise bad("an unknown scheme")
        return NotifyTarget.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise bad(f"{where + ': ' if where else ''}{err['msg'].removeprefix('Value error, ')}") from None
    except ValueError as e:  # a port that is not a number
        raise bad(str(e)) from None


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def _user_info_refused(spec: Any, url: str) -> None:
    """A URL with user info: its password would sit in every error that quotes the host (`urllib`'s
    `nonnumeric port: 'PASSWORD@host'`). Refused in one line that does not echo the URL."""
    try:
        has_user_info = "@" in urllib.parse.urlsplit(url).netloc
    except ValueError:  # a malformed host: said by the http(s) check
        return
    if has_user_info:
        where = f"url_env {spec.url_env}" if spec.url_env else "url"
        raise UserError(f"[notify] {spec.kind} target {spec.name or spec.url_env or spec.kind}: the {where} holds "
                        "user info (user:password@host), refused: a password there would show in errors; "
                        "use a webhook URL whose token is in its path")


def check_urls(config: Any, env: dict[str, str]) -> None:
    """`[notify]` checked without a run (for `autoresearch check`): a webhook or Slack URL (`url`, or
    `url_env` where it is set) with user info is a `UserError`. An unset `url_env` is `run`'s to refuse."""
    for spec in config.target:
        if spec.kind == "email":
            continue
        url = spec.url if spec.url is not None else env.get(spec.url_env or "", "")
        if url:
            _user_info_refused(spec, url)


def resolve(spec: Any, defaults: list[str], env: dict[str, str]) -> Target:
    """A `[notify]` target (pipeline.lab.NotifyTarget) with its secrets read from `env`."""
    events = frozenset(spec.events if spec.events is not None else defaults)
    if spec.kind == "email":
        password = None
        if spec.password_env:
            password = env.get(spec.password_env)
            if not password:
                raise UserError(f"[notify] e-mail target {spec.name or spec.smtp_host}: password_env "
                                  f"{spec.password_env} is not set in the environment")
        ident = f"{spec.smtp_host}:{spec.smtp_port}:{','.join(spec.to)}"
        return Target(spec.name or f"email-{_short_hash(ident)}", "email",
                      f"smtp {spec.smtp_host}:{spec.smtp_port} to {', '.join(spec.to)}", events,
                      smtp_host=spec.smtp_host, smtp_port=spec.smtp_port, starttls=spec.starttls,
                      username=spec.username, password=password, sender=spec.sender, to=tuple(spec.to))
    if spec.url_env:
        url = env.get(spec.url_env, "")
        if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", url):
            raise UserError(f"[notify] {spec.kind} target {spec.name or spec.url_env}: url_env {spec.url_env} "
                              "is not set to an http(s) URL in the environment")
        _user_info_refused(spec, url)
        parts = urllib.parse.urlsplit(url)
        ident, where = f"env:{spec.url_env}", f"${spec.url_env} ({parts.hostname}" + (f":{parts.port})" if parts.port else ")")
    else:
        url = spec.url
        _user_info_refused(spec, url)
        ident = url
        parts = urllib.parse.urlsplit(url)
        where = f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return Target(spec.name or f"{spec.kind}-{_short_hash(ident)}", spec.kind, where, events, url=url)


def targets(config: Any, cli_urls: list[str], env: dict[str, str]) -> list[Target]:
    specs = list(config.target) + [cli_target(u) for u in cli_urls]
    out: list[Target] = []
    for spec in specs:
        t = resolve(spec, list(config.events), env)
        if any(o.id == t.id for o in out):
            raise UserError(f"[notify] two targets named {t.id}; give each its own name")
        out.append(t)
    return out


# ----------------------------------------------------------------------------- what to say

def _hyp_line(h: Any) -> str:
    return f"#{h.id} {h.title!r}"


class Outbox:
    """The writing half: turns loop events and hypothesis transitions into outbox rows, inside the
    caller's transaction (`Records.event`, `Records.update`)."""

    def __init__(self, lab: Any, config: Any, targets_: list[Target]):
        self.lab_name = lab.config.lab.name
        self.first_look = lab.config.gate.looks[0]
        self.web_url = (config.web_url or "").rstrip("/") or None
        self.targets = targets_
        self.woken = threading.Event()

    def wake(self) -> None:
        self.woken.set()

    def stage(self, s: Any, kind: str, key: str, subject: str, body: str, link: str | None = None) -> bool:
        """Add a row per target that wants `kind`, unless the event was staged already (a node run
        again after a crash). True if any was added."""
        wanted = [t for t in self.targets if kind in t.events]
        if not wanted:
            return False
        have = set(s.exec(select(Notification.target).where(Notification.key == key)))
        added = False
        for t in wanted:
            if t.id not in have:
                s.add(Notification(key=key, target=t.id, kind=kind, subject=one_line(f"[{self.lab_name}] {subject}"),
                                   body=body, link=link))
                added = True
        return added

    def on_event(self, s: Any, ev: LoopEvent) -> bool:
        if ev.kind not in TITLES:
            return False
        first = ev.message.split(":", 1)[0] if ev.kind == "plateau" else TITLES[ev.kind]
        return self.stage(s, ev.kind, f"event:{ev.id}", first, ev.message)

    def on_update(self, s: Any, before: dict[str, Any], h: Any) -> bool:
        staged = False
        if h.status == Status.HELD and before["status"] != Status.HELD:
            link = self._link(h)
            body = (f"{_hyp_line(h)} awaits review: verdict {h.verdict} at {h.look} runs.\n"
                    f"{h.rationale_decision or ''}\n"
                    f"Review: {link or 'autoresearch serve'}, or autoresearch review {h.id} --approve / --reject")
            staged |= self.stage(s, "hold", f"hold:{h.id}", f"#{h.id} held for review: {h.title}", body, link)
        if h.promoted_tag and not before["promoted_tag"]:
            body = (f"{_hyp_line(h)} promoted to the baseline as {h.promoted_tag}: verdict {h.verdict} at {h.look} "
                    f"runs.\n{h.rationale_decision or ''}")
            staged |= self.stage(s, "promote", f"promote:{h.id}", f"#{h.id} promoted ({h.promoted_tag}): {h.title}",
                                 body, self._link(h))
        if h.decision == Decision.ABANDON and before["decision"] != Decision.ABANDON and (h.look or 0) > self.first_look:
            body = (f"{_hyp_line(h)} abandoned after escalation to {h.look} runs: verdict {h.verdict}.\n"
                    f"{h.rationale_decision or ''}")
            staged |= self.stage(s, "abandon", f"abandon:{h.id}", f"#{h.id} abandoned after escalation: {h.title}",
                                 body, self._link(h))
        return staged

    def _link(self, h: Any) -> str | None:
        return f"{self.web_url}/hypotheses/{h.id}" if self.web_url else None


def digest_text(records: Records, store: Any, since: float) -> str:
    """The daily digest, in a few lines (`autoresearch digest` has the full one)."""
    from agent.records import ACTIVE

    hyps = records.all()
    recent = [h for h in hyps if (h.finished_at or h.updated_at) >= since]
    done = [h for h in recent if h.status == Status.DONE]
    lines = [f"The last 24 h: {len(recent)} hypotheses tried."]
    for label, group in (("promoted", [h for h in done if h.promoted_tag]),
                         ("abandoned", [h for h in done if h.decision in (Decision.ABANDON, Decision.REFINE)]),
                         ("rejected", [h for h in done if h.decision == Decision.REJECT])):
        if group:
            lines.append(f"{label}: " + "; ".join(_hyp_line(h) + (f" → {h.promoted_tag}" if h.promoted_tag else "")
                                                 for h in group))
    active = [h for h in hyps if h.status in ACTIVE]
    if active:
        lines.append("in flight: " + "; ".join(f"{_hyp_line(h)} ({h.status})" for h in active))
    pending = [h for h in hyps if h.review == Review.PENDING]
    lines.append(f"awaiting review: {', '.join(f'#{h.id}' for h in pending) or 'none'}")
    lines.append(f"measured in a row without a promotion: {records.since_promotion()}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- sending

def url_secrets(url: str) -> set[str]:
    """The parts of a URL that may hold a secret: the URL, its user info, user name and password (as
    written and decoded), path, query and fragment, each path segment and query value of `SECRET_MIN`
    characters or more. Not the scheme, host or port: `status` shows those."""
    try:
        u = urllib.parse.urlsplit(url)
    except ValueError:
        return {url}
    found = {url, u.path, u.query, u.fragment, u.netloc.rpartition("@")[0]}
    for part in (u.username, u.password):
        found |= {part, urllib.parse.unquote(part)} if part else set()
    for segment in u.path.split("/") + [v for pair in u.query.split("&") for v in pair.split("=")]:
        if len(segment) >= SECRET_MIN:
            found |= {segment, urllib.parse.unquote(segment)}
    return {x for x in found if x and (len(x) >= SECRET_MIN or x in (u.password, u.username))}


class Scrubber:
    """Errors as they may be stored, logged and shown: every secret of the configured targets (their
    URLs' parts, passwords) replaced by `***`, and any `scheme://user:password@` left masked too."""

    USER_INFO = re.compile(r"(?<=://)[^\s/@]+@")

    def __init__(self, targets_: list[Target]):
        found: set[str] = set()
        for t in targets_:
            found |= url_secrets(t.url) if t.url else set()
            found |= {t.password} if t.password else set()
        self.secrets = sorted(found, key=len, reverse=True)  # the whole URL before its parts

    def __call__(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return " ".join(self.USER_INFO.sub("***@", text).split())[:ERROR_MAX]


def slack_text(text: str) -> str:
    """Text for a Slack-compatible receiver (Slack, Mattermost, Teams), shown as written and inert:
    Slack's three escapes (`&`, `<`, `>`), and a zero-width space after each `<` (a `<!channel>`,
    `<!here>`, `<@U1>` or `<url|text>` stays text even where a receiver decodes the escapes first),
    after each `@` before a word (`@channel`, `@here`, `@everyone`, `@all`, `@user`: Mattermost's
    mentions) and between `]` and `(` (a Markdown link or image, `[text](url)`)."""
    text = text.replace("&", "&amp;").replace("<", "&lt;" + ZWSP).replace(">", "&gt;")
    return re.sub(r"@(?=\w)", "@" + ZWSP, text).replace("](", "]" + ZWSP + "(")


def idempotency_key(lab: str, row: Notification) -> str:
    return hashlib.sha256(f"{lab}\0{row.key}\0{row.target}".encode()).hexdigest()[:32]


def deliver(t: Target, row: Notification, lab: str, timeout: float) -> None:
    """One attempt; raises on any failure. Every network operation is bounded by `timeout`."""
    import urllib.request

    idem = idempotency_key(lab, row)
    text = row.body + (f"\n{row.link}" if row.link else "")
    if t.kind in ("webhook", "slack"):
        if t.kind == "slack":  # inert text; the subject in bold; our own link the one link
            payload: dict[str, Any] = {"text": f"*{slack_text(row.subject)}*\n{slack_text(row.body)}"
                                               + (f"\n<{row.link}|open the review page>" if row.link else "")}
        else:
            payload = {"event": row.kind, "key": row.key, "lab": lab, "subject": row.subject, "text": row.body,
                       "link": row.link, "created_at": row.created_at, "idempotency_key": idem}
        req = urllib.request.Request(t.url or "", data=json.dumps(payload).encode(), method="POST", headers={
            "Content-Type": "application/json", "Idempotency-Key": idem, "User-Agent": "autoresearch-notify"})
        with _no_redirects().open(req, timeout=timeout) as resp:
            resp.read(65536)
        return
    import smtplib
    import ssl
    from email.message import EmailMessage
    from email.utils import formatdate

    msg = EmailMessage()
    msg["Subject"] = row.subject
    msg["From"] = t.sender or f"autoresearch@{socket.gethostname()}"
    msg["To"] = ", ".join(t.to)
    msg["Date"] = formatdate(row.created_at, localtime=True)
    msg["Message-ID"] = f"<{idem}@autoresearch>"
    msg["X-Autoresearch-Event"] = row.kind
    msg.set_content(text)
    with smtplib.SMTP(t.smtp_host or "", t.smtp_port, timeout=timeout) as smtp:
        if t.starttls:
            smtp.starttls(context=ssl.create_default_context())
        if t.username:
            smtp.login(t.username, t.password or "")
        smtp.send_message(msg)


def _no_redirects() -> Any:
    """An opener for which a 3xx answer is a failed attempt: followed, the POST would become a
    body-less GET to wherever `Location` points (an internal host too) and count as delivered."""
    import urllib.request

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None

    return urllib.request.build_opener(NoRedirect)


class Sender:
    """The delivering half: a daemon thread working the outbox (see the module's docstring)."""

    def __init__(self, lab: Any, store: Any, records: Records, outbox: Outbox, config: Any):
        self.lab, self.store, self.records, self.outbox, self.cfg = lab, store, records, outbox, config
        self.targets = {t.id: t for t in outbox.targets}
        self.scrub = Scrubber(outbox.targets)
        self.sent_at: dict[str, deque[float]] = {t: deque() for t in self.targets}
        self.stopping = threading.Event()
        self.next_disk = 0.0
        self.flush_until = 0.0
        self.thread = threading.Thread(target=self._run, name="autoresearch-notify", daemon=True)

    def start(self) -> "Sender":
        self._recover()
        self.thread.start()
        return self

    def close(self, flush_s: float = FLUSH_S) -> None:
        """Stop, after giving due notifications up to `flush_s` to go out (the rest wait for the next run)."""
        self.flush_until = time.monotonic() + flush_s
        self.stopping.set()
        self.outbox.wake()
        self.thread.join(flush_s + self.cfg.timeout_s * 2 + 1)
        if self.thread.is_alive():  # an attempt still under way: its row stays claimed, the next run resends it
            log.warning("notifications: a send was still under way at exit; it is retried at the next start")

    # --- the store --------------------------------------------------------------------------------

    def _recover(self) -> None:
        """Rows a dead sender left claimed go back to pending (the one window: they may have arrived),
        and each target's state row exists; the rate window is refilled from the store."""
        with self.store.session() as s:
            s.exec(update(Notification).where(Notification.state == "sending").values(state="pending"))
            for t in self.targets.values():
                row = s.get(NotifyTargetState, t.id)
                if row is None:
                    s.add(NotifyTargetState(target=t.id, kind=t.kind, where=t.where))
                else:
                    row.kind, row.where = t.kind, t.where
                    s.add(row)
            hour = time.time() - 3600
            for tid, at in s.exec(select(Notification.target, Notification.claimed_at).where(
                    Notification.claimed_at >= hour)):  # type: ignore[operator]
                if tid in self.sent_at and at is not None:
                    self.sent_at[tid].append(at)
            s.commit()
        for q in self.sent_at.values():
            ordered = sorted(q)
            q.clear()
            q.extend(ordered)

    def _due(self) -> list[Notification]:
        with self.store.session() as s:
            # a claim left by an attempt that never finished (the store failed as it ended) goes back
            stale = time.time() - STALE_CLAIM_TIMEOUTS * self.cfg.timeout_s
            s.exec(update(Notification).where(Notification.state == "sending", Notification.claimed_at < stale)
                   .values(state="pending"))
            # a target whose hourly allowance is spent is left out, so it never holds the others back
            spent = [tid for tid, window in self.sent_at.items() if self._spent(window)]
            s.commit()
            open_targets = [tid for tid in self.targets if tid not in spent]
            q = (select(Notification).where(Notification.state == "pending", Notification.next_at <= time.time(),
                                            Notification.target.in_(open_targets))  # type: ignore[attr-defined]
                 .order_by(Notification.id).limit(50))
            return list(s.exec(q))

    def _spent(self, window: deque[float]) -> bool:
        """Whether a target's attempts in the last hour reached `rate_per_hour` (the window is trimmed)."""
        while window and window[0] < time.time() - 3600:
            window.popleft()
        return len(window) >= self.cfg.rate_per_hour

    def _claim(self, row: Notification) -> bool:
        with self.store.session() as s:
            res = s.exec(update(Notification).where(Notification.id == row.id, Notification.state == "pending")
                         .values(state="sending", attempts=Notification.attempts + 1, claimed_at=time.time()))
            s.commit()
            return res.rowcount == 1

    def _done(self, row: Notification, t: Target, error: str | None) -> None:
        now = time.time()
        attempts = row.attempts + 1
        with self.store.session() as s:
            if error is None:
                s.exec(update(Notification).where(Notification.id == row.id, Notification.state == "sending")
                       .values(state="sent", sent_at=now, last_error=None))
            else:
                gave_up = attempts >= self.cfg.max_attempts
                wait = min(self.cfg.backoff_max_s, self.cfg.backoff_s * 2 ** (attempts - 1))
                s.exec(update(Notification).where(Notification.id == row.id, Notification.state == "sending")
                       .values(state="failed" if gave_up else "pending", next_at=now + wait, last_error=error))
            st = s.get(NotifyTargetState, t.id) or NotifyTargetState(target=t.id, kind=t.kind, where=t.where)
            became_dead = False
            if error is None:
                st.fails_in_row, st.failing_since, st.last_ok_at, st.dead = 0, None, now, False
            else:
                st.fails_in_row += 1
                st.failing_since = st.failing_since or now
                st.last_error = error
                became_dead = not st.dead and st.fails_in_row >= self.cfg.dead_after
                st.dead = st.dead or became_dead
            s.add(st)
            s.commit()
        if became_dead:
            self.records.event("notify_dead", f"notification target {t.id} ({t.kind}, {t.where}) is dead: "
                                              f"{st.fails_in_row} failed attempts in a row ({error})")

    # --- the thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            stopping = self.stopping.is_set()
            try:
                if not stopping:
                    self._timers()
                self._send_due(flush=stopping)
            except Exception as e:  # a database hiccup: the next tick retries; the loop goes on
                log.warning("notifications: %s: %s", type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
            if stopping:
                return
            self.outbox.woken.wait(TICK_S)
            self.outbox.woken.clear()

    def _send_due(self, flush: bool = False) -> None:
        import urllib.error

        for row in self._due():
            if flush and time.monotonic() > self.flush_until:
                return
            if self.stopping.is_set() and not flush:
                return
            t = self.targets[row.target]
            window = self.sent_at[t.id]
            if self._spent(window):
                continue  # this target's hourly allowance is spent: the row waits
            if not self._claim(row):
                continue
            window.append(time.time())
            try:
                deliver(t, row, self.outbox.lab_name, self.cfg.timeout_s)
                error = None
            except urllib.error.HTTPError as e:
                error = self.scrub(f"HTTP {e.code} {e.reason}")
            except Exception as e:  # refused, timed out, TLS, SMTP refusals: all a failed attempt
                error = self.scrub(f"{type(e).__name__}: {e}")
            self._done(row, t, error)
            if error:
                log.warning("notification %s to %s failed (attempt %d): %s", row.key, t.id, row.attempts + 1, error)

    def _timers(self) -> None:
        wants = {k for t in self.targets.values() for k in t.events}
        if "digest" in wants and self.cfg.digest_at:
            self._digest()
        if "disk" in wants and time.monotonic() >= self.next_disk:
            self.next_disk = time.monotonic() + DISK_CHECK_S
            self._disk()

    def _digest(self) -> None:
        """Once a local day, at or after `digest_at`; keyed by the date, so never twice."""
        hh, mm = (int(x) for x in self.cfg.digest_at.split(":"))
        now = time.localtime()
        if (now.tm_hour, now.tm_min) < (hh, mm):
            return
        key = f"digest:{time.strftime('%Y-%m-%d', now)}"
        with self.store.session() as s:
            if s.exec(select(Notification.id).where(Notification.key == key)).first() is not None:
                return
        text = digest_text(self.records, self.store, time.time() - 86400)
        with self.store.session() as s:
            if self.outbox.stage(s, "digest", key, f"daily digest {key.split(':')[1]}", text,
                                 self.outbox.web_url):
                s.commit()

    def _disk(self) -> None:
        cap_gb = self.lab.config.run.cache_max_gb
        if cap_gb is None:
            return
        used, cap = self.store.cache_bytes(), cap_gb * (1 << 30)
        if used <= DISK_SHARE * cap:
            return
        last = self.records.last_event(("disk",))
        if last is not None and time.time() - last.created_at < DISK_REPEAT_S:
            return
        self.records.event("disk", f"disk: the stage cache holds {used / (1 << 30):.3g} GB, {used / cap:.0%} of "
                                   f"[run] cache_max_gb = {cap_gb:g} (entries the baseline and runs in flight "
                                   "need are never evicted)")


def attach(lab: Any, store: Any, records: Records, cli_urls: list[str] | None = None,
           env: dict[str, str] | None = None) -> Sender | None:
    """The loop's notifications: the outbox on `records` and its sender started; None if no target."""
    import os

    cfg = lab.config.notify
    ts = targets(cfg, list(cli_urls or []), dict(os.environ) if env is None else env)
    if not ts:
        return None
    outbox = Outbox(lab, cfg, ts)
    records.outbox = outbox
    return Sender(lab, store, records, outbox, cfg).start()


# ----------------------------------------------------------------------------- status

def status(store: Any) -> dict[str, Any]:
    """Per target seen in this store: counts by state, whether it is dead and since when (no secrets)."""
    from sqlalchemy import func

    with store.session() as s:
        counts: dict[str, dict[str, int]] = {}
        for tid, state, n in s.exec(select(Notification.target, Notification.state, func.count())
                                    .group_by(Notification.target, Notification.state)):
            counts.setdefault(tid, {})[state] = n
        states = {r.target: r for r in s.exec(select(NotifyTargetState))}
    out = []
    for tid in sorted(set(counts) | set(states)):
        st, c = states.get(tid), counts.get(tid, {})
        out.append({"target": tid, "kind": st.kind if st else None, "where": st.where if st else None,
                    "sent": c.get("sent", 0), "pending": c.get("pending", 0) + c.get("sending", 0),
                    "failed": c.get("failed", 0), "dead": bool(st and st.dead),
                    "fails_in_row": st.fails_in_row if st else 0,
                    "failing_since": st.failing_since if st else None,
                    "last_error": st.last_error if st else None})
    return {"targets": out, "dead": [t["target"] for t in out if t["dead"]]}


def status_lines(notify: dict[str, Any]) -> list[str]:
    lines = []
    for t in notify.get("targets", []):
        counts = f"{t['sent']} sent, {t['pending']} pending, {t['failed']} failed"
        if t["dead"]:
            since = time.strftime("%Y-%m-%d %H:%M", time.localtime(t["failing_since"] or 0))
            lines.append(f"notify: {t['target']} ({t['kind']}, {t['where']}) DEAD: {t['fails_in_row']} failed "
                         f"attempts in a row since {since} ({t['last_error']}); {counts}")
        else:
            lines.append(f"notify: {t['target']} ({t['kind']}, {t['where']}) ok; {counts}")
    return lines
