"""`autoresearch serve`: the morning review in a browser. Server-rendered (Starlette + Jinja2), no
JavaScript build; pages refresh themselves.

- `/` overview: the baseline and its history, the progress chart, queue and runs in flight, recent
  verdicts, compute and goodput, LLM spend, disk, guard/plateau/LLM events;
- `/hypotheses` with filters (status, decision, awaiting review);
- `/hypotheses/{id}`: the summary rendered, the forest plot, the per-seed picture (drawn on request
  from the store: `/files/{id}.seeds.png`), the per-task table, the diff, every look's verdict, links
  to the logs of failed runs and to the compare page with its parent or refinements;
- `/directions`: the hypotheses grouped by the config keys or files they changed (`agent.directions`),
  with each group's verdicts, decisions, banked gain, runs and last result;
- `/compare?a=ID&b=ID`: two hypotheses side by side: per-task Δ, the two diffs, the two verdict histories;
- `/timeline`: each promotion with its gate gain, its holdout gain and its re-verification;
- `POST /hypotheses/{id}/review`: approve / reject / comment, through `agent.commands.review` — the
  very function `autoresearch review` calls, so the loop sees the same rows (a comment joins the
  next prompts; an approval releases a supervised or plausibility hold at the loop's next pass).

Security: every request needs the server's token, on loopback too (Jupyter's convention: any local
user or process, a stage with `network = true` among them, can reach a loopback port). Unless one
is given (`--token`, `AUTORESEARCH_TOKEN`), the token is the lab's own: `runs/serve.token`, made
on first use (0600, ours, never read or written through a link) and reused across restarts. It
is printed once, in the URL on stderr; `?token=` then sets an HttpOnly cookie (named with the
port, so two servers on one host keep theirs) and redirects to the same page without it. A
request with neither gets 403. Off loopback, `serve` also asks for the token to be chosen
explicitly (`--token` or `--generate-token`). On loopback it answers only requests addressed to
a loopback name (a DNS name rebound to 127.0.0.1 gets 400, so another site's page cannot read a
form's CSRF token). Every form
carries a CSRF token (double-submit: a random cookie, SameSite=Strict, and the same value in the
form, compared in constant time) and an Origin (or, without one, a Referer) whose scheme, host and
port are the server's own: a cookie planted from another port of the same host is not enough. A POST
failing either is refused (403) and records nothing. No secret and no store URL is ever rendered; an
error is a page, never a traceback.
"""

from __future__ import annotations

import errno
import hmac
import ipaddress
import math
import os
import re
import secrets
import stat
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

from agent import commands
from agent.directions import direction_of, group_directions, label
from agent.lifecycle import Decision, Review, ReviewAction
from agent.pictures import forest_path, progress_path, summaries_dir
from agent.progress import split_progress
from agent.summary import summary_path
from agent.verdicts import replicate_record, reverify_record, verdicts_by_look
from agent.views import gpu_line, harness_line, smoke_line
from agent.workspace import Workspace
from pipeline.api import RunStatus, StageOutcome, UserError, baseline_number, read_tail

TEMPLATES = Path(__file__).resolve().parent / "web_templates"
CSRF_COOKIE, TOKEN_COOKIE = "ar_csrf", "ar_token"
PICTURE = re.compile(r"^(\d+\.forest|progress)\.png$")
SEEDS_PICTURE = re.compile(r"^(\d{1,12})\.seeds\.png$")  # drawn on request, never a file
# the only link and image targets a rendered summary keeps: the page's own /files/, or a bare file name
# beside it; any other URL (another host, a local service, javascript:, data:) stays inert text
OWN_LINK = re.compile(r"^(/files/)?\w[\w.-]*$")
LOG_MAX_BYTES = 2 << 20  # `/logs/{id}` serves at most the last 2 MB of a stage's log
DIFF_MAX_CHARS = 256 << 10  # a larger diff is shown as its `git diff --stat`
TOKEN_FILE = "serve.token"  # in the lab's state folder (runs/)
TOKEN_SHAPE = re.compile(r"^[A-Za-z0-9_.~-]{16,512}$")  # what a token file may hold (token_urlsafe makes these)


def lab_token(state: Path) -> tuple[str, bool]:
    """The lab's serve token and whether it was made now: read from `state/serve.token`, or made
    there (32 random bytes, URL-safe) when absent. The file is opened relative to the state
    folder with O_NOFOLLOW: a symlink, a file that is not regular, not ours or readable by others,
    or that holds no token, is refused in one line (`UserError`), never followed or rewritten."""

    path = state / TOKEN_FILE
    state.mkdir(parents=True, exist_ok=True)
    dfd = os.open(state, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for _ in range(3):  # another `serve` of this lab may be making it at the same moment
            try:
                fd = os.open(TOKEN_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
            except FileNotFoundError:
                token = secrets.token_urlsafe(32)
                tmp = f".{TOKEN_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                             dir_fd=dfd)
                try:
                    os.fchmod(fd, 0o600)
                    os.write(fd, f"{token}\n".encode())
                    os.fsync(fd)
                finally:
                    os.close(fd)
                try:  # link(2) never replaces: a token another server wrote first wins
                    os.link(tmp, TOKEN_FILE, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
                except FileExistsError:
                    continue
                finally:
                    os.unlink(tmp, dir_fd=dfd)
                return token, True
            except OSError as e:
                why = "a symlink" if e.errno == errno.ELOOP else os.strerror(e.errno or errno.EIO)
                raise UserError(f"{path}: {why}; not read (remove it: serve makes a new token)") from None
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise UserError(f"{path}: not a regular file; not read (remove it: serve makes a new token)")
                if st.st_uid != os.getuid() or st.st_mode & 0o077:
                    raise UserError(f"{path}: owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):04o}; "
                                    "expected ours and 0600 (remove it: serve makes a new token)")
                text = os.read(fd, 1024).decode("ascii", "replace").strip()
            finally:
                os.close(fd)
            if not TOKEN_SHAPE.match(text):
                raise UserError(f"{path}: holds no token (16 to 512 URL-safe characters); remove it: serve makes one")
            return text, False
        raise UserError(f"{path}: could not be made (another serve keeps replacing it)")
    finally:
        os.close(dfd)


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def origin_of(url: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an absolute http(s) URL, the default port filled in; None otherwise."""

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


def make_app(repo: Path, db: str | None, token: str, loopback: bool = True) -> Any:
    from markdown_it import MarkdownIt
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import FileResponse, PlainTextResponse, RedirectResponse, Response
    from starlette.routing import Route
    from starlette.templating import Jinja2Templates


    templates = Jinja2Templates(directory=str(TEMPLATES))
    md = MarkdownIt("commonmark", {"html": False}).enable("table")  # raw HTML in a summary is escaped
    md.validateLink = lambda url: bool(OWN_LINK.match(url))  # a summary quotes branch output: no off-site URL
    templates.env.filters["when"] = lambda t: time.strftime("%Y-%m-%d %H:%M", time.localtime(t)) if t else ""
    templates.env.globals["gpu_line"] = gpu_line
    templates.env.globals["smoke_line"] = smoke_line
    templates.env.globals["harness_line"] = harness_line
    templates.env.filters["num"] = lambda v, d=4: "-" if v is None else f"{v:+.{d}f}"

    def page(request: Request, name: str, status_code: int = 200, **ctx: Any) -> Response:
        csrf = request.cookies.get(CSRF_COOKIE) or secrets.token_urlsafe(24)
        t0 = getattr(request.state, "t0", None)
        took_ms = round((time.monotonic() - t0) * 1000, 1) if t0 is not None else None
        if ctx.get("refresh") and took_ms is not None:  # a slow page refreshes less often: an open tab
            ctx["refresh"] = max(int(ctx["refresh"]), math.ceil(took_ms / 1000 * REFRESH_COST))  # costs ≤ 1/10
        resp = templates.TemplateResponse(request, name, {"csrf": csrf, **ctx}, status_code=status_code)
        resp.set_cookie(CSRF_COOKIE, csrf, httponly=True, samesite="strict")
        if took_ms is not None:
            resp.headers["Server-Timing"] = f"page;dur={took_ms}"
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

        ws = Workspace(lab)
        tags = sorted(ws.baseline_tags(), key=tag_number)  # the latest few: the timeline has every one
        history = [{"tag": t, "commit": c.hexsha[:10], "when": c.committed_date}
                   for t in tags[-OVERVIEW_BASELINES:] for c in [ws.repo.commit(t)]]
        recent = [h for h in st["hypotheses"] if h["verdict"]][-10:][::-1]
        flying = []  # each hypothesis in flight: its challenger runs so far, done of queued
        for h in rec.briefs_of(list(st["in_flight"])):  # one query, without the hypotheses' texts
            runs = store.runs(commit=h.commit) if h.commit else []
            flying.append({"id": h.id, "title": h.title, "status": h.status, "look": h.look,
                           "done": sum(RunStatus(r.status).is_finished() for r in runs), "total": len(runs),
                           "running": sum(r.status == RunStatus.RUNNING for r in runs)})

        return page(request, "overview.html", st=st, history=history[::-1], baselines=len(tags), recent=recent,
                    flying=flying,
                    chart=progress_path(lab).is_file(), refresh=10)

    def hypotheses(request: Request) -> Response:
        _lab, _store, rec = lab_store()
        q = request.query_params
        raw = q.get("page", "1")
        if not (raw.isascii() and raw.isdigit()) or len(raw) > 9 or int(raw) < 1:
            raise HTTPException(400, f"page must be a number from 1 ({raw[:40]!r})")
        number = int(raw)
        rows, total = rec.page_briefs(status=q.get("status") or None, decision=q.get("decision") or None,
                                      review=Review.PENDING if q.get("review") == Review.PENDING else None,
                                      offset=(number - 1) * HYPOTHESES_PAGE, limit=HYPOTHESES_PAGE)
        pages = max(1, -(-total // HYPOTHESES_PAGE))
        keep = {k: v for k, v in q.items() if k in ("status", "decision", "review") and v}

        def link(n: int) -> str:
            return "/hypotheses?" + urlencode({**keep, "page": n})

        return page(request, "hypotheses.html", rows=rows, q=dict(q), total=total, number=number, pages=pages,
                    first=(number - 1) * HYPOTHESES_PAGE + 1, newer=link(number - 1) if number > 1 else None,
                    older=link(number + 1) if number < pages else None)

    def hypothesis(request: Request) -> Response:

        hid = int(request.path_params["hid"])
        lab, store, rec = lab_store()
        h = rec.get(hid)
        summary = summary_path(lab, hid)
        html = md.render(summary.read_text(encoding="utf-8")) if summary.is_file() else ""
        # the summary links its pictures beside it (runs/summaries/): here they are under /files/
        html = re.sub(r'(src|href)="((?:\d+\.forest|progress)\.png)"', r'\1="/files/\2"', html)
        looks = [g.to_json() | {"look": look} for look, g in verdicts_by_look(store, hid).items()]
        diff, diff_note = bounded_diff(Workspace(lab), h)
        failed = []
        if h.commit:
            ids = [r.id for r in store.runs(commit=h.commit)]
            failed = [e for e in store.stage_execs(ids) if StageOutcome(e.outcome).is_failure() and e.log_path]
        comments = rec.comments(hid, limit=50)
        related = ([("parent", h.parent_id)] if h.parent_id else []) + [
            ("refinement", c.id) for c in rec.children(h.id)]
        return page(request, "hypothesis.html", h=h, summary=html, looks=looks, last=looks[-1] if looks else None,
                    diff=diff, diff_note=diff_note, failed=failed, comments=comments, related=related,
                    forest=forest_path(lab, hid).is_file() and f"{hid}.forest.png" not in html,
                    seeds=bool(h.commit and h.base_commit), can_decide=Review(h.review).is_open(), refresh=30)

    def directions(request: Request) -> Response:

        lab, store, rec = lab_store()
        groups = group_directions(Workspace(lab), store, rec)
        verdicts = sorted({v for g in groups for v in g.verdicts})
        decisions = sorted({d for g in groups for d in g.decisions})
        return page(request, "directions.html", groups=groups, verdicts=verdicts, decisions=decisions, refresh=60)

    def compare(request: Request) -> Response:

        q = request.query_params
        if not q.get("a") and not q.get("b"):  # the nav's link: pick two
            _lab, _store, rec = lab_store()
            # the latest 200 proposed (untitled: not proposed yet), not a year's rows with their texts
            return page(request, "compare_pick.html", rows=[h for h in rec.latest_briefs(400) if h.title][::-1][:200])
        ids = []
        for k in ("a", "b"):
            v = q.get(k, "").strip()
            if not v.isdigit() or len(v) > 12:
                raise HTTPException(400, f"compare needs two hypothesis ids: ?a=ID&b=ID ({k} is {v[:40]!r})")
            ids.append(int(v))
        lab, store, rec = lab_store()
        ws = Workspace(lab)
        sides = []
        for hid in ids:
            h = rec.get(hid)  # an unknown id: UserError "no hypothesis N", a 404 page
            looks = [g.to_json() | {"look": look} for look, g in verdicts_by_look(store, hid).items()]
            diff, note = bounded_diff(ws, h)
            sides.append({"h": h, "looks": looks, "last": looks[-1] if looks else None, "diff": diff,
                          "diff_note": note, "direction": label(direction_of(ws, h))})
        order = list(dict.fromkeys(t["task"] for s in sides if s["last"] for t in s["last"]["tasks"]))
        tasks = [{"task": t, "sides": [next((x for x in (s["last"] or {}).get("tasks", []) if x["task"] == t), {})
                                       for s in sides]} for t in order]
        return page(request, "compare.html", a=sides[0], b=sides[1], tasks=tasks)

    def timeline(request: Request) -> Response:

        lab, store, rec = lab_store()
        split = split_progress(lab, store, rec)
        own = {p["label"]: p for p in split["points"]}
        start = own.get("start")
        sign = 1.0 if lab.config.benchmark.higher_is_better else -1.0
        promotions, prev = [], start
        for h in sorted((h for h in rec.briefs() if h.decision == Decision.PROMOTE and h.promoted_tag),
                        key=lambda h: (tag_number(h.promoted_tag), h.id)):
            latest = rec.latest_verdict(h.id)
            last = latest.to_json() if latest is not None else {}
            deltas = [t["delta"] for t in last.get("tasks", []) if t.get("delta") is not None]
            p = own.get(h.promoted_tag)
            step = None
            if p and prev and p["holdout"] is not None and prev["holdout"] is not None:
                step = sign * (p["holdout"] - prev["holdout"])
            promotions.append({"h": h, "gate": last.get("horizontal") or {}, "look": last.get("look"),
                               "alpha": last.get("alpha"), "mean_delta": sum(deltas) / len(deltas) if deltas else None,
                               "own": p, "holdout_step": step, "reverify": reverify_record(store, h.id),
                               "replicate": replicate_record(store, h.id)})
            prev = p or prev
        return page(request, "timeline.html", promotions=promotions[::-1], split=split, start=start,
                    metric=lab.config.benchmark.metric, higher=lab.config.benchmark.higher_is_better, refresh=60)

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
        if action not in tuple(ReviewAction):
            raise HTTPException(400, f"unknown action {action!r}")
        if action == "comment" and not text:
            raise HTTPException(400, "an empty comment")
        from starlette.concurrency import run_in_threadpool

        await run_in_threadpool(commands.review, repo, db, hid, approve=action == ReviewAction.APPROVE, reject=action == ReviewAction.REJECT,
                                comment=text)  # the database and git off the event loop, like the pages
        return RedirectResponse(f"/hypotheses/{hid}", status_code=303)

    def picture(request: Request) -> Response:

        name = request.path_params["name"]
        lab, store, rec = lab_store()
        m = SEEDS_PICTURE.match(name)
        if m:  # drawn from the store on request, into memory: nothing is written beside the summaries
            from agent.pictures_seeds import draw_seeds, seed_view

            view = seed_view(lab, store, rec.get(int(m.group(1))))
            if view is None:
                raise HTTPException(404, "no runs to draw yet")
            return Response(draw_seeds(view), media_type="image/png", headers={"Cache-Control": "no-store"})
        path = summaries_dir(lab) / name
        if not PICTURE.match(name) or not path.is_file():
            raise HTTPException(404, "no such picture")
        return FileResponse(path, media_type="image/png", headers={"Cache-Control": "no-store"})

    def stage_log(request: Request) -> Response:

        lab, store, _rec = lab_store()
        ex = store.stage_exec(int(request.path_params["eid"]))
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
        """Every request carries the token: `?token=` once (answered with the cookie and a redirect to
        the same page without it, so it stays out of history and Referers), then the cookie."""
        request.state.t0 = time.monotonic()  # `page`: how long the page took
        cookie = f"{TOKEN_COOKIE}_{request.url.port or ''}"  # cookies ignore ports: one per server
        given = request.query_params.get("token")
        if not hmac.compare_digest((given or request.cookies.get(cookie) or "").encode(), token.encode()):
            return PlainTextResponse("this server needs its token: open the URL it printed (…/?token=…); "
                                     "for the lab's own, see runs/serve.token", status_code=403)
        if given is None:
            return await call_next(request)
        rest = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]

        to = request.url.path + (f"?{urlencode(rest)}" if rest else "")
        resp = RedirectResponse(to, status_code=303) if request.method in ("GET", "HEAD") else await call_next(request)
        resp.set_cookie(cookie, token, httponly=True, samesite="strict")
        return resp

    from starlette.middleware import Middleware
    from starlette.middleware.base import BaseHTTPMiddleware

    routes = [Route("/", overview), Route("/hypotheses", hypotheses), Route("/hypotheses/{hid:int}", hypothesis),
              Route("/hypotheses/{hid:int}/review", review, methods=["POST"]),
              Route("/files/{name}", picture), Route("/logs/{eid:int}", stage_log),
              Route("/directions", directions), Route("/compare", compare), Route("/timeline", timeline)]
    middleware = [Middleware(BaseHTTPMiddleware, dispatch=gate)]
    if loopback:  # only loopback names, or a rebound DNS name would make a page same-origin
        from starlette.middleware.trustedhost import TrustedHostMiddleware

        middleware.insert(0, Middleware(TrustedHostMiddleware, allowed_hosts=["127.0.0.1", "localhost", "::1"]))
    return Starlette(routes=routes, middleware=middleware,
                     exception_handlers={Exception: error_page, HTTPException: error_page})


REFRESH_COST = 10  # a page that took t s to make refreshes after 10 t s at the earliest (its base period else)
OVERVIEW_BASELINES = 12  # the overview's latest baselines (a year holds hundreds: /timeline lists them)
HYPOTHESES_PAGE = 200  # the list page shows this many, newest first, with links to older pages


def tag_number(tag: str) -> int:

    n = baseline_number(tag)
    return n if n is not None else 1 << 30


def bounded_diff(ws: Any, h: Any) -> tuple[str, str]:
    """The hypothesis's diff against its fork point with its base, and a note: over `DIFF_MAX_CHARS`
    (a committed data file, not sent on every refresh) its `git diff --stat` instead."""
    if not (h.commit and h.base_commit):
        return "", ""
    fork = ws.repo.merge_base(h.base_commit, h.commit)
    if not fork:
        return "", ""
    diff = ws.diff(fork[0].hexsha, h.commit)
    if len(diff) > DIFF_MAX_CHARS:
        return (ws.diff_stat(fork[0].hexsha, h.commit),
                f"the diff is {len(diff) >> 10} KB, over {DIFF_MAX_CHARS >> 10} KB: its summary only")
    return diff, ""


def serve(repo: Path, db: str | None, host: str, port: int, token: str | None, generate_token: bool,
          say: Any = print) -> None:
    """Serve the lab's review page. The token: `token` if given, else the lab's own (`lab_token`);
    off loopback one of `token` or `generate_token` must say so explicitly."""
    import uvicorn


    lab, _store, _rec = commands.open_lab_store(repo, db)  # a wrong --repo or store: one line before binding
    loopback = is_loopback(host)
    if not loopback and not token and not generate_token:
        raise UserError(f"--host {host} is not loopback: the page would be open to the network; give a token "
                        "(--token, AUTORESEARCH_TOKEN, or --generate-token for the lab's own)")
    if token and not TOKEN_SHAPE.match(token):
        raise UserError("--token: expected 16 to 512 URL-safe characters (letters, digits, '-', '_', '.', '~')")
    note = ""
    if not token:
        token, made = lab_token(lab.state)
        note = f" (token {'made and kept' if made else 'read from'} {lab.state / TOKEN_FILE}, mode 0600)"
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else f"[{host}]" if ":" in host else host
    say(f"serving {repo} on http://{shown}:{port}/?token={token}{note}")
    uvicorn.run(make_app(repo, db, token, loopback), host=host, port=port, log_level="warning")
