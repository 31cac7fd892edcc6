"""A planted-truth campaign on the real pipeline (issue 12): known gains, no-ops and harms, scored.

    .venv/bin/python benchmarks/planted.py [--lab runs/planted-lab] [--workers 2] [--in-flight K] [--json OUT]

Builds a demo lab (`autoresearch init`, the small suite's 8 tasks, on which `benchmarks/headroom.py`
measured the planted gains; `--tasks` cuts it down), then plays a researcher: for each hypothesis of
`CAMPAIGN` in turn it branches off the *current* baseline with the variant's edits
(`pipeline.harness.transactions.variants`: PLANTED gains, NOOPS, HARMS), seeds the branch
(`autoresearch seed --branch`) and runs the loop on it (`autoresearch run --offline
--max-hypotheses 1`): the real CLI, git, store, warm workers, sandbox, sealed scorer and gate. At
the end `autoresearch variance --runs N` finishes the last champion's own runs, so its holdout
score is in.

With `--in-flight K` (issue 22) the researcher does not wait: the lab's `[agent] max_in_flight = K`
is committed into the first baseline A0, all of `CAMPAIGN`'s branches are made off A0 up front
(the same edits), seeded in `CAMPAIGN` order, and the loop runs once (`autoresearch run --offline
--max-hypotheses len(CAMPAIGN)`), up to K hypotheses measured at once. One whose base moved
before its promotion is re-based onto the current baseline and measured again from its first
look (`agent.graph.rebase`); a merge conflict is an abandon with the reason. Each line then says
which were re-based or conflicted, and the seconds are from the loop's start to its finish.

Prints the truth × decision table, each hypothesis's verdict, look and horizontal Δ, the wall time,
and from `status --json` the final champion's gain on the gate split beside its gain on the sealed
holdout (the test-reuse gap). Truth: gains as measured by headroom.py on the template baseline (5
seeds; one tested after another promotion is still called a gain), no-ops behaviour-preserving
(tests/test_template.py), harms by construction.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.harness.transactions.variants import HARMS, NOOPS, PLANTED, apply_edit  # noqa: E402

TASKS: list[str] | None = None  # None: the suite's tasks
BASELINE = "autoresearch/baseline"
# In order; harms and no-ops first and between the gains, so each is tested against a baseline
# that has already moved as well as against the first one.
CAMPAIGN: list[tuple[str, str]] = [
    ("noop", "config_comment"),
    ("harm", "truncate_history"),
    ("gain", "bureau_features"),
    ("noop", "cross_network_rename"),
    ("harm", "jitter_predictions"),
    ("gain", "finetune_lr"),
    ("noop", "train_comment"),
    ("gain", "lora_rank_16"),
]
VARIANTS = {"gain": PLANTED, "noop": NOOPS, "harm": HARMS}


def sh(*args: str, cwd: Path, timeout: float | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args[:4])} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done


def cli(lab: Path, *args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
    return sh(str(ROOT / ".venv" / "bin" / "autoresearch"), "--repo", str(lab), *args, cwd=lab, timeout=timeout)


def make_lab(lab: Path, tasks: list[str] | None, in_flight: int | None = None, gate: list[str] | None = None) -> None:
    if lab.exists():
        shutil.rmtree(lab)
    sh(str(ROOT / ".venv" / "bin" / "autoresearch"), "init", str(lab), "--suite", "small", cwd=ROOT)
    if tasks:
        research = lab / "research.toml"
        text = research.read_text()
        assert "data_seed = 0\n" in text
        research.write_text(text.replace("data_seed = 0\n", f"data_seed = 0\ntasks = {json.dumps(tasks)}\n", 1))
        sh("git", "commit", "-qam", f"planted campaign: {len(tasks)} tasks", cwd=lab)
    if in_flight is not None:  # in the first baseline A0, so every branch made off it has it too
        research = lab / "research.toml"
        lines = research.read_text().splitlines(keepends=True)
        (i,) = [n for n, line in enumerate(lines) if line.startswith("max_in_flight = ")]
        lines[i] = f"max_in_flight = {in_flight}   # planted campaign: --in-flight {in_flight}\n"
        research.write_text("".join(lines))
        sh("git", "commit", "-qam", f"planted campaign: max_in_flight = {in_flight}", cwd=lab)
    if gate:  # `--gate KEY=VALUE`: in the first baseline A0 too
        research = lab / "research.toml"
        text = research.read_text()
        assert "\n[gate]\n" in text
        research.write_text(text.replace("\n[gate]\n", "\n[gate]\n" + "".join(f"{g.strip()}\n" for g in gate), 1))
        sh("git", "commit", "-qam", f"planted campaign: [gate] {', '.join(gate)}", cwd=lab)
    sh("git", "branch", "-f", BASELINE, "HEAD", cwd=lab)


def branch(lab: Path, name: str, kind: str, variant: str) -> None:
    """A researcher's branch off the current baseline with the variant's edits."""
    wt = lab.parent / f".wt-{lab.name}-{variant}"
    sh("git", "worktree", "add", "-q", "-b", name, str(wt), BASELINE, cwd=lab)
    try:
        for edit in VARIANTS[kind][variant]:
            apply_edit(wt, edit)
        sh("git", "commit", "-qam", f"{kind}: {variant}", cwd=wt)
    finally:
        sh("git", "worktree", "remove", "--force", str(wt), cwd=lab)


def gate_row(lab: Path, hid: int, kind: str, variant: str) -> dict[str, Any]:
    rep = json.loads(cli(lab, "report", str(hid), "--json").stdout)
    h, gate = rep["hypothesis"], rep.get("gate") or {}
    hz = gate.get("horizontal") or {}
    return {"id": hid, "truth": kind, "variant": variant, "verdict": h.get("verdict"),
            "decision": h.get("decision"), "look": gate.get("look"), "tag": h.get("promoted_tag"),
            "horizontal_delta": hz.get("delta"), "horizontal_t": hz.get("t")}


def row_line(r: dict[str, Any], when: str) -> str:
    d = r["horizontal_delta"]
    return (f"#{r['id']} {r['truth']:<4} {r['variant']:<22} {r['verdict']!s:<13} {r['decision']!s:<8} look {r['look']} "
            f"Δh {d if d is None else round(d, 3)}σ  ({when})")


def contains(lab: Path, base: str, commit: str) -> bool:
    """Whether `commit` has `base` in its history (git merge-base --is-ancestor)."""
    return subprocess.run(["git", "merge-base", "--is-ancestor", base, commit], cwd=lab).returncode == 0


def baseline_name(lab: Path, commit: str) -> str:
    tags = [t for t in sh("git", "tag", "--points-at", commit, cwd=lab).stdout.split() if t.startswith("baseline/")]
    return tags[-1] if tags else f"{BASELINE}@{commit[:10]}"


def concurrent(lab: Path, workers: int, k: int) -> list[dict[str, Any]]:
    """All of CAMPAIGN branched off A0 and seeded, then one loop with up to k in flight; a row each."""
    ids: list[tuple[int, str, str]] = []
    for kind, variant in CAMPAIGN:
        name = f"res/{variant}"
        branch(lab, name, kind, variant)  # off BASELINE, which is A0 for all of them
        ids.append((int(cli(lab, "seed", "--branch", name, "--title", f"{kind}: {variant}").stdout.strip()),
                    kind, variant))
    t = time.time()
    loop = cli(lab, "run", "--offline", "--max-hypotheses", str(len(CAMPAIGN)), "--workers", str(workers),
               "--json", timeout=6 * 3600)
    t_end = time.time()
    from agent.records import Records
    from agent.verdicts import rebases
    from pipeline import experiment
    from pipeline.lab import load_lab

    store = experiment.open_store(load_lab(lab))
    rec = Records(store)
    events = sorted(({"kind": e.kind, "message": e.message, "at": e.created_at} for e in rec.events(10_000)
                     if e.kind == "rebase"), key=lambda e: e["at"])
    rows = []
    for hid, kind, variant in ids:
        r = gate_row(lab, hid, kind, variant)
        h = rec.get(hid)
        moves = rebases(store, hid)
        runs = [x for c in {h.commit, *(m.get("from_commit") for m in moves)} if c for x in store.runs(commit=c)]
        r.update({"tag": h.promoted_tag, "rationale_decision": h.rationale_decision,
                  "rebases": [{k_: m.get(k_) for k_ in ("from_tag", "to_tag", "verdict", "look", "commit", "outcome")}
                              for m in moves],
                  "conflict": any(m.get("commit") is None for m in moves),
                  "base_commit": h.base_commit, "commit": h.commit,
                  # False: measured against a baseline its commit does not contain (a seeded branch off
                  # A0 adopted after a promotion is measured as-is against the new head)
                  "commit_contains_base": None if not (h.base_commit and h.commit) else contains(lab, h.base_commit, h.commit),
                  "runs_of_its_commits": len({x.id for x in runs}),  # a champion's: its later baseline runs too
                  "finished_s": None if h.finished_at is None else round(h.finished_at - t, 1)})
        rows.append(r)
        when = "unfinished" if r["finished_s"] is None else f"done {r['finished_s']:.0f} s into the loop"
        print(row_line(r, when) + (f"  -> {r['tag']}" if r["tag"] else ""), flush=True)
        for m in moves:
            how = (f"abandoned: {m.get('outcome')}" if m.get("commit") is None
                   else "measured again from its first look")
            print(f"     re-based {m.get('from_tag')} -> {m.get('to_tag')} (its {m.get('verdict')} at look "
                  f"{m.get('look')} against {m.get('from_tag')} set aside): {how}")
        if r["commit_contains_base"] is False:
            print(f"     measured against {baseline_name(lab, h.base_commit)}, which its commit {h.commit[:10]} does not "
                  f"contain (its branch is off {baseline_name(lab, sh('git', 'merge-base', h.base_commit, h.commit, cwd=lab).stdout.strip())}"
                  f"; adopted as-is after the baseline moved, not re-based)")
    print(f"loop: {(t_end - t) / 60:.1f} min, {len(events)} re-base events; run --json stopped: "
          f"{json.loads(loop.stdout).get('stopped')}")
    for e in events:
        print(f"  event: {e['message']}")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lab", type=Path, default=ROOT / "runs" / "planted-lab")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--tasks", default="", help="comma-separated subset of the small suite (default: all 8)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--in-flight", type=int, default=None, metavar="K",
                    help="all hypotheses branched off the first baseline and seeded, one loop with "
                         "[agent] max_in_flight = K (default: one at a time, each off the current baseline)")
    ap.add_argument("--gate", action="append", default=[], metavar="KEY=VALUE",
                    help="a [gate] key of the campaign's lab, e.g. replicate_runs=2 (repeatable)")
    args = ap.parse_args(argv)
    lab = args.lab.resolve()
    tasks = [t for t in args.tasks.split(",") if t] or TASKS
    t0 = time.time()
    make_lab(lab, tasks, args.in_flight, args.gate)
    tasks = json.loads(cli(lab, "check", "--json").stdout).get("tasks") if tasks is None else tasks
    rows: list[dict[str, Any]] = concurrent(lab, args.workers, args.in_flight) if args.in_flight else []
    for kind, variant in CAMPAIGN if not args.in_flight else []:
        t = time.time()
        name = f"res/{variant}"
        branch(lab, name, kind, variant)
        hid = int(cli(lab, "seed", "--branch", name, "--title", f"{kind}: {variant}").stdout.strip())
        cli(lab, "run", "--offline", "--max-hypotheses", "1", "--workers", str(args.workers), timeout=7200)
        rep = json.loads(cli(lab, "report", str(hid), "--json").stdout)
        h, gate = rep["hypothesis"], rep.get("gate") or {}
        hz = gate.get("horizontal") or {}
        rows.append({"id": hid, "truth": kind, "variant": variant, "verdict": h.get("verdict"),
                     "decision": h.get("decision"), "look": gate.get("look"), "tag": h.get("promoted_tag"),
                     "horizontal_delta": hz.get("delta"), "horizontal_t": hz.get("t"),
                     "seconds": round(time.time() - t, 1)})
        print(f"#{hid} {kind:<4} {variant:<22} {h.get('verdict')!s:<13} {h.get('decision')!s:<8} look {gate.get('look')} "
              f"Δh {hz.get('delta') if hz.get('delta') is None else round(hz['delta'], 3)}σ  ({rows[-1]['seconds']:.0f} s)",
              flush=True)
    queue = json.loads(cli(lab, "status", "--json").stdout).get("queue") or {}  # the campaign's runs
    cli(lab, "variance", "--runs", "10", "--json", timeout=7200)  # the last champion's own runs, holdout included
    st = json.loads(cli(lab, "status", "--json").stdout)
    wall = time.time() - t0

    decisions = ["promote", "abandon", "refine", "hold", "reject"]
    table = {k: {d: 0 for d in decisions} for k in VARIANTS}
    for r in rows:
        table[r["truth"]][r["decision"] if r["decision"] in decisions else "hold"] += 1
    print(f"\ntruth × decision ({len(rows)} hypotheses, tasks {', '.join(tasks or [])}):")
    print(f"{'':<6}" + "".join(f"{d:>9}" for d in decisions))
    for k, counts in table.items():
        print(f"{k:<6}" + "".join(f"{counts[d]:>9}" for d in decisions))
    pr = st.get("progress") or {}
    print("\nchampions on their own runs (mean AUC over tasks):")
    for p in pr.get("points", []):
        hold = "—" if p["holdout"] is None else f"{p['holdout']:.4f} ({p['holdout_gain']:+.4f})"
        print(f"  {p['label']:<12} {p['commit']}  gate split {p['gate']:.4f} ({p['gate_gain']:+.4f})  holdout {hold}"
              f"  {p['runs']} runs")
    if pr.get("reuse_gap") is not None:
        print(f"test-reuse gap of the final champion: gate-split gain {pr['gate_gain']:+.4f} − holdout gain "
              f"{pr['holdout_gain']:+.4f} = {pr['reuse_gap']:+.4f} AUC")
    print(f"runs of the campaign (before the final variance study): {queue}")
    print(f"wall time {wall / 60:.1f} min on {os.cpu_count()} cores, {args.workers} workers"
          + (f", max_in_flight = {args.in_flight}" if args.in_flight else ""))
    if args.in_flight:
        c = st.get("compute") or {}
        print(f"stages executed {c.get('stages_executed')}, cache hits {c.get('cache_hits')}, "
              f"useful CPU {c.get('useful_cpu_s', 0):.0f} s, requeues {c.get('requeues')}, "
              f"infra retries {c.get('infra_retries')}")
    if args.json:
        args.json.write_text(json.dumps({"tasks": tasks, "campaign": rows, "confusion": table, "progress": pr,
                                         "queue": queue, "gate": args.gate,
                                         "compute": st.get("compute"), "wall_s": round(wall, 1),
                                         "cores": os.cpu_count(), "workers": args.workers,
                                         **({"in_flight": args.in_flight} if args.in_flight else {}),
                                         "command": "benchmarks/planted.py " + " ".join(argv or sys.argv[1:])},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
