"""`autoresearch serve`: the morning review in a browser. Server-rendered (Starlette + Jinja2), no
JavaScript build; pages refresh themselves.

- `/` overview: the baseline and its history, the progress chart, queue and runs in flight, recent
  verdicts, compute and goodput, LLM spend, disk, guard/plateau/LLM events;
- `/hypotheses` with filters (status, decision, awaiting review);
- `/hypotheses/{id}`: the summary rendered, the forest plot, the per-task table, the diff, every
  look's verdict, links to the logs of failed runs;
- `POST /hypotheses/{id}/review`: approve / reject / comment, through `agent.commands.review` — the
  very function `autoresearch review` calls, so the loop sees the same rows (a comment joins the
  next prompts; an approval releases a supervised or plausibility hold at the loop's next pass).

Security: loopback by default, answering only requests addressed to a loopback name (a DNS name
rebound to 127.0.0.1 gets 400, so another site's page cannot read a form's CSRF token); any other
host needs a token (`--token`, `AUTORESEARCH_TOKEN`, or
`--generate-token`, printed once), asked for once and kept in an HttpOnly cookie. Every form
carries a CSRF token (double-submit: a random cookie, SameSite=Strict, and the same value in the
form, compared in constant time) and an Origin (or, without one, a Referer) whose scheme, host and
port are the server's own: a cookie planted from another port of the same host is not enough. A POST
failing either is refused (403) and records nothing. No secret and no store URL is ever rendered; an
error is a page, never a traceback.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
import secrets
import time
from pathlib import Path
from typing import Any

TEMPLATES = Path(__file__).resolve().parent / "web_templates"
CSRF_COOKIE, TOKEN_COOKIE = "ar_csrf", "ar_token"
PICTURE = re.compile(r"^(\d+\.forest|progress)\.png$")
# the only link and image targets a rendered summary keeps: the page's own /files/, or a bare file name
# beside it; any other URL (another host, a local service, javascript:, data:) stays inert text
OWN_LINK = re.compile(r"^(/files/)?\w[\w.-]*$")
LOG_MAX_BYTES = 2 << 20  # `/logs/{id}` serves at most the last 2 MB of a stage's log
DIFF_MAX_CHARS = 256 << 10  # a larger diff is shown as its `git diff --stat`


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def origin_of(url: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an absolute http(s) URL, the default port filled in; None otherwise."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        return None
    return parts.scheme, parts.hostname.lower(), port


def same_origin(headers: Any, own_url: str) -> bool:
    """Whether the request's Origin (or, with none, its Referer) is the server's own origin."""
    sent = headers.get("origin") or headers.get("referer") or ""
    theirs, ours = origin_of(sent), origin_of(own_url)
    return theirs is not None and theirs == ours


def make_app(repo: Path, db: str | None, token: str | None = None) -> Any:
    from markdown_it import MarkdownIt
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import FileResponse, PlainTextResponse, RedirectResponse, Response
    from starlette.routing import Route
    from starlette.templating import Jinja2Templates

    from agent import commands
    from pipeline.errors import UserError

    templates = Jinja2Templates(directory=str(TEMPLATES))
    md = MarkdownIt("commonmark", {"html": False}).enable("table")  # raw HTML in a summary is escaped
    md.validateLink = lambda url: bool(OWN_LINK.match(url))  # a summary quotes branch output: no off-site URL
    templates.env.filters["when"] = lambda t: time.strftime("%Y-%m-%d %H:%M", time.localtime(t)) if t else ""
    templates.env.filters["num"] = lambda v, d=4: "-" if v is None else f"{v:+.{d}f}"

    def page(request: Request, name: str, status_code: int = 200, **ctx: Any) -> Response:
        csrf = request.cookies.get(CSRF_COOKIE) or secrets.token_urlsafe(24)
        resp = templates.TemplateResponse(request, name, {"csrf": csrf, **ctx}, status_code=status_code)
        resp.set_cookie(CSRF_COOKIE, csrf, httponly=True, samesite="strict")
        return resp

    opened: list[tuple[Any, Any, Any]] = []

    def lab_store() -> tuple[Any, Any, Any]:
        """One lab, store and records for the app's life (pages refresh every few seconds)."""
        if not opened:
            opened.append(commands.open_lab_store(repo, db))
        return opened[0]

    def overview(request: Request) -> Response:
        lab, store, rec = lab_store()
        st = commands.status_of(lab, store, rec)
        from agent.workspace import Workspace

        ws = Workspace(lab)
        history = [{"tag": t, "commit": ws.repo.commit(t).hexsha[:10],
                    "when": ws.repo.commit(t).committed_date} for t in ws.baseline_tags()]
        recent = [h for h in st["hypotheses"] if h["verdict"]][-10:][::-1]
        flying = []  # each hypothesis in flight: its challenger runs so far, done of queued
        for hid in st["in_flight"]:
            h = rec.get(hid)
            runs = store.runs(commit=h.commit) if h.commit else []
            flying.append({"id": h.id, "title": h.title, "status": h.status, "look": h.look,
                           "done": sum(r.status in ("done", "failed") for r in runs), "total": len(runs),
                           "running": sum(r.status == "running" for r in runs)})
        from agent.pictures import progress_path

        return page(request, "overview.html", st=st, history=history[::-1], recent=recent, flying=flying,
                    chart=progress_path(lab).is_file(), refresh=10)

    def hypotheses(request: Request) -> Response:
        _lab, _store, rec = lab_store()
        q = request.query_params
        rows = rec.all()
        if q.get("status"):
            rows = [h for h in rows if h.status == q["status"]]
        if q.get("decision"):
            rows = [h for h in rows if h.decision == q["decision"]]
        if q.get("review") == "pending":
            rows = [h for h in rows if h.review == "pending"]
        return page(request, "hypotheses.html", rows=rows[::-1], q=dict(q))

    def hypothesis(request: Request) -> Response:
        from agent.pictures import forest_path
        from agent.summary import summary_path
        from agent.workspace import Workspace

        hid = int(request.path_params["hid"])
        lab, store, rec = lab_store()
        h = rec.get(hid)
        summary = summary_path(lab, hid)
        html = md.render(summary.read_text(encoding="utf-8")) if summary.is_file() else ""
        # the summary links its pictures beside it (runs/summaries/): here they are under /files/
        html = re.sub(r'(src|href)="((?:\d+\.forest|progress)\.png)"', r'\1="/files/\2"', html)
        looks = [r.payload | {"look": r.look} for r in store.gate_records(str(hid), kind="verdict")]
        diff, diff_note = "", ""
        if h.commit and h.base_commit:
            ws = Workspace(lab)
            fork = ws.repo.merge_base(h.base_commit, h.commit)
            diff = ws.diff(fork[0].hexsha, h.commit) if fork else ""
            if len(diff) > DIFF_MAX_CHARS:  # a committed data file: not sent on every refresh
                diff_note = f"the diff is {len(diff) >> 10} KB, over {DIFF_MAX_CHARS >> 10} KB: its summary only"
                diff = ws.diff_stat(fork[0].hexsha, h.commit)
        failed = []
        if h.commit:
            ids = [r.id for r in store.runs(commit=h.commit)]
            failed = [e for e in store.stage_execs(ids) if e.outcome in ("method", "timeout", "infra", "lost")
                      and e.log_path]
        comments = rec.comments(hid, limit=50)
        return page(request, "hypothesis.html", h=h, summary=html, looks=looks, last=looks[-1] if looks else None,
                    diff=diff, diff_note=diff_note, failed=failed, comments=comments,
                    forest=forest_path(lab, hid).is_file() and f"{hid}.forest.png" not in html,
                    can_decide=h.review in ("pending", "none"), refresh=30)

    async def review(request: Request) -> Response:
        hid = int(request.path_params["hid"])
        form = await request.form()
        sent, cookie = str(form.get("csrf") or ""), request.cookies.get(CSRF_COOKIE) or ""
        if not sent or not cookie or not hmac.compare_digest(sent, cookie):
            raise HTTPException(403, "the form's CSRF token is missing or wrong: reload the page and try again")
        if not same_origin(request.headers, str(request.base_url)):
            raise HTTPException(403, "the request's Origin (or Referer) is not this server: CSRF refused")
        action = str(form.get("action") or "comment")
        text = str(form.get("comment") or "").strip() or None
        if action not in ("approve", "reject", "comment"):
            raise HTTPException(400, f"unknown action {action!r}")
        if action == "comment" and not text:
            raise HTTPException(400, "an empty comment")
        from starlette.concurrency import run_in_threadpool

        await run_in_threadpool(commands.review, repo, db, hid, approve=action == "approve", reject=action == "reject",
                                comment=text)  # the database and git off the event loop, like the pages
        return RedirectResponse(f"/hypotheses/{hid}", status_code=303)

    def picture(request: Request) -> Response:
        from agent.pictures import summaries_dir

        name = request.path_params["name"]
        lab, _store, _rec = lab_store()
        path = summaries_dir(lab) / name
        if not PICTURE.match(name) or not path.is_file():
            raise HTTPException(404, "no such picture")
        return FileResponse(path, media_type="image/png", headers={"Cache-Control": "no-store"})

    def stage_log(request: Request) -> Response:
        from pipeline.disk import read_tail
        from pipeline.store import StageExec

        lab, store, _rec = lab_store()
        with store.session() as s:
            ex = s.get(StageExec, int(request.path_params["eid"]))
        logs = (lab.state / "logs").resolve()
        path = Path(ex.log_path).resolve() if ex is not None and ex.log_path else None
        if path is None or logs not in path.parents or not path.is_file():
            raise HTTPException(404, "no log for that stage (rotated, or never written)")
        text, size = read_tail(path, LOG_MAX_BYTES)
        if size > LOG_MAX_BYTES:
            text = (f"[the log is {size >> 20} MB: its last {LOG_MAX_BYTES >> 20} MB follow]\n"
                    + text.partition("\n")[2])  # from the first whole line
        return PlainTextResponse(text)

    async def error_page(request: Request, exc: Exception) -> Response:
        if isinstance(exc, HTTPException):
            code, msg = exc.status_code, exc.detail
        elif isinstance(exc, UserError):
            code, msg = (404 if str(exc).startswith("no hypothesis") else 400), str(exc)
        else:  # a bug: said as one line, no traceback and no internals on the page
            code, msg = 500, f"internal error ({type(exc).__name__}); see the server's log"
        return page(request, "error.html", status_code=code, code=code, message=msg)

    async def gate(request: Request, call_next: Any) -> Response:
        """Off loopback, every request carries the token: `?token=` once, then the cookie."""
        if token is None:
            return await call_next(request)
        given = request.query_params.get("token") or request.cookies.get(TOKEN_COOKIE) or ""
        if not hmac.compare_digest(given, token):
            return PlainTextResponse("this server needs its token: open the URL it printed (…/?token=…)",
                                     status_code=401)
        resp = await call_next(request)
        if request.query_params.get("token"):
            resp.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="strict")
        return resp

    from starlette.middleware import Middleware
    from starlette.middleware.base import BaseHTTPMiddleware

    routes = [Route("/", overview), Route("/hypotheses", hypotheses), Route("/hypotheses/{hid:int}", hypothesis),
              Route("/hypotheses/{hid:int}/review", review, methods=["POST"]),
              Route("/files/{name}", picture), Route("/logs/{eid:int}", stage_log)]
    middleware = [Middleware(BaseHTTPMiddleware, dispatch=gate)]
    if token is None:  # loopback: only loopback names, or a rebound DNS name would make a page same-origin
        from starlette.middleware.trustedhost import TrustedHostMiddleware

        middleware.insert(0, Middleware(TrustedHostMiddleware, allowed_hosts=["127.0.0.1", "localhost", "::1"]))
    return Starlette(routes=routes, middleware=middleware,
                     exception_handlers={Exception: error_page, HTTPException: error_page})


def serve(repo: Path, db: str | None, host: str, port: int, token: str | None, generate_token: bool,
          say: Any = print) -> None:
    import uvicorn

    from agent import commands
    from pipeline.errors import UserError

    commands.open_lab_store(repo, db)  # a wrong --repo or an unreachable store: one line before binding
    if not is_loopback(host):
        if not token and generate_token:
            token = secrets.token_urlsafe(24)
        if not token:
            raise UserError(f"--host {host} is not loopback: the page would be open to the network; give a token "
                            "(--token, AUTORESEARCH_TOKEN, or --generate-token)")
    else:
        token = token or None
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    say(f"serving {repo} on http://{shown}:{port}/" + (f"?token={token}" if token else ""))
    uvicorn.run(make_app(repo, db, token), host=host, port=port, log_level="warning")
