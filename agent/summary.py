"""Per-hypothesis summaries for human review, written at the terminal decision (and at a hold).

The numbers come from the gate's stored record and the store's compute accounting, never from a
policy: code inserts the evidence table. Only the prose around it — what was tried, what the
evidence says, follow-ups — is written by the LLM when the policy has one (`prompts/summarize.md`),
and by `agent/templates/` otherwise.

Number integrity: every number in the LLM's prose must be one it was given — a value of the gate's
record (Δ, interval bounds, p, q, means, σ, t, run counts…) or a number in the material the prompt
showed (hypothesis, diff, decision rationale, compute) — allowing for rounding, a dropped sign and
percent notation. A `tried` or `interpretation` quoting any other number rejects the LLM's prose:
the template's prose is used and the summary says why. A follow-up quoting one is dropped (a
correction; the rest of the prose stands). The author is stored as `summary_author` ("llm" or
"template").

Untrusted text: every string a branch or an LLM wrote (titles, rationale, prose, follow-ups) is
escaped so that no link, image, autolink or HTML survives in the markdown (`untrusted`); stage
output (a smoke reject reason quotes the stage's stderr) and the diff are fenced as code (`fenced`).

The forest plot is drawn before the text so the summary can link it; the lab's progress chart is
redrawn at every summary (`agent.pictures`).
"""

from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent import pictures, prompts
from agent.errors import LLMError
from agent.lifecycle import Decision, Status
from agent.pictures import forest_path, progress_path
from agent.policy import llm_client
from agent.progress import split_progress
from agent.records import Hypothesis
from agent.verdicts import replicate_record
from pipeline.api import SEED_BLOCK, UNSANDBOXED, RunStatus, StageOutcome, is_sandboxed

log = logging.getLogger("autoresearch.summary")

TEMPLATES = Path(__file__).resolve().parent / "templates"
TEMPLATE = TEMPLATES / "summary.md"
MAX_DIFF_LINES = 120
MAX_PROMPT_DIFF_CHARS = 12_000

SUMMARY_SCHEMA = {
    "type": "object",
    "properties": {
        "tried": {"type": "string", "minLength": 1},
        "interpretation": {"type": "string", "minLength": 1},
        "follow_ups": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["tried", "interpretation", "follow_ups"],
    "additionalProperties": False,
}

WHO = {"human": "A researcher", "offline": "The offline policy", "llm": "The LLM agent"}


def summary_path(lab: Any, hid: int) -> Path:
    return lab.state / "summaries" / f"{hid}.md"


def latest_result(svc: Any, h: Hypothesis) -> Any:
    """The gate's record of the hypothesis's last look (a `GateResult`), or None before any."""
    return svc.records.latest_verdict(h.id)


def compute_line(svc: Any, h: Hypothesis) -> str:
    """What the hypothesis cost: its challenger runs (CPU seconds, GPU-hours for a GPU lab), its
    promotion's replication, and its smoke runs before any of them (all that a rejected one cost)."""
    smoke = svc.store.smoke_spent(str(h.id))
    screened = ""
    if smoke["runs"]:
        screened = (f"{int(smoke['runs'])} smoke run{'s' if smoke['runs'] != 1 else ''} on tiny data, "
                    f"{smoke['cpu_s']:.0f} CPU s" + (f", {smoke['gpu_s'] / 3600:.3f} GPU-h" if smoke["gpu_s"] else ""))
    if not h.commit:
        return screened or "none"

    # a promoted champion's own re-verification runs (the next seed block) are not challenger runs
    block = svc.experiment.challenger_seeds(h.base_commit, SEED_BLOCK) if h.base_commit else range(0)
    runs = [r for r in svc.store.runs(commit=h.commit) if r.seed in block]
    execs = svc.store.stage_execs([r.id for r in runs]) if runs else []
    cpu = sum((e.cpu_s or 0.0) for e in execs if not StageOutcome(e.outcome).is_served())
    done = sum(r.status == RunStatus.DONE for r in runs)
    failed = sum(r.status == RunStatus.FAILED for r in runs)
    gpu = sum((e.gpu_s or 0.0) for e in execs)  # every attempt held its GPU share, served stages none
    line = f"{len(runs)} challenger runs ({done} done, {failed} failed), {cpu:.0f} CPU s"
    if gpu:
        line += f", {gpu / 3600:.3f} GPU-h"
    rep = replicate_record(svc.store, h.id)
    if rep is not None:  # its promotion's replication: both arms on the next block's first seeds
        fresh = set(rep["seeds"])
        both = [r for c in (h.commit, h.base_commit) if c for r in svc.store.runs(commit=c) if r.seed in fresh]
        line += f"; its replication {len(both)} runs of both arms on {len(fresh)} fresh seeds"
    return line + (f"; before them, {screened}" if screened else "")


# ----------------------------------------------------------------------------- number integrity

_NUMBER = re.compile(
    r"(?<![A-Za-z0-9_.#/\\-])"  # not inside an identifier, a version, a path or an id (#3, v2, 90d)
    r"(?P<sign>[-+−]?)(?P<mant>\d+(?:\.\d+)?|\.\d+)(?:[eE](?P<exp>[-+−]?\d+))?(?P<pct>%?)"
    r"(?![A-Za-z0-9_]|\.\d)"
)


@dataclass(frozen=True)
class Quoted:
    """A number as written: its value and how precisely it was written."""

    text: str
    value: float
    tolerance: float  # half a unit of the last digit written
    integer: bool  # written without decimals, exponent or percent: a count


def numbers_in(text: str) -> list[Quoted]:
    out = []
    for m in _NUMBER.finditer(text or ""):
        mant, exp = m.group("mant"), (m.group("exp") or "").replace("−", "-")
        decimals = len(mant.split(".")[1]) if "." in mant else 0
        value = float(mant) * (10 ** int(exp) if exp else 1)
        tol = 0.5 * 10 ** (-decimals + (int(exp) if exp else 0))
        if m.group("pct"):
            value, tol = value / 100, tol / 100
        if m.group("sign") in ("-", "−"):
            value = -value
        out.append(Quoted(m.group(0), value, tol, not (decimals or exp or m.group("pct"))))
    return out


def _walk_numbers(obj: Any) -> list[float]:
    if isinstance(obj, bool) or obj is None:
        return []
    if isinstance(obj, (int, float)):
        return [float(obj)] if math.isfinite(obj) else []
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _walk_numbers(v)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in _walk_numbers(v)]
    return []


def allowed_numbers(result: Any, texts: list[str]) -> list[float]:
    """The gate record's numbers (full precision), a few counts derived from it, and every number
    written in the material the model was shown."""
    nums: list[float] = []
    if result is not None:
        nums += _walk_numbers(result.to_json())
        tasks = result.tasks
        nums += [1 - 2 * result.alpha, len(tasks), sum("win" in t.flags for t in tasks),
                 sum("harm" in t.flags for t in tasks), sum((t.t or 0) > 0 for t in tasks)]
    for text in texts:
        nums += [q.value for q in numbers_in(text)]
    return nums


def _matches(q: Quoted, allowed: list[float]) -> bool:
    for v in allowed:
        if q.integer:
            if abs(v - round(v)) < 1e-9 and abs(abs(q.value) - abs(v)) < 1e-9:
                return True
        elif abs(abs(q.value) - abs(v)) <= q.tolerance * (1 + 1e-9) + 1e-12:
            return True
    return False


def foreign_numbers(text: str, allowed: list[float]) -> list[str]:
    """The numbers written in `text` that are none of `allowed` (with rounding, sign, percent)."""
    return [q.text for q in numbers_in(text) if not _matches(q, allowed)]


# ----------------------------------------------------------------------------- untrusted text

_MARKUP = re.compile(r"([\\\[\]<>])")


def untrusted(text: str, one_line: bool = False) -> str:
    """`text` as inert markdown: backslashes, brackets and angle brackets escaped, so no link, image,
    reference, autolink or HTML can be formed from it; a one-line field also loses its line breaks."""
    text = _MARKUP.sub(r"\\\1", text or "")
    return " ".join(text.split()) if one_line else text


def fenced(text: str, info: str = "") -> str:
    """`text` as a fenced code block, the fence longer than any run of backticks inside it."""
    longest = max((len(run) for run in re.findall(r"`+", text or "")), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{info}\n{text}\n{fence}"


# ----------------------------------------------------------------------------- prose

@dataclass
class Prose:
    tried: str
    interpretation: str
    follow_ups: list[str] = field(default_factory=list)
    author: str = "template"  # llm | template
    note: str = ""  # how the prose came to be, shown in the summary's header


def _fill(name: str, **values: Any) -> str:
    return (TEMPLATES / f"{name}.md").read_text().format_map(values).strip()


def _names(items: list[str]) -> str:
    return ", ".join(items) if items else "none"


def template_prose(h: Hypothesis, result: Any, diff_files: list[str], metric: str = "the metric") -> Prose:
    who = WHO.get(h.origin, f"The {h.origin} policy")
    if not h.commit:
        tried = _fill("tried_rejected", who=who, title=h.title, kind=h.reject_kind or "unknown")
    else:
        tried = _fill("tried", who=who, files=_names(diff_files), title=h.title, branch=h.branch or "-")
    if result is None:
        interpretation = "No runs were measured, so there is no evidence to interpret."
    else:
        tasks = result.tasks
        flagged = result.is_look
        wins = [t.task for t in tasks if flagged and "win" in t.flags]
        harms = [t.task for t in tasks if flagged and "harm" in t.flags]
        toward = [t.task for t in tasks if (t.t or 0) > 0]
        expected = [t for t in (h.expected_tasks or []) if t in {x.task for x in tasks}]
        verdict = (f"At look {result.look} ({result.look} challenger runs per task) the gate's verdict is "
                   f"**{result.verdict.value if result.verdict else 'none'}**" if result.is_look else
                   f"Between looks ({result.look} challenger runs) the gate reports estimates only")
        interpretation = _fill(
            "interpretation", verdict=verdict, wins=_names(wins), harms=_names(harms),
            toward=len(toward), n=len(tasks), expected=_names(expected),
            direction=f"{'higher' if result.higher_is_better else 'lower'} {metric}",
            expected_moved=_names([t for t in expected if t in wins]),
        )
    return Prose(tried, interpretation, [h.follow_up] if h.follow_up else [], "template", "the templates")


def _diff_parts(svc: Any, h: Hypothesis) -> tuple[str, str, list[str]]:
    if not (h.commit and h.base_commit):
        return "(no commit)", "", []
    ws = svc.workspace
    fork = ws.repo.merge_base(h.base_commit, h.commit)[0].hexsha
    lines = ws.diff(fork, h.commit).splitlines()
    diff = "\n".join(lines[:MAX_DIFF_LINES]) + (
        f"\n… {len(lines) - MAX_DIFF_LINES} more lines" if len(lines) > MAX_DIFF_LINES else "")
    return ws.diff_stat(fork, h.commit), diff, ws.changed_paths(fork, h.commit)


def _decision_line(h: Hypothesis) -> str:

    if h.decision == Decision.REJECT:
        return prompts.phrase("decision_rejected", kind=h.reject_kind)
    if h.status == Status.HELD:
        return prompts.phrase("decision_held", verdict=h.verdict)
    if h.promoted_tag:
        return prompts.phrase("decision_promoted", decision=h.decision, verdict=h.verdict, tag=h.promoted_tag)
    return prompts.phrase("decision_made", decision=h.decision, verdict=h.verdict)


def _decision_rationale(h: Hypothesis) -> str:
    return (h.reject_reason if h.decision == Decision.REJECT else h.rationale_decision) or ""


def _decision_rationale_md(h: Hypothesis) -> str:
    """The rationale in the summary: a reject reason (it may quote a stage's stderr) fenced as code."""
    text = _decision_rationale(h)
    if not text:
        return ""
    return fenced(text) if h.decision == Decision.REJECT else untrusted(text)


def metric_line(cfg: Any) -> str:
    """The metric and its direction: a summary's Δ reads the wrong way round without it."""

    direction = prompts.phrase("higher" if cfg.benchmark.higher_is_better else "lower")
    return prompts.phrase("metric", metric=cfg.benchmark.metric, direction=direction)


def llm_prose(svc: Any, h: Hypothesis, result: Any, evidence: str, diff_stat: str, diff: str,
              compute: str, fallback: Prose) -> Prose:
    """The LLM's prose, checked number by number against what it was shown; else `fallback`."""

    client = llm_client(svc.policy)
    cfg = svc.lab.config
    values = {
        "title": h.title, "rationale": h.rationale or prompts.phrase("not_given"),
        "expected_effect": prompts.phrase("expected_effect", effect=h.expected_effect or prompts.phrase("not_given"),
                                          tasks=", ".join(h.expected_tasks or [])),
        "diff_stat": diff_stat, "diff": diff[:MAX_PROMPT_DIFF_CHARS], "evidence": evidence,
        "decision": _decision_line(h), "decision_rationale": _decision_rationale(h), "compute": compute,
    }
    metric = metric_line(cfg)
    editable = prompts.md_list(list(cfg.lab.editable))
    system = prompts.render("system", lab_name=cfg.lab.name, editable=editable, metric=metric)
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": prompts.render("summarize", **values)}]
    try:
        out = client.complete_json("summarize", messages, SUMMARY_SCHEMA, "summary", hypothesis_id=str(h.id))
    except LLMError as e:  # budget, endpoint down, no valid answer: the template still tells the story
        fallback.note = f"template (the LLM gave no summary: {type(e).__name__})"
        svc.records.event("summary", f"#{h.id}: no LLM summary ({type(e).__name__}: {str(e)[:200]}); template used")
        return fallback
    allowed = allowed_numbers(result, [str(v) for v in values.values()] + [h.follow_up or "", str(h.id)])
    bad = foreign_numbers(out["tried"], allowed) + foreign_numbers(out["interpretation"], allowed)
    if bad:
        fallback.note = (f"template (the LLM's prose was rejected: it quoted {', '.join(bad[:5])}, "
                         f"not among the gate's numbers)")
        svc.records.event("summary", f"#{h.id}: LLM prose rejected, numbers not in the gate's record: "
                                     f"{', '.join(bad)}; template used")
        return fallback
    follow_ups, dropped = [], []
    for item in out["follow_ups"][:3]:
        (dropped if foreign_numbers(item, allowed) else follow_ups).append(item.strip())
    note = f"the LLM ({client.model}); every number checked against the gate's record"
    if dropped:
        note += f"; {len(dropped)} follow-up(s) quoting numbers not given to it dropped"
        svc.records.event("summary", f"#{h.id}: dropped LLM follow-ups with foreign numbers: {dropped}")
    if h.follow_up:
        follow_ups.insert(0, h.follow_up)
    return Prose(out["tried"].strip(), out["interpretation"].strip(), [f for f in follow_ups if f], "llm", note)


# ----------------------------------------------------------------------------- summary

def render_summary(svc: Any, h: Hypothesis, result: Any = None) -> tuple[str, Prose]:
    from pipeline.api import render_markdown

    evidence = render_markdown(result) if result is not None else "No runs were measured."
    replication = replicate_record(svc.store, h.id)
    if replication is not None:  # the promotion's replication on fresh seeds (`[gate] replicate_runs`)
        from pipeline.api import render_replication

        evidence += "\n\n" + render_replication(replication)
    diff_stat, diff, files = _diff_parts(svc, h)
    compute = compute_line(svc, h)
    prose = template_prose(h, result, files, svc.lab.config.benchmark.metric)

    if result is not None and llm_client(svc.policy) is not None:
        prose = llm_prose(svc, h, result, evidence, diff_stat, diff, compute, prose)

    pictures = []
    coming = getattr(svc, "painter", None) is not None  # drawn by the painter: there in a moment
    if forest_path(svc.lab, h.id).is_file() or (coming and result is not None):
        pictures.append(f"![task deltas]({forest_path(svc.lab, h.id).name})")
    if progress_path(svc.lab).is_file() or coming:
        pictures.append(f"[The lab's progress chart]({progress_path(svc.lab).name})")
    values = {
        "id": h.id,
        "title": untrusted(h.title, one_line=True),
        "decision_line": _decision_line(h),
        "origin": h.origin,
        "branch": h.branch or "-",
        "commit": (h.commit or "-")[:12],
        "base_commit": (h.base_commit or "-")[:12],
        "runs_line": compute,
        "metric_line": metric_line(svc.lab.config),
        "review": h.review,
        "author_line": prose.note,
        "tried": untrusted(prose.tried),
        "rationale": untrusted(h.rationale or "(none given)"),
        "expected_effect": untrusted(h.expected_effect or "(none given)", one_line=True),
        "expected_tasks": untrusted(", ".join(h.expected_tasks or []) or "(none)", one_line=True),
        "diff_stat": fenced(diff_stat),
        "diff": fenced(diff, "diff"),
        "look": h.look or 0,
        "evidence": evidence,
        "pictures": "\n\n".join(pictures),
        "interpretation": untrusted(prose.interpretation),
        "decision_rationale": _decision_rationale_md(h),
        "follow_ups": "\n".join(f"- {untrusted(f, one_line=True)}" for f in prose.follow_ups) or "- none suggested",
    }
    return TEMPLATE.read_text().format_map(values), prose


def progress_due(svc: Any, promoted: bool = False) -> bool:
    """Whether the progress chart is to be redrawn at this decision: always where the loop sets no
    `progress_every_s`; else at a promotion, when missing, or that long after its last drawing (it
    plots every hypothesis, so drawing it at each of thousands of decisions an hour would cost the
    loop more than all their gates; a loop that stops draws what it left out: `redraw_stale_progress`)."""

    every, last = svc.progress_every_s, svc.progress_drawn_at
    if (every is None or promoted or last is None or not pictures.progress_path(svc.lab).exists()
            or time.monotonic() - last >= every):
        svc.progress_drawn_at, svc.progress_stale = time.monotonic(), False
        return True
    svc.progress_stale = True
    return False


def redraw_stale_progress(svc: Any) -> None:
    """The progress chart as of now, if a decision since its last drawing was left out of it."""

    if not svc.progress_stale:
        return
    try:
        (svc.painter or pictures).write_progress(svc.lab, svc.store, svc.records)
        svc.progress_stale = False
    except Exception as e:  # a picture must never stop the loop
        log.warning("progress chart not drawn: %s: %s", type(e).__name__, e)


def draw_pictures(svc: Any, h: Hypothesis, result: Any) -> None:
    """The forest plot of this hypothesis and the lab's progress chart (by the loop's painter, in a
    process of its own, if it has one: the files appear a moment later); a failure only logs."""

    painter = getattr(svc, "painter", None) or pictures
    try:
        if result is not None:
            painter.write_forest(svc.lab, h.id, h.title, result)
        if progress_due(svc, promoted=h.promoted_tag is not None):
            painter.write_progress(svc.lab, svc.store, svc.records)
    except Exception as e:  # a picture must never stop the loop
        log.warning("hypothesis %s: pictures not drawn: %s: %s", h.id, type(e).__name__, e)


UNSANDBOXED_BANNER = (
    f"> **{UNSANDBOXED}**: this lab opted out of the sandbox (`[run] sandbox = \"off\"`). Its branch code "
    "could read the sealed labels, the store and the network: no number below is protected from it.\n\n")


def write_summary(svc: Any, h: Hypothesis) -> str:
    result = latest_result(svc, h)
    draw_pictures(svc, h, result)  # first: the summary links the files that exist
    text, prose = render_summary(svc, h, result)
    if not is_sandboxed(svc.lab):
        text = UNSANDBOXED_BANNER + text
    path = summary_path(svc.lab, h.id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    svc.records.update(h.id, summary_md=text, summary_author=prose.author)
    return text


# ----------------------------------------------------------------------------- digest

def digest_extras(lab: Any, store: Any, records: Any, since: float, briefs: list[Any] | None = None) -> dict[str, Any]:
    """What the digest adds to the command's data: baseline progress, holds, the progress chart.
    `briefs`: `records.briefs()` where the caller read them (a year's take half a second a read).

    Redraws `runs/summaries/progress.png` so the digest links a current picture.
    """

    briefs = records.briefs() if briefs is None else briefs
    points = pictures.progress_points(store, records, briefs)
    splits = split_progress(lab, store, records, briefs)
    hyps = {h.id: h for h in briefs}
    promotions = []
    for p in points:
        h = hyps[p.id]
        if p.decision == Decision.PROMOTE and (h.finished_at or 0) >= since:
            promotions.append({"id": p.id, "title": p.title, "tag": p.tag, "horizontal_delta": p.horizontal_delta,
                               "horizontal_ci": list(p.horizontal_ci), "level_before": p.base, "level_after": p.level})
    tags = [p.tag for p in points if p.tag]
    now = _level_now([p for p in points if p.base is not None])
    try:
        chart = str(pictures.write_progress(lab, store, records, splits, points))
    except Exception as e:
        log.warning("progress chart not drawn: %s: %s", type(e).__name__, e)
        chart = None
    return {
        "baseline": {
            "tag": tags[-1] if tags else None,
            "promotions": promotions,
            "level_start": promotions[0]["level_before"] if promotions else now,  # before the window's first promotion
            "level_now": now,
            "metric": lab.config.benchmark.metric,
            "higher_is_better": lab.config.benchmark.higher_is_better,
        },
        "held": [{"id": h.id, "title": h.title, "verdict": h.verdict} for h in hyps.values() if h.status == Status.HELD],
        "split_progress": splits,
        "progress_chart": chart,
    }


def _level_now(measured: list[Any]) -> float | None:
    """The latest measured baseline level, or the last promoted challenger's level if newer."""
    if not measured:
        return None
    last = measured[-1]
    return last.level if last.decision == Decision.PROMOTE else last.base
