"""The loop's wall time on a real Ray cluster against the local executor, measured in one run.

    .venv/bin/python benchmarks/ray_vs_local.py [--nodes 1|2] [--json]

The tests' tiny lab (the bundled benchmark, shrunk: 300 customers, 2 tasks, looks of 2 and 3
runs), one hypothesis of the offline policy, `autoresearch run --offline --max-hypotheses 1
--workers 2` as a real process: once with `--executor local`, once with `--executor ray
--ray-address` against a cluster started by `ray start --head` (and, with `--nodes 2`, a second
node by `ray start --address`, 1 CPU each). The cluster is started before the clock starts (a
team's cluster is up already); the Ray run's time includes connecting and starting the warm
worker actors. Prints both wall times, the ratio, and whether the verdicts and the gate's numbers
are identical. Target (issue 14): ratio ≤ 1.5 (it was 4.1 with a cold interpreter per stage).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from support.lab import cli_env, copy_lab, make_template  # noqa: E402
from support.ray_cluster import ENV, RayCluster  # noqa: E402


def autoresearch(lab: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent.cli", "--repo", str(lab), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1800)


def measure(lab: Path, executor: str, address: str | None) -> tuple[float, dict]:
    env = cli_env(**ENV)
    extra = ["--ray-address", address] if address else []
    t0 = time.monotonic()
    run = autoresearch(lab, "run", "--offline", "--max-hypotheses", "1", "--executor", executor, "--workers", "2",
                       *extra, env=env)
    wall = time.monotonic() - t0
    if run.returncode != 0:
        raise SystemExit(f"{executor}: run failed\n{run.stderr[-3000:]}")
    (h,) = json.loads(autoresearch(lab, "status", "--json", env=env).stdout)["hypotheses"]
    report = json.loads(autoresearch(lab, "report", str(h["id"]), "--json", env=env).stdout)
    return wall, report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, choices=(1, 2), default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ar-bench-ray-") as tmp:
        template = make_template(Path(tmp) / "template" / "lab")
        local_lab = copy_lab(template, Path(tmp) / "local" / "lab")
        ray_lab = copy_lab(template, Path(tmp) / "ray" / "lab")
        local_s, local_rep = measure(local_lab, "local", None)
        head_cpus = 2 if args.nodes == 1 else 1
        with RayCluster(head_cpus=head_cpus, worker_cpus=0 if args.nodes == 1 else 1) as cluster:
            ray_s, ray_rep = measure(ray_lab, "ray", cluster.address)
    same_verdict = local_rep["gate"]["verdict"] == ray_rep["gate"]["verdict"]
    same_numbers = all(
        abs(a["baseline_mean"] - b["baseline_mean"]) < 1e-9 and abs(a["challenger_mean"] - b["challenger_mean"]) < 1e-9
        for a, b in zip(local_rep["gate"]["tasks"], ray_rep["gate"]["tasks"]))
    out = {"nodes": args.nodes, "local_s": round(local_s, 1), "ray_s": round(ray_s, 1),
           "ratio": round(ray_s / local_s, 2), "verdict_local": local_rep["gate"]["verdict"],
           "verdict_ray": ray_rep["gate"]["verdict"], "identical_verdict": same_verdict,
           "identical_numbers": same_numbers}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"loop, 1 hypothesis, tiny lab, 2 slots: local {out['local_s']} s, ray ({args.nodes} node(s)) "
              f"{out['ray_s']} s, ratio {out['ratio']}× (target ≤ 1.5×)")
        print(f"verdicts: local {out['verdict_local']}, ray {out['verdict_ray']}; identical verdict {same_verdict}, "
              f"identical numbers {same_numbers}")


if __name__ == "__main__":
    main()
