"""The gate's must-show numbers (issue 4): error rates, power and cost at ≥ 200 000 trials each.

    .venv/bin/python benchmarks/gate_sim.py [--trials 200000] [--json]

Checks, for the default design (8 tasks, 10 baseline runs, trim 0.125, looks 2/5/10, α = 0.025 one-sided,
futility_p = 0.30, no extra baseline history):
- sequential: one-sided false-improvement rate ≤ 0.027 over all looks — per task, for the
  horizontal test and for the `improvement` verdict — at cross-task correlation 0 and 0.6;
- power at δ = 2σ with 10 baseline and up to 10 challenger runs ≥ 0.88 (a single task through the
  whole gate, and each task's own sequential test over the looks when 8 tasks all improve);
- mean challenger runs per null hypothesis ≤ 4;
- one task improving hugely (10σ) and the rest not at all is not called an `improvement`;
- the fixed protocol's inflation (re-testing at every look), with and without futility stops.
Exit status 1 if a target is missed. Runtime: a few minutes on one core.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from pipeline.gate.sim import SimResult, simulate  # noqa: E402

FPR_LIMIT = 0.027
POWER_TARGET = 0.88
RUNS_LIMIT = 4.0


def run(name: str, trials: int, **kw: Any) -> SimResult:
    t0 = time.perf_counter()
    r = simulate(trials=trials, **kw)
    print(f"  [{name}: {time.perf_counter() - t0:.1f}s]", file=sys.stderr)
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=200_000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    n = args.trials
    checks: list[tuple[str, float, str, float, bool]] = []
    out: dict[str, Any] = {"trials": n}

    def check(label: str, value: float, op: str, limit: float, se: float | None = None) -> None:
        ok = value <= limit if op == "<=" else value >= limit
        checks.append((label, value, op, limit, ok))
        out.setdefault("checks", []).append(
            {"check": label, "value": value, "se": se, "op": op, "limit": limit, "ok": ok}
        )

    for rho in (0.0, 0.6):
        r = run(f"sequential null rho={rho}", n, protocol="sequential", rho=rho, seed=11)
        out[f"sequential_null_rho{rho}"] = r.to_json()
        check(f"sequential ρ={rho}: per-task false improvement, every look", r.per_task_rate_all_looks, "<=", FPR_LIMIT,
              r.standard_error(r.per_task_rate_all_looks))
        check(f"sequential ρ={rho}: horizontal false improvement, every look", r.horizontal_rate_all_looks, "<=",
              FPR_LIMIT, r.standard_error(r.horizontal_rate_all_looks))
        check(f"sequential ρ={rho}: `improvement` verdict under the null", r.improvement_rate, "<=", FPR_LIMIT,
              r.standard_error(r.improvement_rate))
        check(f"sequential ρ={rho}: mean challenger runs per null hypothesis", r.mean_challenger_runs, "<=", RUNS_LIMIT)

    r = run("sequential power J=1", n, protocol="sequential", effect=2.0, tasks=1, seed=12)
    out["sequential_power_one_task"] = r.to_json()
    check("sequential δ=2σ, 1 task: power of the gate (`improvement`)", r.improvement_rate, ">=", POWER_TARGET,
          r.standard_error(r.improvement_rate))
    r = run("sequential power J=8", n, protocol="sequential", effect=2.0, seed=13)
    out["sequential_power_eight_tasks"] = r.to_json()
    check("sequential δ=2σ, 8 tasks: each task's own test over the looks", r.per_task_rate_all_looks, ">=",
          POWER_TARGET, r.standard_error(r.per_task_rate_all_looks))
    check("sequential δ=2σ, 8 tasks: power of the gate (`improvement`)", r.improvement_rate, ">=", POWER_TARGET,
          r.standard_error(r.improvement_rate))

    for rho in (0.0, 0.6):
        r = run(f"one task 10σ rho={rho}", n, protocol="sequential", effect=10.0, affected=1, rho=rho, seed=14)
        out[f"sequential_one_task_huge_rho{rho}"] = r.to_json()
        check(f"sequential ρ={rho}: `improvement` when one task gains 10σ and 7 gain nothing", r.improvement_rate,
              "<=", FPR_LIMIT, r.standard_error(r.improvement_rate))

    info = []
    for rho in (0.0, 0.6):
        r = run(f"fixed null rho={rho}", n, protocol="fixed", rho=rho, seed=15)
        out[f"fixed_null_rho{rho}"] = r.to_json()
        info.append((f"fixed ρ={rho}", r))
    r = run("fixed null, no futility", n, protocol="fixed", futility_p=1.0, seed=16)
    out["fixed_null_no_futility"] = r.to_json()
    info.append(("fixed ρ=0, always run to 10", r))
    r = run("fixed power J=1", n, protocol="fixed", effect=2.0, tasks=1, seed=17)
    out["fixed_power_one_task"] = r.to_json()

    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        print(f"gate-sim must-show numbers, {n} trials per line (8 tasks, 10 baseline runs, trim 0.125, looks 2/5/10, α=0.025)")
        for label, value, op, limit, ok in checks:
            print(f"  {'PASS' if ok else 'FAIL'}  {label}: {value:.4f} (target {op} {limit})")
        print("fixed protocol (the reference post's re-tested nominal t), same null data model:")
        for label, r in info:
            print(
                f"  {label}: per-task false improvement {r.per_task_rate_all_looks:.4f} over every look "
                f"({r.per_task_rate:.4f} at looks reached), horizontal {r.horizontal_rate_all_looks:.4f}, "
                f"`improvement` verdicts {r.improvement_rate:.4f}, `harm` verdicts {r.verdict_rates['harm']:.4f}, "
                f"mean runs {r.mean_challenger_runs:.2f}"
            )
        fp = out["fixed_power_one_task"]
        print(f"  fixed δ=2σ, 1 task: power {fp['power']:.4f}, mean runs {fp['mean_challenger_runs']:.2f}")
    return 0 if all(c[4] for c in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
