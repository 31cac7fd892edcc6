"""Planted headroom: does each known gain of the template really raise AUC across tasks?

For the baseline and each variant in `PLANTED` (and `NOOPS` with --noops), run the small suite
with SEEDS seeds and print, per variant, the mean AUC change per task and how many tasks improved.
The issue's bar: with 5 seeds, each planted gain raises the mean AUC on at least half the tasks.

    .venv/bin/python benchmarks/headroom.py --seeds 5 --workers 2 [--noops] [--json out.json]
    .venv/bin/python benchmarks/headroom.py --on finetune_lr --only add_pix_source   # a conditional gain
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.harness.transactions.variants import CONDITIONAL, NOOPS, PLANTED, apply_edit  # noqa: E402

TEMPLATE = ROOT / "pipeline" / "templates" / "transactions"


def make_lab(dst: Path, edits) -> Path:
    dst.mkdir(parents=True)
    for f in ("model.py", "train.py", "config.toml"):
        shutil.copy(TEMPLATE / f, dst / f)
    for e in edits:
        apply_edit(dst, e)
    return dst


def run_seed(lab: Path, state: Path, work: Path, seed: int, customers: int | None) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "_template_runner.py"), "--lab", str(lab), "--state", str(state),
           "--seed", str(seed), "--work", str(work)]
    if customers:
        cmd += ["--customers", str(customers)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=lab)
    if proc.returncode != 0:
        raise RuntimeError(f"{lab.name} seed {seed} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--noops", action="store_true", help="also run the behaviour-preserving variants")
    ap.add_argument("--only", nargs="*", help="variant names to run (default: planted and conditional)")
    ap.add_argument("--on", help="apply this planted variant to every lab first (measure gains on that base)")
    ap.add_argument("--customers", type=int, default=None)
    ap.add_argument("--json", type=Path, help="write every AUC here")
    args = ap.parse_args()

    known = PLANTED | CONDITIONAL | NOOPS
    chosen = args.only or [*PLANTED, *CONDITIONAL, *(NOOPS if args.noops else [])]
    unknown = [n for n in chosen + ([args.on] if args.on else []) if n not in known]
    if unknown:
        ap.error(f"unknown variants {unknown}; expected some of {sorted(known)}")
    base_edits = known[args.on] if args.on else []
    variants = {"baseline": base_edits} | {k: base_edits + known[k] for k in chosen if k != args.on}
    tmp = Path(tempfile.mkdtemp(prefix="headroom-"))
    state = tmp / "state"
    from pipeline.harness import get_harness

    get_harness("transactions").prepare(state, "small", 0, args.customers)
    labs = {name: make_lab(tmp / name, edits) for name, edits in variants.items()}
    jobs = [(name, seed) for seed in range(args.seeds) for name in variants]
    with ThreadPoolExecutor(args.workers) as pool:
        futures = {job: pool.submit(run_seed, labs[job[0]], state, tmp / f"{job[0]}-w{job[1]}", job[1], args.customers)
                   for job in jobs}
        results = {job: f.result() for job, f in futures.items()}
    shutil.rmtree(tmp, ignore_errors=True)

    tasks = list(results[("baseline", 0)]["auc"])
    auc = {name: np.array([[results[(name, s)]["auc"][t] for s in range(args.seeds)] for t in tasks]) for name in variants}
    base = auc["baseline"]
    print(f"baseline{' + ' + args.on if args.on else ''} over {args.seeds} seeds (test AUC mean ± seed sd):")
    for i, t in enumerate(tasks):
        print(f"  {t:20s} {base[i].mean():.4f} ± {base[i].std(ddof=1):.4f}")
    print()
    header = "  ".join(f"{t[:10]:>10s}" for t in tasks)
    print(f"{'variant':22s} {header}  improved")
    summary = {}
    for name in variants:
        if name == "baseline":
            continue
        delta = auc[name].mean(1) - base.mean(1)
        improved = int((delta > 0).sum())
        summary[name] = {"delta": dict(zip(tasks, delta.round(5).tolist())), "tasks_improved": improved,
                         "mean_delta": float(delta.mean())}
        print(f"{name:22s} " + "  ".join(f"{d:+10.4f}" for d in delta) + f"  {improved}/{len(tasks)}")
    if args.json:
        args.json.write_text(json.dumps({"tasks": tasks, "seeds": args.seeds, "summary": summary,
                                         "auc": {k: v.tolist() for k, v in auc.items()}}, indent=2))


if __name__ == "__main__":
    main()
