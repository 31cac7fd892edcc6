"""The paired protocol's must-show numbers (issue 19): error and power at any pairing, beside `sequential`.

    .venv/bin/python benchmarks/gate_sim_paired.py [--trials 200000] [--power-trials N] [--protocols paired ...]
        [--alpha A] [--futility-p F] [--json]

8 tasks, every task improving by the effect, each protocol at its own defaults unless `--alpha`,
`--futility-p` (paired α 0.01 one-sided, futility_p 0.20; sequential 0.025, 0.30), trim 0.125;
`paired`: looks 1/2/5/10, the lazy baseline (the gate sees max(look, 2) baseline seeds: a
generation's first challenger), 10 earlier comparisons of 2 pairs each as the lab's history;
`sequential`: 10 baseline runs, looks 2/5/10, on the same data (it ignores the pairing). Pair ρ is
the correlation of the challenger's seed-k run with the baseline's; the history pairs at the same ρ,
and then at 0.9 while this hypothesis pairs at 0 (it changes pretraining). Exit status 1 if a null
improvement rate exceeds 0.027.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from pipeline.gate.protocol import get_protocol  # noqa: E402
from pipeline.gate.sim import simulate  # noqa: E402

FPR_LIMIT = 0.027
EFFECTS = (0.0, 0.5, 1.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=200_000, help="trials per null cell")
    ap.add_argument("--power-trials", type=int, default=None, help="trials per power cell (default: --trials)")
    ap.add_argument("--protocols", nargs="+", default=["paired", "sequential"])
    ap.add_argument("--alpha", type=float, default=None, help="one-sided α (default: each protocol's own)")
    ap.add_argument("--futility-p", type=float, default=None, help="futility p (default: each protocol's own)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    cases = [(rho, pr, None) for rho in (0.02, 0.6) for pr in (0.0, 0.5, 0.95)] + [(rho, 0.0, 0.9) for rho in (0.02, 0.6)]
    for rho, pair, hist in cases:
        for protocol in args.protocols:
            if protocol == "sequential" and hist is not None:
                continue  # the two-sample test has no history of pairs
            for effect in EFFECTS:
                t0 = time.perf_counter()
                trials = args.trials if effect == 0 or args.power_trials is None else args.power_trials
                proto = get_protocol(protocol)
                alpha = proto.default_alpha if args.alpha is None else args.alpha
                futility = proto.default_futility_p if args.futility_p is None else args.futility_p
                r = simulate(protocol=protocol, effect=effect, rho=rho, pair_rho=pair, history_pair_rho=hist,
                             trials=trials, alpha=alpha, futility_p=futility, looks=(1, 2, 5, 10) if protocol == "paired" else (2, 5, 10), seed=19)
                print(f"  [{protocol} ρ={rho} pair={pair} hist={hist} effect={effect}: {time.perf_counter() - t0:.1f}s]",
                      file=sys.stderr, flush=True)
                rows.append({"protocol": protocol, "trials": trials, "alpha": alpha, "futility_p": futility, "rho": rho, "pair_rho": pair, "history_pair_rho": r.history_pair_rho,
                             "effect": effect, "improvement_rate": r.improvement_rate,
                             "se": r.standard_error(r.improvement_rate), "held_rate": r.held_rate,
                             "mean_challenger_runs": r.mean_challenger_runs, "verdict_rates": r.verdict_rates})
    misses = [r for r in rows if r["effect"] == 0 and r["improvement_rate"] > FPR_LIMIT]
    if args.json:
        print(json.dumps({"trials": args.trials, "rows": rows, "misses": misses}, indent=2))
    else:
        levels = ", ".join(sorted({f"{r['protocol']} α {r['alpha']:g} futility {r['futility_p']:g}" for r in rows}))
        print(f"gate-sim, {args.trials} trials per null cell, {args.power_trials or args.trials} per power cell: `improvement` rate (mean challenger runs); 8 tasks, ρ = cross-task "
              f"correlation, pair ρ = seed k of the challenger with seed k of the baseline; {levels}")
        print(f"{'ρ':>5} {'pair ρ':>7} {'history':>8} {'protocol':>11} " + "".join(f"{f'{e:g}σ':>18}" for e in EFFECTS))
        for rho, pair, hist in cases:
            for protocol in args.protocols:
                cells = [r for r in rows if (r["rho"], r["pair_rho"], r["protocol"]) == (rho, pair, protocol)
                         and (r["history_pair_rho"] == (hist if hist is not None else pair) or protocol == "sequential")]
                if not cells or (protocol == "sequential" and hist is not None):
                    continue
                print(f"{rho:>5g} {pair:>7g} {hist if hist is not None else pair:>8g} {protocol:>11} " + "".join(
                    f"{c['improvement_rate']:>10.4f} ({c['mean_challenger_runs']:>4.2f})" for c in cells))
        print("null improvement rate ≤ 0.027 everywhere:", "yes" if not misses else f"NO: {len(misses)} cells")
    return 1 if misses else 0


if __name__ == "__main__":
    raise SystemExit(main())
