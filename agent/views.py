"""Human renderings of the CLI's data (rich tables on the terminal, Markdown for files)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from agent.lifecycle import Decision
from agent.pictures import forest_path, progress_path
from agent.config import open_lab


def _secs(s: float) -> str:
    return f"{s / 3600:.2f} h" if s >= 3600 else f"{s / 60:.1f} min" if s >= 60 else f"{s:.0f} s"


def gpu_line(c: dict[str, Any], gpu: dict[str, Any] | None = None) -> str | None:
    """GPU-hours useful / failed / lost and how busy the GPUs were, or None for a lab that used none."""
    gpu = gpu or {}
    spent = (c.get("useful_gpu_s", 0) + c.get("method_failed_gpu_s", 0) + c.get("infra_lost_gpu_s", 0)
             + c.get("smoke_gpu_s", 0) + c.get("harness_gpu_s", 0))
    if not spent and not gpu.get("lab_gpus"):
        return None
    line = (f"GPU: useful {c.get('useful_gpu_s', 0) / 3600:.3f} h, failed methods {c.get('method_failed_gpu_s', 0) / 3600:.3f} h, "
            f"lost to infrastructure {c.get('infra_lost_gpu_s', 0) / 3600:.3f} h")
    if c.get("smoke_gpu_s"):
        line += f", smoke runs {c['smoke_gpu_s'] / 3600:.3f} h"
    if c.get("harness_gpu_s"):
        line += f", scoring and preparing data {c['harness_gpu_s'] / 3600:.3f} h"
    if c.get("gpu_busy_share") is not None:
        line += (f"; busy {c['gpu_busy_share']:.1%} of the wall time sampled, mean utilisation "
                 f"{c['gpu_mean_util']:.1f} % ({c['gpu_samples']} NVML samples)")
    else:
        line += "; utilisation not sampled (NVML: pip install 'autoresearch[gpu]')"
    if gpu.get("mps"):
        line += "; CUDA MPS is running" + (
            " (sandboxed stages do not reach it: their /tmp is private, so a shared GPU is time-sliced;"
            " on GPUs in EXCLUSIVE_PROCESS mode they cannot start)" if gpu.get("sandboxed") else "")
    return line


def smoke_line(c: dict[str, Any]) -> str | None:
    """What screening candidates on tiny data cost (the smoke runs, counted apart from goodput), or
    None when no smoke run is on the books."""
    n = c.get("smoke_runs", 0)
    if not n:
        return None
    line = (f"smoke runs: {n} ({c.get('smoke_rejected', 0)} rejected), {_secs(c.get('smoke_cpu_s', 0))} CPU, "
            f"{_secs(c.get('smoke_wall_s', 0))} wall")
    if c.get("smoke_gpu_s"):
        line += f", {c['smoke_gpu_s'] / 3600:.3f} GPU-h"
    return line


def harness_line(c: dict[str, Any]) -> str | None:
    """What the drivers spent preparing datasets and scoring runs (the harness's calls, counted apart
    from goodput), or None when none is on the books."""
    n = c.get("harness_calls", 0)
    if not n:
        return None
    line = f"scoring and preparing data: {n} calls, {_secs(c.get('harness_cpu_s', 0))} CPU"
    if c.get("harness_gpu_s"):
        line += f", {c['harness_gpu_s'] / 3600:.3f} GPU-h"
    return line


def print_status(st: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    # a pipe or a log file gets lines wide enough for the table (rich would assume 80 columns)
    con = Console(width=None if sys.stdout.isatty() else 140)
    base = st["baseline"]
    metric = st.get("metric")
    con.print(f"[bold]{st['lab']}[/bold]  baseline {base['tag'] or 'autoresearch/baseline'} "
              f"({(base['commit'] or '?')[:10]})"
              + (f"  metric {metric['name']} ({'higher' if metric['higher_is_better'] else 'lower'} is better)"
                 if metric else ""))
    if st.get("sandbox") != "on":
        con.print(f"[bold red]{st.get('sandbox')}[/bold red]: this lab opted out of the sandbox ([run] sandbox = \"off\"); "
                  "branch code can read the sealed labels, the store and the network")
    if st.get("memory"):
        con.print(st["memory"]["text"], markup=False, highlight=False)
    d = st.get("driver")
    if d:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d["since"]))
        state = "running" if d["alive"] else "[bold red]dead[/bold red] (the next `run` takes over)"
        con.print(f"driver: {d['host']} pid {d['pid']} since {since}, heartbeat {d['heartbeat_age_s']:.0f} s ago, {state}")
    else:
        con.print("driver: none")
    dk = st.get("disk")
    if dk:
        cap = f" of {dk['cache_max_gb']:g} GB" if dk.get("cache_max_gb") else " (unbounded)"
        con.print(f"disk: cache {dk['cache_mb']:.0f} MB{cap}, worktrees {dk['worktrees_mb']:.0f} MB, "
                  f"views {dk['views_mb']:.0f} MB, logs {dk['logs_mb']:.0f} MB of {dk['logs_max_mb']} MB")
    q = st["queue"]
    con.print(f"runs: {q['queued']} queued, {q['running']} running, {q['done']} done, {q['failed']} failed")
    for r in st["running"][:10]:
        con.print(f"  running #{r['id']} {r['commit']} {r['task']} seed {r['seed']}")
    shown = st["hypotheses"][-25:]
    total = st.get("hypotheses_total", len(st["hypotheses"]))
    counts = ", ".join(f"{n} {k}" for k, n in sorted((st.get("by_status") or {}).items(), key=lambda kv: -kv[1]))
    t = Table(title=f"hypotheses: the latest {len(shown)} of {total}" + (f" ({counts})" if counts else "")
                    if total > len(shown) else "hypotheses")
    for col in ("id", "title", "origin", "status", "look", "verdict", "decision", "review"):
        t.add_column(col, no_wrap=col != "title")
    for h in shown:
        decision = (h["decision"] or "-") + (f" → {h['promoted_tag']}" if h["promoted_tag"] else "")
        if h["decision"] == Decision.REJECT:
            decision += f" ({h['reject_kind']})"
        t.add_row(str(h["id"]), escape(h["title"][:50]), h["origin"], h["status"], str(h["look"] or "-"),
                  h["verdict"] or "-", decision, h["review"])
    con.print(t)
    c = st["compute"]
    con.print(f"compute: useful {_secs(c['useful_cpu_s'])}, failed methods {_secs(c['method_failed_cpu_s'])}, "
              f"lost to infrastructure {_secs(c['infra_lost_cpu_s'])}, saved by cache {_secs(c['saved_by_cache_cpu_s'])}; "
              f"goodput {c['goodput']:.1%}; {c['cache_hits']} cache hits, {c['infra_retries']} retries")
    if gl := gpu_line(c, st.get("gpu")):
        con.print(gl)
    for line in (smoke_line(c), harness_line(c)):
        if line:
            con.print(line, markup=False, highlight=False)
    if fdr := st.get("stream"):
        con.print(f"stream: {fdr['procedure'].upper()} at FDR {fdr['fdr']:.0%}: {fdr['tests']} comparisons tested, "
                  f"{fdr['discoveries']} discoveries; the next comparison gets α {fdr['next_alpha']:.2g}")
    env = st.get("environment")
    if env:
        con.print(f"environment: {env['here']} ({env['id']})", markup=False, highlight=False)
        if env["changed_since_baseline"]:
            then = ("the loop re-measures it at its next start" if env["remeasure_on_change"]
                    else "gains across the change are held for a human ([run] remeasure_on_change = false)")
            con.print(f"[bold yellow]the baseline was measured in another environment[/bold yellow] "
                      f"({escape(env['changed_since_baseline'])}): {then}")
    pr = st.get("pairing")
    if pr and pr["median_pair_correlation"] is not None and pr["median_variance_ratio"] is not None:
        con.print(f"pairing: seed k of a challenger and of its baseline correlate at a median "
                  f"{pr['median_pair_correlation']:.2f} over the latest {pr['comparisons']} comparisons; "
                  f"the paired difference has {pr['median_variance_ratio']:.2f}× the unpaired variance")
    con.print(llm_line(st["llm"]), markup=False, highlight=False)
    if st["llm"].get("unreachable_since"):
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(st["llm"]["unreachable_since"]))
        con.print(f"LLM unreachable since {since}: no proposals until it answers (seeds and runs go on)")
    pr = st.get("progress")
    if pr and pr["points"]:
        con.print(progress_line(pr, metric["name"] if metric else "metric"))
        for p in pr["points"][1:][-10:]:
            con.print(f"  {escape(champion_line(p))}")
    pl = st.get("plateau")
    if pl and pl["since_promotion"] >= pl["after"]:
        con.print(f"[bold yellow]plateau[/bold yellow]: {pl['since_promotion']} measured hypotheses in a row without "
                  f"a promotion ([agent] plateau_after = {pl['after']})")
    for e in st["events"]:
        con.print(f"[yellow]{escape(e['kind'])}[/yellow]: {escape(e['message'])}")
    if st.get("notify"):
        from agent.notify import status_lines

        for line in status_lines(st["notify"]):
            con.print(line, markup=False, highlight=False, style="bold red" if " DEAD: " in line else None)


def llm_line(llm: dict[str, Any], when: str = "today") -> str:
    """The LLM's cost in one line: dollars for a model with a price, tokens for one without (its
    spend is not guessed, and no dollar cap holds it); the server's rate once learned."""
    tokens = llm["tokens_today"]["prompt"] + llm["tokens_today"]["completion"]
    of_cap = f" of {llm['cap_tokens']:,}" if llm.get("cap_tokens") else ""
    if llm["priced"]:
        line = f"LLM spend {when}: ${llm['spent_today_usd']:.2f} of ${llm['cap_usd']:.2f} ({tokens:,}{of_cap} tokens)"
    else:
        line = (f"LLM use {when}: {tokens:,}{of_cap} tokens ({llm['tokens_today']['prompt']:,} in, "
                f"{llm['tokens_today']['completion']:,} out); {llm['model']} has no known price, so no dollar cap "
                "([agent] price_per_mtok sets one)")
    if llm.get("rate"):
        r = llm["rate"]
        line += (f"; the server writes {r['tokens_per_s']:.1f} tokens/s, first token after {r['first_token_s']:.1f} s "
                 f"(last {r['answers']} answers)")
    if llm.get("cut_short_today"):
        line += f"; {llm['cut_short_today']} answer(s) cut at max_tokens"
    return line


def progress_line(pr: dict[str, Any], metric: str) -> str:
    """Cumulative gain since the first baseline, on the gate split and on the sealed holdout."""
    n = len(pr["points"]) - 1
    if pr["gate_gain"] is None:
        p = pr["points"][0]
        hold = f"{p['holdout']:.4f}" if p["holdout"] is not None else "none"
        return (f"progress: no champion measured yet; the first baseline's mean {metric} on its own runs: "
                f"gate split {p['gate']:.4f}, holdout {hold}")
    # `status` reads the latest champions only (the gains are the same): the others counted too
    n += max(0, (pr.get("champions") or 0) - (pr.get("champions_read") or 0))
    line = f"progress over {n} champion(s), {metric} on their own runs: gate split {pr['gate_gain']:+.4f}"
    if pr["holdout_gain"] is None:
        return line + ", holdout: none (the harness has no holdout, or the champion's runs are not in yet)"
    return line + f", holdout {pr['holdout_gain']:+.4f} (test-reuse gap {pr['reuse_gap']:+.4f})"


def champion_line(p: dict[str, Any]) -> str:
    """One champion's gains since the first baseline, on the gate split and on the holdout."""
    hold = f"{p['holdout_gain']:+.4f}" if p["holdout_gain"] is not None else "—"
    return f"{p['label']} ({p['commit']}): gate split {p['gate_gain']:+.4f}, holdout {hold}"


def report_markdown(repo: Path, h: Any, gate_md: str) -> str:
    """The gate's table with the pictures beside the summary embedded (absolute paths: the output
    may be saved anywhere)."""

    lab = open_lab(repo)
    out = [f"# Hypothesis {h.id}: {h.title}", "", f"Status {h.status}; verdict {h.verdict}; decision {h.decision}.", "",
           gate_md]
    if forest_path(lab, h.id).is_file():
        out += ["", f"![task deltas of hypothesis {h.id}]({forest_path(lab, h.id)})"]
    if progress_path(lab).is_file():
        out += ["", f"![the lab's progress]({progress_path(lab)})"]
    return "\n".join(out)


def _num(v: float | None, digits: int = 4, signed: bool = False) -> str:
    return "?" if v is None else (f"{v:+.{digits}f}" if signed else f"{v:.{digits}f}")


def digest_markdown(d: dict[str, Any]) -> str:
    lines = [f"# Digest (last {d['since']})", "", f"- hypotheses touched: {d['tried']}"]
    for key, label in (("promoted", "promoted"), ("abandoned", "abandoned"), ("rejected", "rejected before runs")):
        items = d[key]
        lines.append(f"- {label}: {len(items)}")
        for it in items:
            extra = it.get("tag") or it.get("verdict") or it.get("why") or ""
            lines.append(f"  - #{it['id']} {it['title']} ({extra})")
    if d["in_flight"]:
        lines.append("- in flight: " + ", ".join(f"#{h['id']} ({h['status']})" for h in d["in_flight"]))
    base = d.get("baseline")
    if base is not None:
        metric = base.get("metric", "metric")
        direction = f"{'higher' if base.get('higher_is_better', True) else 'lower'} is better"
        line = f"- baseline: {base['tag'] or 'the initial baseline'}"
        if base.get("level_now") is not None:
            line += f", mean {metric} over tasks {_num(base['level_now'])}"
            if base.get("level_start") is not None and base["promotions"]:
                line += f" (was {_num(base['level_start'])}; {direction})"
            else:
                line += f" ({direction})"
        lines.append(line)
        for p in base["promotions"]:
            lo, hi = p["horizontal_ci"]
            lines.append(f"  - #{p['id']} → {p['tag']}: horizontal Δ {_num(p['horizontal_delta'], 3, True)}σ "
                         f"[{_num(lo, 3, True)}, {_num(hi, 3, True)}] (+ = better), mean {metric} "
                         f"{_num(p['level_before'])} → {_num(p['level_after'])}")
    pr = d.get("split_progress")
    if pr and pr["points"]:
        lines.append("- " + progress_line(pr, base.get("metric", "metric") if base else "metric"))
        lines += [f"  - {champion_line(p)}" for p in pr["points"][1:]]
    c = d["compute"]
    lines.append(f"- compute: useful {_secs(c['useful_cpu_s'])}, goodput {c['goodput']:.1%}, "
                 f"saved by cache {_secs(c['saved_by_cache_cpu_s'])}, failed methods {_secs(c['method_failed_cpu_s'])}, "
                 f"lost to infrastructure {_secs(c['infra_lost_cpu_s'])}")
    if gl := gpu_line(c, d.get("gpu")):
        lines.append(f"- {gl}")
    lines += [f"- {line}" for line in (smoke_line(c), harness_line(c)) if line]
    usd = d["llm_usd"]
    if d.get("llm") and not d["llm"]["priced"]:
        lines.append("- " + llm_line(d["llm"], "in this period"))
    else:
        lines.append(f"- LLM spend: ${usd:.2f}" if usd >= 1 or usd == 0 else f"- LLM spend: ${usd:.4f}")
    held = d.get("held") or []
    if held:
        lines.append("- held for approval (promotion waits for `autoresearch review ID --approve`): "
                     + ", ".join(f"#{h['id']} {h['title']}" for h in held))
    pl = d.get("plateau")
    if pl and pl["since_promotion"] >= pl["after"]:
        lines.append(f"- **plateau**: {pl['since_promotion']} measured hypotheses in a row without a promotion "
                     f"(`[agent] plateau_after` = {pl['after']}); `run --pause-on-plateau` stops the loop there")
    lines.append("- awaiting review: " + (", ".join(f"#{i}" for i in d["awaiting_review"]) or "nothing")
                 + (" (`autoresearch review` lists them)" if d["awaiting_review"] else ""))
    if d.get("progress_chart"):
        lines += ["", f"Progress chart: {d['progress_chart']}", "", f"![progress]({d['progress_chart']})"]
    return "\n".join(lines)
