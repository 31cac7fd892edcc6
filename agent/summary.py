"""Per-hypothesis summaries for human review, written at the terminal decision.

Numbers come from the gate's stored records and the store's compute accounting, never from a
policy. The summary is stored on the hypothesis and written to `runs/summaries/<id>.md`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent.records import Hypothesis

TEMPLATE = Path(__file__).resolve().parent / "templates" / "summary.md"
MAX_DIFF_LINES = 120


def summary_path(lab: Any, hid: int) -> Path:
    return lab.state / "summaries" / f"{hid}.md"


def gate_markdown(svc: Any, h: Hypothesis) -> tuple[str, Any]:
    from pipeline.gate import GateResult, render_markdown

    recs = svc.store.gate_records(str(h.id), kind="verdict")
    if not recs:
        return "No runs were measured.", None
    result = GateResult.model_validate(recs[-1].payload)
    return render_markdown(result), result


def compute_line(svc: Any, h: Hypothesis) -> str:
    if not h.commit:
        return "none"
    runs = svc.store.runs(commit=h.commit)
    execs = svc.store.stage_execs([r.id for r in runs]) if runs else []
    cpu = sum((e.cpu_s or 0.0) for e in execs if e.outcome not in ("cache_hit", "shared"))
    done = sum(r.status == "done" for r in runs)
    failed = sum(r.status == "failed" for r in runs)
    return f"{len(runs)} challenger runs ({done} done, {failed} failed), {cpu:.0f} CPU s"


def render_summary(svc: Any, h: Hypothesis) -> str:
    ws = svc.workspace
    evidence, result = gate_markdown(svc, h)
    if h.commit and h.base_commit:
        fork = ws.repo.merge_base(h.base_commit, h.commit)[0].hexsha
        diff_stat = ws.diff_stat(fork, h.commit)
        diff_lines = ws.diff(fork, h.commit).splitlines()
        diff = "\n".join(diff_lines[:MAX_DIFF_LINES]) + (
            f"\n… {len(diff_lines) - MAX_DIFF_LINES} more lines" if len(diff_lines) > MAX_DIFF_LINES else "")
    else:
        diff_stat, diff = "(no commit)", ""
    if h.decision == "reject":
        decision_line = f"rejected before any run ({h.reject_kind})"
        decision_rationale = h.reject_reason or ""
    else:
        decision_line = f"{h.decision} (verdict: {h.verdict})" + (f", now `{h.promoted_tag}`" if h.promoted_tag else "")
        decision_rationale = h.rationale_decision or ""
    pictures = ""
    forest = summary_path(svc.lab, h.id).with_suffix(".forest.png")
    if forest.is_file():
        pictures = f"![task deltas]({forest.name})"
    values = {
        "id": h.id,
        "title": h.title,
        "decision_line": decision_line,
        "origin": h.origin,
        "branch": h.branch or "-",
        "commit": (h.commit or "-")[:12],
        "base_commit": (h.base_commit or "-")[:12],
        "runs_line": compute_line(svc, h),
        "review": h.review,
        "rationale": h.rationale or "(none given)",
        "expected_effect": h.expected_effect or "(none given)",
        "expected_tasks": ", ".join(h.expected_tasks or []) or "(none)",
        "diff_stat": diff_stat,
        "diff": diff,
        "look": h.look or 0,
        "evidence": evidence,
        "pictures": pictures,
        "decision_rationale": decision_rationale,
        "follow_ups": f"- {h.follow_up}" if h.follow_up else "- none suggested",
    }
    return TEMPLATE.read_text().format_map(values)


def write_summary(svc: Any, h: Hypothesis) -> str:
    text = render_summary(svc, h)
    path = summary_path(svc.lab, h.id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    svc.records.update(h.id, summary_md=text, summary_author="template")
    return text
