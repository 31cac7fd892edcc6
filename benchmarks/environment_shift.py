"""What an environment change does to the paired gate, and what the tool's answers leave of it.

    .venv/bin/python benchmarks/environment_shift.py [--trials 20000] [--tasks 8] [--json]

A torch/CUDA upgrade or another GPU model moves every run of a lab by some δ (in units of a run's
σ): another bf16 kernel, TF32 on, another data order. The baseline's runs are measured lazily,
before the change; a challenger's after it. Each trial is one null hypothesis (its code changes
nothing) through the `paired` protocol's real statistics (`pipeline.gate.paths.paired_path`: looks
1/2/5/10, α 0.01 one-sided, futility 0.2, the lazy baseline, 10 earlier comparisons as the lab's
history), with its runs' environments drawn per scenario, and the real hold rule
(`pipeline.environment.held_for`) applied to each trial that stops on `improvement`:

- **upgrade**: the baseline's 10 runs all measured before the change (the gate sees them all),
  the challenger's after it. "promoted before" is what the gate promoted with no environment on
  record (this tool until now); "promoted, held" what is promoted automatically with the hold (a
  hold waits for a human); "promoted, re-measured" what the gate promotes when the loop re-measured
  its baseline in the new environment first (both arms in it).
- **lazy**: the baseline's first 2 runs measured before the change, the rest when a look of this
  challenger needs them, after it (a hypothesis in flight at an upgrade, or `remeasure_on_change =
  false`): only the pairs of those 2 seeds moved, a share the hold lets through below a quarter.
- **mixed cluster**: each run lands on one of two node types at random (both arms), the second
  moving runs by δ: how many null gains the gate promotes, and how many are held by chance. The
  same with a real effect of 1σ on every task: the share of real gains the hold sends to a human
  (its cost).

Prints one table; `--json` adds the rows. Seeds fixed: the same command prints the same numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

import numpy as np

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from pipeline import environment  # noqa: E402
from pipeline.environment import held_for  # noqa: E402
from pipeline.gate.protocol import get_protocol  # noqa: E402
from pipeline.gate.verdict import CODE, Verdict  # noqa: E402

LOOKS = (1, 2, 5, 10)
DELTAS = (0.0, 0.25, 0.5, 1.0)
LAZY_BEFORE = 2  # `lazy`: the baseline seeds measured before the change


def run(scenario: str, delta: float, effect: float, trials: int, tasks: int, rho: float, pair_rho: float,
        seed: int) -> dict[str, Any]:
    """One cell: `trials` hypotheses; the rates of improvement, of automatic promotion with the hold,
    and of holds."""
    proto = get_protocol("paired")
    rng = np.random.default_rng(seed)
    n, J, last = 10, tasks, LOOKS[-1]

    def draw(b: int, *seeds: int) -> np.ndarray:
        common = rng.standard_normal((b, 1, *seeds))
        own = rng.standard_normal((b, J, *seeds))
        return math.sqrt(rho) * common + math.sqrt(1 - rho) * own

    base = draw(trials, n)
    chal = pair_rho * base[..., :last] + math.sqrt(1 - pair_rho ** 2) * draw(trials, last) + effect
    depth = np.zeros(trials, int)  # the baseline seeds measured before this hypothesis (the lazy baseline)
    if scenario == "upgrade":
        env_b, env_c = np.zeros((trials, J, n), int), np.ones((trials, J, last), int)
        depth = np.full(trials, n)
    elif scenario == "lazy":
        env_b, env_c = np.ones((trials, J, n), int), np.ones((trials, J, last), int)
        env_b[..., :LAZY_BEFORE] = 0
        depth = np.full(trials, LAZY_BEFORE)
    elif scenario == "remeasured":
        env_b, env_c = np.ones((trials, J, n), int), np.ones((trials, J, last), int)
    else:  # mixed cluster: every run on either node type
        env_b, env_c = rng.integers(0, 2, (trials, J, n)), rng.integers(0, 2, (trials, J, last))
    base = base + delta * env_b
    chal = chal + delta * env_c
    pairs, arms = proto.lab_history(draw, trials, 10, pair_rho)
    path = proto.path(base, chal, LOOKS, alpha=0.01, futility_p=0.2, harm_q=0.1, horizontal_trim=0.125,
                      history=None, pair_history=pairs, base_depth=depth, arm_history=arms)
    code, k_stop = path.first_stop()
    up = np.flatnonzero(code == CODE[Verdict.improvement])
    held = 0
    for i in up:
        seeds = range(LOOKS[k_stop[i]])
        b = {(t, s): f"e{env_b[i, t, s]}" for t in range(J) for s in seeds}
        c = {(t, s): f"e{env_c[i, t, s]}" for t in range(J) for s in seeds}
        held += held_for(b, c) is not None
    return {"scenario": scenario, "delta": delta, "effect": effect, "trials": trials,
            "improvement": len(up) / trials, "promoted_with_hold": (len(up) - held) / trials, "held": held / trials}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=20_000)
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--rho", type=float, default=0.6, help="the tasks' correlation within a seed")
    ap.add_argument("--pair-rho", type=float, default=0.5, help="seed k's correlation between the arms")
    ap.add_argument("--hold-share", type=float, default=None,
                    help=f"the hold's share of pairs moved one way (default {environment.IMBALANCE_HOLD})")
    ap.add_argument("--hold-p", type=float, default=None,
                    help=f"the hold's sign-test level (default {environment.HOLD_P})")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.hold_share is not None:
        environment.IMBALANCE_HOLD = a.hold_share
    if a.hold_p is not None:
        environment.HOLD_P = a.hold_p
    rows = []
    print(f"hold: more than {environment.IMBALANCE_HOLD:g} of the pairs moved one way, and the arms share no "
          f"environment or a sign test says p < {environment.HOLD_P:g}")
    print(f"paired gate, {a.tasks} tasks, looks {LOOKS}, α 0.01, {a.trials} null hypotheses per cell "
          f"(ρ tasks {a.rho}, ρ pair {a.pair_rho}); rates per hypothesis, ± ≈ {math.sqrt(0.01 / a.trials):.4f} at 1 %")
    print()
    print("upgrade between the arms (a null challenger; δ: the environment's shift in run σ)")
    print(f"{'δ':>6} {'promoted before':>16} {'promoted, held':>15} {'held':>8} {'promoted, re-measured':>22}"
          f" {'lazy: before':>13} {'lazy: held':>11}")
    for k, d in enumerate(DELTAS):
        up = run("upgrade", d, 0.0, a.trials, a.tasks, a.rho, a.pair_rho, 100 + k)
        re = run("remeasured", d, 0.0, a.trials, a.tasks, a.rho, a.pair_rho, 200 + k)
        lazy = run("lazy", d, 0.0, a.trials, a.tasks, a.rho, a.pair_rho, 400 + k)
        rows += [up, re, lazy]
        print(f"{d:>6.2f} {up['improvement']:>16.4f} {up['promoted_with_hold']:>15.4f} {up['held']:>8.4f} "
              f"{re['promoted_with_hold']:>22.4f} {lazy['improvement']:>13.4f} {lazy['promoted_with_hold']:>11.4f}")
    print()
    print("mixed cluster (each run on one of two node types at random; the second shifts runs by δ)")
    print(f"{'δ':>6} {'effect':>7} {'improvement':>12} {'promoted, held':>15} {'held':>8} {'held share':>11}")
    for k, d in enumerate(DELTAS):
        for effect in (0.0, 1.0):
            r = run("mixed", d, effect, a.trials, a.tasks, a.rho, a.pair_rho, 300 + 10 * k + int(effect))
            rows.append(r)
            share = r["held"] / r["improvement"] if r["improvement"] else 0.0
            print(f"{d:>6.2f} {effect:>7.1f} {r['improvement']:>12.4f} {r['promoted_with_hold']:>15.4f} "
                  f"{r['held']:>8.4f} {share:>11.3f}")
    if a.json:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
