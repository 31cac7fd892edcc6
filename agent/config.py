"""The agent's own tables of `research.toml`: `[agent]` (the LLM's model, its budgets and timeouts, the
loop's knobs) and `[notify]` (where notifications go). The pipeline keeps these tables raw and reads
nothing of them (`pipeline.lab.CLIENT_TABLES`); they are validated here, with the same one-line
errors as the pipeline's own tables (`LabConfigError`: the file, the key, what was expected).

    lab = open_lab(root)            # `load_lab` and these tables checked: one line if either is wrong
    cfg = agent_config(lab)         # AgentConfig: .agent (AgentSection), .notify (NotifySection)
"""

from __future__ import annotations

import re
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from pipeline.api import ENV_NAME, Lab, load_lab, parse_client_tables

INLINE_URL_WARNING = ("[notify] target {name}: its url has a path or query, which for Slack-style hooks is "
                      "the secret; research.toml is committed and every stage can read it; prefer url_env")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PriceSection(_Strict):
    """`[agent] price_per_mtok`: what the lab's model costs, USD per million tokens."""

    input: float = Field(ge=0)
    output: float = Field(ge=0)


class AgentSection(_Strict):
    model: str = "gpt-4.1-mini"
    # hypotheses measured at once; None: derived from the executor's slots (agent.loop.in_flight_room)
    max_in_flight: int | None = Field(default=None, ge=1)
    max_usd_per_day: float = Field(default=20.0, ge=0)  # applies to a model with a price only
    max_tokens_per_day: int | None = Field(default=None, ge=1)  # prompt + completion tokens, any model
    price_per_mtok: PriceSection | None = None  # None: the client's dated price list (agent.llm_prices.PRICES)
    repair_rounds: int = Field(default=2, ge=0)
    plateau_after: int = Field(default=20, ge=1)  # measured hypotheses in a row without a promotion
    # one streamed LLM answer, whole (15 tokens/s writes the largest default answer, 8000 tokens, in it)
    request_timeout_s: float = Field(default=600.0, gt=0)
    idle_timeout_s: float = Field(default=120.0, gt=0)  # no token (the first included) this long: given up
    request_attempts: int = Field(default=6, ge=1, le=20)  # per request, on 429/5xx/refused connections
    # the bound on each LLM answer, by purpose; unset purposes keep the client's defaults
    max_output_tokens: dict[str, int] = Field(default_factory=dict)

    @field_validator("max_output_tokens")
    @classmethod
    def _purposes(cls, bounds: dict[str, int]) -> dict[str, int]:
        known = ("propose", "implement", "decide", "summarize")
        for purpose, n in bounds.items():
            if purpose not in known:
                raise ValueError(f"a purpose among {', '.join(known)}, not {purpose!r}")
            if not isinstance(n, int) or isinstance(n, bool) or n < 16:
                raise ValueError(f"at least 16 tokens for {purpose}")
        return bounds


# `[notify]`: plain data, checked here; the sending is the agent's (agent/notify.py)
NOTIFY_EVENTS = ("hold", "promote", "abandon", "plateau", "llm_down", "llm_up", "guard", "takeover", "disk",
                 "environment", "digest")
NOTIFY_OPTIONAL_EVENTS = ("budget", "reverified", "error", "notify_dead")  # not sent unless listed


def _events(names: list[str]) -> list[str]:
    known = NOTIFY_EVENTS + NOTIFY_OPTIONAL_EVENTS
    for name in names:
        if name not in known:
            raise ValueError(f"an event among {', '.join(known)}, not {name!r}")
    return names


def _http_url(url: str) -> str:
    if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", url):
        raise ValueError("an http:// or https:// URL")  # not echoed: a webhook URL may hold a token
    return url


class NotifyTarget(_Strict):
    """One place notifications go: a JSON webhook, a Slack-compatible `{"text"}` webhook, or e-mail."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
    kind: Literal["webhook", "slack", "email"]
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]{1,40}$")
    url: str | None = None  # webhook, slack: http(s)://…
    url_env: str | None = Field(default=None, pattern=ENV_NAME.pattern)  # the URL from this variable (tokens)
    smtp_host: str | None = Field(default=None, min_length=1)  # email
    smtp_port: int = Field(default=587, ge=1, le=65535)
    starttls: StrictBool = True
    username: str | None = None
    password_env: str | None = Field(default=None, pattern=ENV_NAME.pattern)  # never the password itself
    sender: str | None = Field(default=None, alias="from", pattern=r"^[^@\s]+@[^@\s]+$")
    to: list[str] = Field(default_factory=list)
    events: list[str] | None = None  # None: [notify] events

    @field_validator("url")
    @classmethod
    def _url(cls, url: str | None) -> str | None:
        return url if url is None else _http_url(url)

    @field_validator("to")
    @classmethod
    def _addresses(cls, to: list[str]) -> list[str]:
        for a in to:
            if not re.fullmatch(r"[^@\s,]+@[^@\s,]+", a):
                raise ValueError(f"an e-mail address, not {a!r}")
        return to

    @field_validator("events")
    @classmethod
    def _known_events(cls, names: list[str] | None) -> list[str] | None:
        return names if names is None else _events(names)

    @model_validator(mode="after")
    def _complete(self) -> "NotifyTarget":
        if self.kind == "email":
            if self.url is not None or self.url_env is not None:
                raise ValueError("smtp_host, to and from for an e-mail target, not url or url_env")
            if not self.smtp_host:
                raise ValueError("smtp_host for an e-mail target")
            if not self.to:
                raise ValueError("at least one address in to for an e-mail target")
            if self.password_env and not self.username:
                raise ValueError("a username with password_env")
        else:
            if (self.url is None) == (self.url_env is None):
                raise ValueError(f"exactly one of url or url_env (a variable holding the URL) for a {self.kind} "
                                 "target")
            wrong = [k for k in ("smtp_host", "username", "password_env", "sender", "to") if getattr(self, k)]
            if wrong:
                raise ValueError(f"url or url_env for a {self.kind} target, not {wrong[0].replace('sender', 'from')}")
        return self


class NotifySection(_Strict):
    target: list[NotifyTarget] = Field(default_factory=list)
    events: list[str] = Field(default_factory=lambda: list(NOTIFY_EVENTS))
    digest_at: str | None = None  # local time "HH:MM": a daily digest
    web_url: str | None = None  # the review page's address (`autoresearch serve`): holds link to it
    max_attempts: int = Field(default=8, ge=1, le=100)
    backoff_s: float = Field(default=30.0, gt=0)  # the first retry's wait, doubling
    backoff_max_s: float = Field(default=3600.0, gt=0)
    timeout_s: float = Field(default=10.0, gt=0, le=300)  # each network operation
    rate_per_hour: int = Field(default=60, ge=1)  # per target
    dead_after: int = Field(default=3, ge=1)  # failed attempts in a row that make a target dead in `status`

    @field_validator("events")
    @classmethod
    def _known_events(cls, names: list[str]) -> list[str]:
        return _events(names)

    @field_validator("digest_at")
    @classmethod
    def _hh_mm(cls, at: str | None) -> str | None:
        if at is not None and not re.fullmatch(r"([01][0-9]|2[0-3]):[0-5][0-9]", at):
            raise ValueError(f'a local time "HH:MM" (00:00 to 23:59), not {at!r}')
        return at

    @field_validator("web_url")
    @classmethod
    def _web(cls, url: str | None) -> str | None:
        return url if url is None else _http_url(url)


class AgentConfig(_Strict):
    """The agent's tables of one lab's `research.toml`."""

    agent: AgentSection = AgentSection()
    notify: NotifySection = NotifySection()


def agent_config(lab: Lab) -> AgentConfig:
    """The lab's `[agent]` and `[notify]`, validated (`LabConfigError` if not); read once per lab object."""
    cached = lab.__dict__.get("_agent_config")
    if cached is not None and cached[0] is lab.config:
        return cached[1]
    cfg = parse_client_tables(AgentConfig, lab.config, lab.config_path)
    lab.__dict__["_agent_config"] = (lab.config, cfg)
    return cfg


def open_lab(root: Any, check_files: bool = True) -> Lab:
    """`pipeline.api.load_lab`, and the agent's tables checked: every command of the agent opens a lab so,
    and a mistake anywhere in research.toml is one line before anything runs."""
    lab = load_lab(root, check_files=check_files)
    agent_config(lab)
    return lab


def config_warnings(lab: Lab) -> list[str]:
    """The pipeline's warnings (`Lab.config_warnings`) and the agent's: a webhook URL with its secret in
    research.toml, which is committed and which every stage can read."""
    out = lab.config_warnings()
    for t in agent_config(lab).notify.target:
        if t.url and (urlsplit(t.url).path.strip("/") or urlsplit(t.url).query):
            out.append(INLINE_URL_WARNING.format(name=t.name or t.kind))
    return out
