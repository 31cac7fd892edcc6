"""Dispatch overhead and slot utilisation of the local executor, measured in one run.

    .venv/bin/python benchmarks/dispatch.py [--runs 200] [--cold 5] [--json]

1. Warm dispatch: N no-op stages (`python noop.py`, which imports torch and peft) submitted one at a
   time to the local executor, whose warm worker has them imported already; time from submit to
   result, with the sandbox (namespaces, mounts, private /tmp and {out}, copy-out: what every
   stage gets) and without it. Against: the same stage as a cold `subprocess` (a new interpreter
   importing torch+peft).
2. Per-run overhead through the whole driver: N runs of a lab whose only stage writes constant
   predictions: claim, cache key, worktree, fork, publish, sealed scoring, store writes.
3. Slot utilisation with a full queue: runs whose stage sleeps 0.5 s, 2 slots;
   utilisation = Σ stage wall time ÷ (slots × makespan).

Targets (issues 3 and 10): median dispatch ≤ 100 ms, with the sandbox too; utilisation ≥ 90 %.
Takes about two minutes here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from support.tiny import TinyHarness, git  # noqa: E402  (a real tiny harness shared with the tests)
from pipeline import isolation, runner  # noqa: E402
from pipeline.executors import sandbox as sandbox_mod  # noqa: E402
from pipeline.executors import StageJob  # noqa: E402
from pipeline.executors.local import LocalExecutor  # noqa: E402
from pipeline.lab import Lab, parse_config  # noqa: E402
from pipeline import experiment, labrepo

NOOP = "import torch, peft\n"
PREDICT = """
import sys, time, numpy as np
from pathlib import Path
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
time.sleep(float(args["--sleep"]))
c = np.load(Path(args["--data"]) / "customers.npz")
ids = c["id"][c["split"] == 2]
Path(args["--out"], "predictions.csv").write_text("id,score\\n" + "".join(f"{i},{i % 7}\\n" for i in ids))
"""
TOML = """
[lab]
name = "bench"
editable = ["predict.py"]
[benchmark]
harness = "tiny"
suite = "tiny"
[[stage]]
name = "predict"
run = "python predict.py --data {data} --out {out} --sleep %s --seed {seed} --task {task}"
scope = "run"
inputs = ["predict.py"]
[run]
timeout_s = 60
sandbox = "%s"
"""


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def warm_dispatch(work: Path, n: int, sandboxed: bool) -> list[float]:
    code = work / "code"
    code.mkdir(exist_ok=True)
    (code / "noop.py").write_text(NOOP)
    times = []
    with LocalExecutor(preload=("numpy", "torch", "peft"), slots=1) as ex:
        ex.warm()
        for i in range(n):
            out = work / "out" / f"{sandboxed}-{i}"
            out.mkdir(parents=True)
            sandbox = {**sandbox_mod.DEFAULTS, "ro": [str(code)], "out": str(out),
                       "hidden": isolation.package_dirs()} if sandboxed else None
            job = StageJob(job_id=uuid.uuid4().hex, argv=["python", "noop.py"], cwd=code, commit="0" * 40, out=out,
                           log_path=work / "noop.log", timeout_s=60, sandbox=sandbox)
            t0 = time.perf_counter()
            ex.submit(job)
            (res,) = ex.poll(60)
            times.append(time.perf_counter() - t0)
            assert res.status == "ok", (work / "noop.log").read_text()
    return times


def cold_dispatch(work: Path, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "noop.py"], cwd=work / "code", check=True)
        times.append(time.perf_counter() - t0)
    return times


def make_lab(root: Path, sleep_s: float, sandbox: str = "auto") -> Lab:
    root.mkdir(parents=True)
    (root / "research.toml").write_text(TOML % (sleep_s, sandbox))
    (root / "program.md").write_text("bench\n")
    (root / "predict.py").write_text(PREDICT)
    (root / ".gitignore").write_text("runs/\n")
    git(root, "init", "-q", "-b", "autoresearch/baseline")
    git(root, "-c", "user.email=b@b", "-c", "user.name=b", "add", "-A")
    git(root, "-c", "user.email=b@b", "-c", "user.name=b", "commit", "-qm", "bench")
    return Lab(root, parse_config((root / "research.toml").read_text()))


def drive_batch(root: Path, n_runs: int, sleep_s: float, slots: int, sandbox: str = "auto") -> dict[str, float]:
    """Queue n_runs (tasks × seeds) of a one-stage lab; drive with a warm executor; time it."""
    lab = make_lab(root, sleep_s, sandbox)
    harness = TinyHarness()
    store = experiment.open_store(lab)
    tasks = ["a", "b", "c"]
    seeds = list(range((n_runs + len(tasks) - 1) // len(tasks)))
    pairs = [(t, s) for s in seeds for t in tasks][:n_runs]
    ids = [experiment.ensure_runs(store, lab, "autoresearch/baseline", [t], [s], harness=harness)[0] for t, s in pairs]
    executor = LocalExecutor(preload=("numpy",), slots=slots)
    executor.warm()
    with runner.Driver(lab, store, executor, harness=harness) as d:
        d.prepared()  # one-offs, not dispatch: data preparation and the scorer's scipy import
        import scipy.stats  # noqa: F401
        t0 = time.perf_counter()
        d.drive(until=ids, poll_s=0.5)
        makespan = time.perf_counter() - t0
    execs = [e for e in store.stage_execs(ids) if e.outcome == "ok"]
    ok = sum(1 for r in store.results_for(labrepo.resolve_commit(lab, "autoresearch/baseline")) if r.outcome == "ok")
    assert ok == n_runs, f"{ok} of {n_runs} runs ok"
    busy = sum(e.wall_s for e in execs)
    return {"runs": n_runs, "slots": slots, "makespan_s": makespan, "stage_wall_s": busy,
            "utilisation": busy / (slots * makespan), "per_run_s": makespan * slots / n_runs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--cold", type=int, default=5, help="cold subprocess starts to time (each takes seconds)")
    p.add_argument("--util-runs", type=int, default=40)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        warm = warm_dispatch(work, args.runs, sandboxed=True)
        bare = warm_dispatch(work, args.runs, sandboxed=False)
        cold = cold_dispatch(work, args.cold)
        e2e = drive_batch(work / "noop-lab", args.runs, 0.0, 1)
        e2e_bare = drive_batch(work / "noop-lab-unsandboxed", args.runs, 0.0, 1, sandbox="off")
        util = drive_batch(work / "full-lab", args.util_runs, 0.5, 2)
    out = {
        "warm_dispatch_median_ms": statistics.median(warm) * 1e3,
        "warm_dispatch_p90_ms": pct(warm, 0.9) * 1e3,
        "warm_dispatch_unsandboxed_median_ms": statistics.median(bare) * 1e3,
        "warm_dispatch_unsandboxed_p90_ms": pct(bare, 0.9) * 1e3,
        "sandbox_over_unsandboxed": statistics.median(warm) / statistics.median(bare),
        "cold_subprocess_median_ms": statistics.median(cold) * 1e3,
        "cold_over_warm": statistics.median(cold) / statistics.median(warm),
        "driver_per_run_overhead_ms": e2e["per_run_s"] * 1e3,
        "driver_per_run_overhead_unsandboxed_ms": e2e_bare["per_run_s"] * 1e3,
        "utilisation": util["utilisation"],
        "utilisation_detail": util,
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"warm dispatch, {args.runs} no-op stages (torch+peft preloaded), sandboxed: "
          f"median {out['warm_dispatch_median_ms']:.1f} ms, p90 {out['warm_dispatch_p90_ms']:.1f} ms   [target <= 100 ms]")
    print(f"warm dispatch, the same stages unsandboxed:                 "
          f"median {out['warm_dispatch_unsandboxed_median_ms']:.1f} ms, p90 {out['warm_dispatch_unsandboxed_p90_ms']:.1f} ms"
          f"   (sandbox / none: {out['sandbox_over_unsandboxed']:.2f}x)")
    print(f"cold subprocess importing torch+peft, {args.cold} starts:       median {out['cold_subprocess_median_ms']:.0f} ms")
    print(f"ratio cold / warm:                                          {out['cold_over_warm']:.0f}x")
    print(f"whole driver, {args.runs} one-stage runs on 1 slot (claim, key, fork, publish, score, store): "
          f"{out['driver_per_run_overhead_ms']:.1f} ms per run sandboxed, "
          f"{out['driver_per_run_overhead_unsandboxed_ms']:.1f} ms unsandboxed")
    print(f"slot utilisation, {util['runs']} runs x 0.5 s stage on {util['slots']} slots, full queue: "
          f"{out['utilisation']:.1%} (makespan {util['makespan_s']:.2f} s)   [target >= 90 %]")


if __name__ == "__main__":
    main()
