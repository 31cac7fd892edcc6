"""What the CLI's lab commands do, as plain functions returning data (the CLI only prints it).

Kept apart from `agent/cli.py` so the CLI module stays thin and starts fast: everything here is
imported inside the command that needs it.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import git

from agent.config import agent_config, config_warnings, open_lab
from agent.errors import UserError
from agent.ledger import Ledger, utc_day_start
from agent.lifecycle import Decision, Review, ReviewAction, Status
from agent.llm_prices import model_price
from agent.notify_targets import check_urls
from agent.progress import split_progress
from agent.records import ACTIVE, Hypothesis, Records
from agent.summary import digest_extras
from pipeline.api import (
    UNSANDBOXED,
    Experiment,
    Lab,
    LabRepo,
    RunStatus,
    disk_usage,
    is_sandboxed,
    lab_pairing,
    lease,
    memory_plan,
    mps_running,
    open_store,
)


def open_lab_store(repo: Path, db: str | None) -> tuple[Lab, Any, Records]:
    lab = open_lab(repo)
    store = open_store(lab, db)
    return lab, store, Records(store)


def parse_duration(text: str) -> float:
    """'24h', '90m', '2d', '30s' → seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd])\s*", text or "")
    if not m:
        raise UserError(f"bad duration {text!r}; expected a number and a unit, like 24h, 90m, 2d")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


# ----------------------------------------------------------------------------- seed

def seed(repo: Path, db: str | None, text: str | None, title: str | None, priority: int, branch: str | None,
         file: Path | None) -> Hypothesis:
    lab, store, rec = open_lab_store(repo, db)
    h = Hypothesis(origin="human", priority=priority)  # queued
    if file is not None:
        if not file.is_file():
            raise UserError(f"{file}: no such file")
        body = file.read_text(encoding="utf-8")
        if file.suffix == ".json":
            try:
                data = json.loads(body)
            except json.JSONDecodeError as e:
                raise UserError(f"{file}: not valid JSON ({e})") from None
            if not isinstance(data, dict) or not isinstance(data.get("title"), str):
                raise UserError(f"{file}: expected an object with a 'title' (and 'rationale', 'edits')")
            from agent.workspace import EditRejected, FileEdit

            try:
                if not isinstance(data.get("edits", []), list):
                    raise EditRejected("malformed", "'edits' must be a list")
                edits = [FileEdit.from_dict(e) for e in data.get("edits", [])]
            except EditRejected as e:
                raise UserError(f"{file}: {e}") from None
            h.title = data["title"]
            h.rationale = str(data.get("rationale", ""))
            h.expected_effect = str(data.get("expected_effect", ""))
            expected = data.get("expected_tasks", [])
            if not isinstance(expected, list) or any(t not in lab.tasks() for t in expected):
                raise UserError(f"{file}: expected_tasks must be a list of task names from {lab.tasks()}")
            h.expected_tasks = expected or lab.tasks()
            h.plan = [e.to_dict() for e in edits] or None
        else:
            text = (text + "\n\n" if text else "") + body
    if branch is not None:
        from agent.workspace import Workspace

        Workspace(lab).resolve(branch)  # unknown branch: bad input now, not a failure later
        h.seed_branch = branch
        h.title = h.title or title or f"Branch {branch}"
        h.rationale = h.rationale or text or f"Evaluate the researcher's branch {branch} as-is."
        h.expected_effect = h.expected_effect or "as the researcher expects"
        h.expected_tasks = h.expected_tasks or lab.tasks()
    if not h.title:
        if not text or not text.strip():
            raise UserError("nothing to seed: give TEXT, --file or --branch")
        first = text.strip().splitlines()[0].lstrip("# ").strip()
        h.title = (title or first)[:120]
        h.rationale = text.strip()
        h.seed_text = text.strip()
        h.expected_effect = "to be pre-registered by the implementer"
        h.expected_tasks = lab.tasks()
    elif title:
        h.title = title
    return rec.add(h)


# ----------------------------------------------------------------------------- status

STATUS_HYPOTHESES = 100  # `status` lists the latest hypotheses (and counts every one); the web page lists all
STATUS_CHAMPIONS = 20  # ... and the progress of the first baseline and the latest champions


def status(repo: Path, db: str | None) -> dict[str, Any]:
    return status_of(*open_lab_store(repo, db))


def status_of(lab: Any, store: Any, rec: Records) -> dict[str, Any]:
    """`status` over a lab, store and records already open (the review page keeps them open)."""

    # the latest hypotheses and counts of all: a year's 20,000 briefs took 0.6 s and 6 MB of JSON
    hyps = rec.latest_briefs(STATUS_HYPOTHESES)
    tally = rec.tally()
    queue = store.queue_counts()
    running = [{"id": r.id, "commit": r.commit[:10], "task": r.task, "seed": r.seed}
               for r in store.runs(status=RunStatus.RUNNING)]


    try:
        repo_ = LabRepo(lab.root)
        base = repo_.baseline_head()
        tags = [t for t in [repo_.baseline_tag(base)] if t]
    except (git.exc.GitError, git.exc.BadName, ValueError, UserError):  # no baseline branch yet
        base, tags = None, []
    ledger = Ledger(store.engine)
    driver = lease.holder(store)

    return {
        "lab": lab.config.lab.name,
        "sandbox": "on" if is_sandboxed(lab) else UNSANDBOXED,
        "memory": memory_plan(lab.config.run).to_json(),
        "baseline": {"commit": base, "tag": tags[-1] if tags else None},
        "metric": {"name": lab.config.benchmark.metric, "higher_is_better": lab.config.benchmark.higher_is_better},
        "queue": queue,
        "running": running,
        "hypotheses": [
            {"id": h.id, "title": h.title, "origin": h.origin, "status": h.status, "look": h.look,
             "verdict": h.verdict, "decision": h.decision, "promoted_tag": h.promoted_tag, "review": h.review,
             "reject_kind": h.reject_kind}
            for h in hyps
        ],
        "hypotheses_total": tally["total"],
        "by_status": tally["by_status"],
        "in_flight": tally["in_flight"],
        "driver": driver.as_dict() if driver is not None else None,
        "disk": disk_usage(lab, store),
        "plateau": _plateau(lab, rec),
        "progress": split_progress(lab, store, rec, latest=STATUS_CHAMPIONS),
        "rejected": tally["rejected"],
        "compute": Experiment(lab, store).goodput().as_dict(),
        "gpu": gpu_facts(lab),
        "environment": environment_status(lab, store),
        "pairing": lab_pairing(lab, store),  # what the shared seeds buy, from this lab's comparisons
        "stream": Experiment(lab, store).stream(),  # [gate] online_fdr: the stream's tests and its next α
        "llm": {**llm_use(lab, ledger), "unreachable_since": llm_unreachable_since(rec)},
        "events": [{"kind": e.kind, "message": e.message, "at": e.created_at} for e in rec.events(5)],
        "notify": _notify_status(store),
    }


def environment_status(lab: Any, store: Any, facts: dict[str, Any] | None = None) -> dict[str, Any]:
    """The measurement environment here (`pipeline.environment`; `facts`, if read already) and,
    when the baseline's runs were measured in another, what changed (the loop re-measures it at its
    next start)."""
    from pipeline.api import environment_facts

    # read now, not once per process: `serve` runs for weeks, across upgrades (0.1 s)
    now = lab.config.run.environment_of(facts if facts is not None else environment_facts())
    try:
        changed = Experiment(lab, store).environment_change(now) if store is not None else None
    except UserError:  # no baseline branch yet
        changed = None
    return {"id": now.id, "here": now.brief(), "changed_since_baseline": changed[1] if changed else None,
            "remeasure_on_change": lab.config.run.remeasure_on_change}


def gpu_facts(lab: Any) -> dict[str, Any]:
    """The lab's GPU share per stage and whether CUDA MPS runs here (unsandboxed stages of a share then
    run as MPS clients: their kernels overlap instead of taking turns; a sandboxed stage's /tmp is
    its own, so it never finds MPS's pipe directory and its GPU is time-sliced)."""

    return {"lab_gpus": lab.config.run.gpus, "mps": mps_running(), "sandboxed": is_sandboxed(lab)}


def _notify_status(store: Any) -> dict[str, Any]:
    from agent.notify import status as notify_status

    return notify_status(store)


def _plateau(lab: Any, rec: Records) -> dict[str, int]:
    return {"since_promotion": rec.since_promotion(), "after": agent_config(lab).agent.plateau_after}


def llm_use(lab: Any, ledger: Any, since: float | None = None) -> dict[str, Any]:
    """What the LLM cost since `since` (today's UTC midnight by default): dollars for a model with a
    price, under the dollar cap; tokens always, under the token cap if one is set; the server's
    learned rate and how many answers were cut at their bound."""

    agent = agent_config(lab).agent
    model, price = model_price(agent)
    t0 = utc_day_start() if since is None else since
    prompt, completion = ledger.tokens_since(t0)
    rate = ledger.rate(model)
    return {
        "model": model,
        "priced": price is not None,
        "price_per_mtok": None if price is None else {"input": price.input_per_mtok, "output": price.output_per_mtok},
        "spent_today_usd": round(ledger.spent_usd(t0), 4),
        "cap_usd": agent.max_usd_per_day if price is not None else None,  # no dollar cap on a model without a price
        "tokens_today": {"prompt": prompt, "completion": completion},
        "cap_tokens": agent.max_tokens_per_day,
        "rate": rate.as_dict() if rate is not None else None,
        "cut_short_today": ledger.cut_short(t0),
    }


def llm_unreachable_since(rec: Records) -> float | None:
    """When the loop last found the LLM endpoint down, if it has not found it up since."""
    last = rec.last_event(("llm_down", "llm_up"))
    return last.created_at if last is not None and last.kind == "llm_down" else None


# ----------------------------------------------------------------------------- report

def report(repo: Path, db: str | None, hid: int) -> tuple[Hypothesis, Any, dict[str, Any] | None]:
    """The hypothesis, the gate's record at its latest look, and its promotion's replication (if any)."""
    from agent.verdicts import replicate_record

    lab, store, rec = open_lab_store(repo, db)
    h = rec.get(hid)
    return h, rec.latest_verdict(hid), replicate_record(store, hid)


# ----------------------------------------------------------------------------- review

def review(repo: Path, db: str | None, hid: int | None, approve: bool, reject: bool, comment: str | None) -> dict:
    lab, store, rec = open_lab_store(repo, db)
    if approve and reject:
        raise UserError("--approve and --reject exclude each other")
    if hid is None:
        if approve or reject or comment:
            raise UserError("give the hypothesis ID to approve, reject or comment on")
        pending = [h for h in rec.briefs() if h.review == Review.PENDING]
        return {"pending": [{"id": h.id, "title": h.title, "status": h.status, "decision": h.decision,
                             "verdict": h.verdict, "summary": str(lab.state / "summaries" / f"{h.id}.md")}
                            for h in pending]}
    h = rec.get(hid)
    asked = h.review != Review.NONE  # a held promotion with a replication is asked once it replicates
    if comment:
        rec.comment(hid, "comment", comment)
    if approve or reject:
        if not rec.decide_review(hid, Review.APPROVED if approve else Review.REJECTED):
            raise UserError(f"hypothesis {hid} was already {rec.get(hid).review}")
        rec.comment(hid, ReviewAction.APPROVE if approve else ReviewAction.REJECT, comment or "")
        h = rec.get(hid)
    return {"id": hid, "review": h.review, "status": h.status,
            "note": ("" if h.status != Status.HELD or h.review != Review.APPROVED
                     else "the running loop promotes it at its next pass" if asked
                     else "kept: the running loop promotes it if its replication passes (it is abandoned otherwise)")}


# ----------------------------------------------------------------------------- digest

def digest(repo: Path, db: str | None, since: str) -> dict[str, Any]:
    lab, store, rec = open_lab_store(repo, db)

    t0 = time.time() - parse_duration(since)
    briefs = rec.briefs()  # without their texts
    hyps = [h for h in briefs if (h.finished_at or h.updated_at) >= t0]
    done = [h for h in hyps if h.status == Status.DONE]
    return {
        "since": since,
        "tried": len(hyps),
        "promoted": [{"id": h.id, "title": h.title, "tag": h.promoted_tag} for h in done if h.decision == Decision.PROMOTE],
        "abandoned": [{"id": h.id, "title": h.title, "verdict": h.verdict} for h in done if h.decision in (Decision.ABANDON, Decision.REFINE)],
        "rejected": [{"id": h.id, "title": h.title, "why": h.reject_kind} for h in done if h.decision == Decision.REJECT],
        "in_flight": [{"id": h.id, "title": h.title, "status": h.status} for h in hyps if h.status in ACTIVE],
        "awaiting_review": [h.id for h in briefs if h.review == Review.PENDING],
        "plateau": _plateau(lab, rec),
        "compute": Experiment(lab, store).goodput(since=t0).as_dict(),
        "gpu": gpu_facts(lab),
        "llm_usd": round(Ledger(store.engine).spent_usd(t0), 4),
        "llm": llm_use(lab, Ledger(store.engine), t0),
        **digest_extras(lab, store, rec, t0, briefs),  # baseline progress, holds, the chart (agent.summary)
    }


def check_lab(repo: Path, env: dict[str, str]) -> tuple[dict[str, Any], list[str]]:
    """`autoresearch check`: the lab validated (research.toml, the agent's tables, harness, tasks; a
    webhook URL with a password in it is refused in one line) and summarised, with its warnings."""
    from pipeline.api import environment_facts

    lab = open_lab(repo)
    cfg = lab.config
    check_urls(agent_config(lab).notify, env)
    files = subprocess.run(["git", "ls-files"], cwd=lab.root, capture_output=True, text=True).stdout.split()
    undeclared = lab.undeclared_editable(files)
    facts = environment_facts()  # read once for the summary and the warnings
    summary = {
        "lab": cfg.lab.name,
        "root": str(lab.root),
        "harness": cfg.benchmark.harness,
        "suite": cfg.benchmark.suite,
        "tasks": lab.tasks(),
        "stages": [s.name for s in lab.stages_in_order()],
        "editable": cfg.lab.editable,
        "trusted": cfg.benchmark.trusted,
        "undeclared": undeclared,
        "sandbox": "on" if cfg.run.sandbox == "auto" else "UNSANDBOXED (opted out: [run] sandbox = \"off\")",
        "protocol": cfg.gate.protocol,
        "looks": cfg.gate.looks,
        "environment": environment_status(lab, None, facts)["here"],
    }
    warnings = [*config_warnings(lab), *(
        f"{path} is editable but no stage lists it in `inputs`: no stage can read it "
        "(stages see only the editable files they declare)" for path in undeclared),
        *environment_warnings(lab, facts)]
    return summary, warnings


def environment_warnings(lab: Any, facts: dict[str, Any]) -> list[str]:
    """A `[run] environment` pattern that matches no installed distribution (a typo counts nothing)."""
    from pipeline.api import environment_unmatched

    return [f"[run] environment: {p!r} matches no distribution installed on this machine, so no version of it "
            "is counted here" for p in environment_unmatched(lab.config.run.environment or [], facts)]
