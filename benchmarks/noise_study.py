"""What the noise study buys a lab's first hypothesis (issue 34, item 3): `[gate] noise_runs` on and off.

    .venv/bin/python benchmarks/noise_study.py [--trials 2000] [--null-trials 20000] [--lab DIR] [--json OUT]

1. The gate alone (`pipeline.gate.sim.simulate`, the paired protocol at its defaults, 8 tasks, looks
   1/2/5/10, no earlier comparisons: `pair_history 0`): a lab's first hypothesis with and without
   the study, as `history` baseline runs per task beyond the 2 that its first looks pair with (a
   5-run study: 3). Per effect and pair ρ: power and mean challenger runs, and the null's false
   improvements with 10× the trials.
2. `--lab DIR`: the real loop (`autoresearch run --offline`, the sandboxed local executor, git,
   SQLite) on the simulated lab (`autoresearch init --harness sim`, 4 tasks, baseline_runs 5, looks
   1/2/5), two hypotheses seeded in order, a +3σ gain then a null, once with the default study and
   once with `noise_runs = 0`: each hypothesis's decision and look, and the runs the store holds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.gate.protocol import get_protocol  # noqa: E402
from pipeline.gate.sim import simulate  # noqa: E402

EFFECTS = (0.0, 1.0, 2.0, 5.0)
PAIR_RHOS = (0.0, 0.5, 0.9)
STUDY = 3  # a 5-run study: 3 baseline runs per task beyond the 2 that looks 1-2 pair with
LAB_EFFECTS = (3.0, 0.0)


def gate_grid(trials: int, null_trials: int) -> list[dict[str, Any]]:
    proto = get_protocol("paired")
    rows = []
    for rho in (0.02, 0.6):
        for pair in PAIR_RHOS:
            for effect in EFFECTS if rho == 0.02 else (0.0,):
                row: dict[str, Any] = {"rho": rho, "pair_rho": pair, "effect": effect}
                for name, history in (("none", 0), ("study", STUDY)):
                    r = simulate(protocol="paired", effect=effect, rho=rho, pair_rho=pair, pair_history=0, history=history,
                                 trials=null_trials if effect == 0 else trials, looks=(1, 2, 5, 10),
                                 alpha=proto.default_alpha, futility_p=proto.default_futility_p, seed=7)
                    row[name] = {"improvement": r.improvement_rate, "se": r.standard_error(r.improvement_rate),
                                 "challenger_runs": r.mean_challenger_runs}
                rows.append(row)
                print(f"  [ρ {rho} pair {pair} effect {effect:g}]", file=sys.stderr, flush=True)
    return rows


def _cli(lab: Path, *args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    done = subprocess.run([str(ROOT / ".venv" / "bin" / "autoresearch"), "--repo", str(lab), *args], cwd=lab,
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"autoresearch {' '.join(args[:3])} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done


def _git(lab: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=lab, check=True, capture_output=True)


def lab_run(lab: Path, noise_runs: int | None) -> dict[str, Any]:
    """The simulated lab, 4 tasks, baseline_runs 5, looks 1/2/5; `noise_runs` None: the default."""
    if lab.exists():
        shutil.rmtree(lab)
    lab.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(ROOT / ".venv" / "bin" / "autoresearch"), "init", str(lab), "--harness", "sim", "--suite", "sim"],
                   check=True, capture_output=True, cwd=ROOT)
    research = lab / "research.toml"
    text = research.read_text()
    for old, new in (('tasks = ["t1", "t2", "t3", "t4", "t5", "t6", "t7", "t8"]', 'tasks = ["t1", "t2", "t3", "t4"]'),
                     ("--sleep 2 ", "--sleep 0.05 "), ("baseline_runs = 10", "baseline_runs = 5"),
                     ("looks = [1, 2, 5, 10]", "looks = [1, 2, 5]")):
        if old not in text:
            raise SystemExit(f"the sim lab's research.toml changed: {old!r} not found")
        text = text.replace(old, new)
    if noise_runs is not None:
        text = text.replace("[gate]\n", f"[gate]\nnoise_runs = {noise_runs}\n", 1)
    research.write_text(text)
    _git(lab, "commit", "-qam", f"noise study benchmark: noise_runs {noise_runs}")
    _git(lab, "branch", "-f", "autoresearch/baseline", "HEAD")
    ids = []
    for i, effect in enumerate(LAB_EFFECTS, start=1):
        spec = lab.parent / f"{lab.name}-h{i}.json"
        spec.write_text(json.dumps({"title": f"h{i} {effect:+g} sigma",
                                    "edits": [{"path": f"effect_h{i}.toml", "content": f"effect = {effect}\n"}]}))
        ids.append(int(_cli(lab, "seed", "--file", str(spec)).stdout.strip()))
    t0 = time.perf_counter()
    _cli(lab, "run", "--offline", "--max-hypotheses", str(len(ids)), "--workers", "2")
    seconds = time.perf_counter() - t0
    rows = []
    for hid, effect in zip(ids, LAB_EFFECTS):
        rep = json.loads(_cli(lab, "report", str(hid), "--json").stdout)
        h, gate = rep["hypothesis"], rep.get("gate") or {}
        rows.append({"id": hid, "effect": effect, "decision": h.get("decision"), "look": gate.get("look")})
    con = sqlite3.connect(lab / "runs" / "autoresearch.db")
    try:
        (runs,) = con.execute("select count(*) from run where status = 'done'").fetchone()
    finally:
        con.close()
    return {"noise_runs": "default (5)" if noise_runs is None else noise_runs, "hypotheses": rows, "runs_done": runs,
            "seconds": round(seconds, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=2000, help="trials per power cell")
    ap.add_argument("--null-trials", type=int, default=20000, help="trials per null cell")
    ap.add_argument("--lab", type=Path, default=None, help="also run the real loop on a simulated lab under DIR")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    proto = get_protocol("paired")
    grid = gate_grid(args.trials, args.null_trials)
    print(f"gate-sim, paired at α {proto.default_alpha:g}, futility {proto.default_futility_p:g}, 8 tasks, looks 1/2/5/10, "
          f"a lab's first hypothesis (no earlier comparisons); `improvement` rate (mean challenger runs) without "
          f"the noise study → with a 5-run study; {args.trials} trials per power cell, {args.null_trials} per null cell")
    print(f"{'ρ':>5} {'pair ρ':>7} {'effect':>7} {'without':>17} {'with':>17}")
    for r in grid:
        cell = "  ".join(f"{r[k]['improvement']:.4f} ({r[k]['challenger_runs']:.2f})".rjust(17) for k in ("none", "study"))
        print(f"{r['rho']:>5} {r['pair_rho']:>7} {r['effect']:>6g}σ {cell}")
    out: dict[str, Any] = {"trials": args.trials, "null_trials": args.null_trials, "gate": grid}
    if args.lab:
        out["lab"] = [lab_run(args.lab / "study", None), lab_run(args.lab / "none", 0)]
        print(f"\nthe real loop on the simulated lab (4 tasks, baseline_runs 5, looks 1/2/5), hypotheses "
              f"{', '.join(f'{e:+g}σ' for e in LAB_EFFECTS)} in order:")
        for r in out["lab"]:
            hs = "; ".join(f"#{h['id']} {h['effect']:+g}σ {h['decision']} at look {h['look']}" for h in r["hypotheses"])
            print(f"  noise_runs {r['noise_runs']}: {hs}; {r['runs_done']} runs done, the loop {r['seconds']} s")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
