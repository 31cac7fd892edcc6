"""The replication step's test (`[gate] replicate_runs`) on simulated fresh pairs: how often it passes
a null and how often a true gain, when the tasks' differences share a seed-level shock.

    .venv/bin/python benchmarks/replication.py [--trials 2000] [--tasks 8] [--json OUT]

A challenger that changes a stage shared by every task at seed k (pretraining) moves every task's Δ
at that seed together. Three tests of the same 2 fresh pairs per task, at a nominal one-sided 0.10:

- `own`: what the product runs (`Experiment.replication`, `replication.own_spread_test`): the fresh
  per-seed horizontal values (trimmed mean over tasks of Δ / σ_task) on this hypothesis's own spread,
  its decisive look's 5 pairs (drawn here from the same hypothesis, not selected on: the selection's
  effect is measured by `loop_quality.py --rules paired-replicate2`) pooled with the fresh ones;
- `bound`: the gate's own horizontal test at one fixed-sample look (its variance moderated by the
  unpaired bound from the baseline's runs): valid for any pairing, at most of its power;
- `pooled`: the simulator's first rule `paired-confirm2-t10` (benchmarks/loop_quality.py `replicated`):
  the within-task spread of the pairs pooled over tasks, tasks × (pairs − 1) df, as if tasks were
  independent at a seed.

Model, per arm and seed k, task t, in σ_task units: x = √ρ_task · S_k + √(1 − ρ_task) · E_tk, with
the challenger's S and E correlated ρ_pair with the baseline's (common random numbers), plus the
effect on every task for the challenger. The baseline's own block (its noise study: 5 seeds) gives
σ_task, as in the product. Prints the pass rate per cell (nulls: the false-pass rate; gains: power).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

OWN = 5  # the baseline's own runs per task before the replication (the noise study)
PAIRS = 2
LOOK = 5  # the decisive look's pairs (`own`: drawn from the same hypothesis, not selected on)
ALPHA = 0.10


def draw(rng: np.random.Generator, tasks: int, seeds: int, rho_task: float, rho_pair: float,
         effect: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The baseline's own runs (tasks, OWN), and both arms on the fresh seeds (tasks, seeds)."""
    def arm(shared: np.ndarray, own: np.ndarray) -> np.ndarray:
        return np.sqrt(rho_task) * shared[None, :] + np.sqrt(1 - rho_task) * own

    own = arm(rng.standard_normal(OWN), rng.standard_normal((tasks, OWN)))
    sb, eb = rng.standard_normal(seeds), rng.standard_normal((tasks, seeds))
    sc = rho_pair * sb + np.sqrt(1 - rho_pair**2) * rng.standard_normal(seeds)
    ec = rho_pair * eb + np.sqrt(1 - rho_pair**2) * rng.standard_normal((tasks, seeds))
    return own, arm(sb, eb), arm(sc, ec) + effect


def gate_test(own: np.ndarray, base: np.ndarray, chal: np.ndarray) -> bool:
    """The replication on the gate's unpaired bound: its horizontal test at one look, through `evaluate`."""
    from pipeline.gate import evaluate
    from pipeline.gate.inputs import GateConfig

    cfg = GateConfig(replicate_runs=PAIRS).model_dump()
    cfg.update(alpha=ALPHA, looks=[PAIRS])
    tasks = [{"task": f"t{i}", "baseline": list(map(float, base[i])), "challenger": list(map(float, chal[i])),
              "history": list(map(float, own[i])) + list(map(float, base[i]))} for i in range(own.shape[0])]
    inp = {"config": cfg, "tasks": tasks, "pair_history": [], "arm_history": [], "looks_done": [], "at_look": True}
    hz = evaluate(inp).horizontal
    return hz.t is not None and hz.boundary is not None and hz.t >= hz.boundary


def own_test(own: np.ndarray, base: np.ndarray, chal: np.ndarray, look_d: np.ndarray) -> bool:
    """The product's test (`Experiment.replication`): the fresh per-seed horizontal values on this
    hypothesis's own spread, the look's pairs `look_d` (tasks, m) pooled with the fresh ones."""
    from pipeline.gate.replication import own_spread_test
    from pipeline.gate.stats import paired_horizontal

    sigma = own.std(axis=1, ddof=1)
    return own_spread_test(paired_horizontal(look_d, sigma), paired_horizontal(chal - base, sigma), ALPHA)[4]


def pooled_test(own: np.ndarray, base: np.ndarray, chal: np.ndarray) -> bool:
    """The simulator's `paired-confirm2-t10` on the same values (σ_task from the baseline's own runs)."""
    from loop_quality import replicated

    sigma = own.std(axis=1, ddof=1)
    fresh = ((chal - base) / sigma[:, None])[None]
    return bool(replicated(fresh, ALPHA)[0])


def grid(trials: int, tasks: int, seed: int = 0) -> list[dict[str, Any]]:
    rows = []
    for rho_task in (0.0, 0.5, 0.8):
        for rho_pair in (0.0, 0.5):
            for effect in (0.0, 0.5, 1.0, 2.0):
                rng = np.random.default_rng([seed, int(rho_task * 10), int(rho_pair * 10), int(effect * 10)])
                n = trials if effect == 0 else max(trials // 2, 1)
                passed = {"own": 0, "bound": 0, "pooled": 0}
                for _ in range(n):
                    own, base, chal = draw(rng, tasks, PAIRS, rho_task, rho_pair, effect)
                    _, look_b, look_c = draw(rng, tasks, LOOK, rho_task, rho_pair, effect)
                    passed["own"] += own_test(own, base, chal, look_c - look_b)
                    passed["bound"] += gate_test(own, base, chal)
                    passed["pooled"] += pooled_test(own, base, chal)
                rows.append({"rho_task": rho_task, "rho_pair": rho_pair, "effect": effect, "trials": n,
                             **{k: v / n for k, v in passed.items()}})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=2000, help="per null cell (half that per gain cell)")
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    t0 = time.time()
    rows = grid(args.trials, args.tasks)
    print(f"{PAIRS} fresh pairs per task, {args.tasks} tasks, one-sided {ALPHA}: share passed "
          f"(effect 0: false passes; else power)")
    print(f"{'ρ_task':>7} {'ρ_pair':>7} {'effect':>7} {'trials':>7} {'own':>7} {'bound':>7} {'pooled':>7}")
    for r in rows:
        print(f"{r['rho_task']:>7.1f} {r['rho_pair']:>7.1f} {r['effect']:>6.1f}σ {r['trials']:>7} "
              f"{r['own']:>7.3f} {r['bound']:>7.3f} {r['pooled']:>7.3f}")
    print(f"({time.time() - t0:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps({"tasks": args.tasks, "pairs": PAIRS, "alpha": ALPHA, "rows": rows,
                                         "command": "benchmarks/replication.py " + " ".join(argv or sys.argv[1:])},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
