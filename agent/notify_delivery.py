"""One notification delivered to one target: a JSON webhook (POST, no redirect followed), a
Slack-compatible `{"text"}` webhook (its text made inert: `slack_text`) or e-mail over SMTP; every
network operation bounded by a timeout, and every error scrubbed of the configured URLs' secrets
before it is stored, logged or shown (`Scrubber`)."""

from __future__ import annotations

import hashlib
import json
import re
import smtplib
import socket
import ssl
import urllib.parse
import urllib.request
from email.message import EmailMessage
from email.utils import formatdate
from typing import Any

from agent.notify_targets import Target
from agent.records import Notification

ERROR_MAX = 300
SECRET_MIN = 4  # a URL's path segment or query value shorter than this is no secret (and `***` would mangle words)
ZWSP = "\u200b"  # breaks a mention or a link in a Slack-compatible text without a visible change


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

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None

    return urllib.request.build_opener(NoRedirect)
