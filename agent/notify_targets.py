"""Where notifications go: `[notify]` targets and `run --notify URL`s resolved into `Target`s, with
their secrets read from the environment only. A URL with user info (`user:password@host`) is
refused (`resolve`, at `run`; `check_urls` for a check without a run)."""

from __future__ import annotations

import hashlib
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from agent.config import NotifyTarget
from pipeline.api import UserError


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
    """A `[notify]` target (agent.config.NotifyTarget) with its secrets read from `env`."""
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
