"""The loop scored as a decision rule (issue 12, DESIGN §6): what it banks, what it wastes, what it fools itself with.

    .venv/bin/python benchmarks/loop_quality.py [--campaigns 300] [--hypotheses 200] [--rho 0.02 0.6]
        [--noise benchmarks/results/headroom.json | --noise VARIANCE.json] [--json] [--out FILE]

One population of hypotheses is drawn from a stated prior (`PRIOR` below: mostly no effect, gains of
0.5-3σ on every task or on one, some harms) and run, one campaign of `--hypotheses` after another,
through whole decision rules. Every rule but keep/discard is judged by the real gate code
(`pipeline.gate.sim.look_path`: the pooled/moderated t, the spending boundaries, the trimmed-mean
horizontal test, BH, the verdict table that `evaluate` uses) and the agent's own decision rule
(`agent.graph.allowed_decisions`: promote on `improvement`, run to the next look on `escalate`,
abandon otherwise). Each campaign keeps its baseline: its runs are drawn once and serve every
challenger until a promotion, which moves the baseline's true level by the promoted effect and
draws the new baseline's fresh runs (their cost is counted).

Noise: per run, task j, seed s: σ_j·(√ρ·c_s + √(1-ρ)·e_js), per-task σ_j from the noise file
(effects are drawn in σ_j units; the gate standardises by σ_task, and results are reported in σ
units, i.e. over the median σ), ρ the cross-task correlation (tasks share a seed's pretraining): the
bundled suite's ρ = 0.02 (`autoresearch variance --runs 10` on the demo lab) and a pessimistic 0.6
by default. Seeds (the shock c_s is a seed's pretraining, common to every task): in this product a
baseline and its challengers run on one seed block and share a seed's pretraining through the cache
unless the challenger changes pretraining (`PRETRAIN_SHARE` of hypotheses do; they draw their own
c_s), so c_s is drawn once per baseline (`block`). Before issue 12 the baseline had seeds of its own
and only the challengers shared theirs (`separate`): a baseline whose challenger seeds were unlucky
held every challenger back until a large gain broke through, and such baselines last longest.
The reference post's and karpathy's rules run every run on fresh seeds (`fresh`); `--fresh-seeds`
gives every rule fresh seeds, to compare the statistics alone. The task noise e_js is fresh for
every run. Every rule sees the same hypotheses in the same order (one stream for the population,
another per rule for the noise).

Rules:
- `sequential`  — this product's default gate (10 baseline runs, looks 2/5/10, trim 0.125, `block` seeds);
- `sequential-v1` — the gate as it was before issue 12 (5 baseline runs, interquartile mean, `separate` seeds);
- `fixed-5v2`   — the seed's protocol: pooled t at nominal α, 5 baseline runs, 2 challenger runs,
                  re-tested at 5 and 10 (same verdict table and escalation);
- `fixed-10`    — pooled t at nominal α, one look at 10 runs against 10 baseline runs;
- `keep-discard` — karpathy/autoresearch: one challenger run against the current best's one measured
                  run, kept if its mean over tasks is higher; a kept run *is* the new best's measurement.

Reported per rule: the share of each class promoted (horizontal gains by size, one-task gains, nulls,
harms), runs per hypothesis (challenger runs, plus baseline runs), true improvement banked per 1000
runs, and the baseline's drift after the campaign: the true improvement of the final baseline over
the first (mean over tasks, σ units) against what the rule measured (the sum of the Δ it saw at each
promotion). Exit status 1 if the `sequential` rule misses a target of issue 12.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.gate.sim import look_path  # noqa: E402
from pipeline.gate.verdict import CODE, ORDER, Verdict  # noqa: E402

TASKS = 8
HORIZONTAL_SIZES = (0.5, 1.0, 2.0, 3.0)
# The stated prior: (class, share, sizes in σ). Sizes are drawn uniformly from the tuple.
PRIOR: tuple[tuple[str, float, tuple[float, ...]], ...] = (
    ("null", 0.70, (0.0,)),
    ("horizontal", 0.12, HORIZONTAL_SIZES),   # every task improves by the size
    ("one_task", 0.06, (1.0, 2.0, 3.0)),       # one task improves, the rest do not move
    ("harm", 0.08, (-0.5, -1.0, -2.0)),        # every task gets worse
    ("one_task_harm", 0.04, (-3.0,)),          # one task gets much worse
)
PRETRAIN_SHARE = 0.4  # hypotheses that change pretraining: their seeds' pretraining is their own
TARGETS = {  # issue 12, for the `sequential` rule
    0.02: {"horizontal>=1": 0.95, "horizontal@0.5": 0.60},
    0.6: {"horizontal@2": 0.90, "horizontal@1": 0.60},
}
FALSE_LIMIT = 0.02  # nulls + harms promoted
RUNS_SHARE_LIMIT = 0.40  # challenger runs per null, as a share of fixed-10's


@dataclass(frozen=True)
class Rule:
    name: str
    protocol: str | None  # None: keep/discard
    baseline_runs: int
    looks: tuple[int, ...]
    trim: float = 0.125
    seeds: str = "fresh"  # block | separate | fresh (see the module docstring)


RULES = (
    Rule("sequential", "sequential", 10, (2, 5, 10), 0.125, "block"),
    Rule("sequential-v1", "sequential", 5, (2, 5, 10), 0.25, "separate"),
    Rule("fixed-5v2", "fixed", 5, (2, 5, 10), 0.25, "fresh"),
    Rule("fixed-10", "fixed", 10, (10,), 0.125, "fresh"),
    Rule("keep-discard", None, 1, (1,), 0.125, "fresh"),
)


def read_noise(path: Path) -> dict[str, Any]:
    """Per-task σ (and the measured ρ) from headroom.json's baseline AUCs or a `variance --json` study."""
    doc = json.loads(path.read_text())
    path = path.resolve().relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else path
    if "auc" in doc:  # benchmarks/headroom.py: tasks × seeds of the template baseline
        runs = np.array(doc["auc"]["baseline"], dtype=float)
        sigma = runs.std(axis=1, ddof=1)
        corr = np.corrcoef(runs.T, rowvar=False)
        rho = float(np.nanmean(corr[np.triu_indices(len(runs), 1)]))
        return {"source": str(path), "tasks": doc["tasks"], "sigma": sigma.tolist(), "rho_measured": rho,
                "seeds": int(runs.shape[1])}
    tasks = doc["tasks"]  # autoresearch variance --json
    return {"source": str(path), "tasks": list(tasks), "sigma": [tasks[t]["sd"] for t in tasks],
            "rho_measured": doc.get("mean_cross_task_correlation"), "seeds": doc.get("runs")}


def draw_runs(rng: np.random.Generator, mu: np.ndarray, sigma: np.ndarray, seeds: int, rho: float,
              common: np.ndarray | None = None) -> np.ndarray:
    """(B, J, seeds) runs around the true levels `mu` (B, J), per-task σ, cross-task correlation ρ;
    `common` (B, 1, seeds): the seeds' shared shocks, if they are shared with other runs."""
    b, j = mu.shape
    if common is None:
        common = rng.standard_normal((b, 1, seeds))
    own = rng.standard_normal((b, j, seeds))
    return mu[..., None] + sigma[None, :, None] * (math.sqrt(rho) * common[..., :seeds] + math.sqrt(1 - rho) * own)


def draw_hypotheses(rng: np.random.Generator, b: int, j: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per campaign: class index, size (σ) and the effect vector (B, J) of one hypothesis."""
    shares = np.array([p[1] for p in PRIOR])
    cls = rng.choice(len(PRIOR), size=b, p=shares / shares.sum())
    size = np.array([rng.choice(PRIOR[c][2]) for c in cls])
    effect = np.zeros((b, j))
    task = rng.integers(0, j, size=b)
    for i, c in enumerate(cls):
        name = PRIOR[c][0]
        if name in ("horizontal", "harm"):
            effect[i] = size[i]
        elif name in ("one_task", "one_task_harm"):
            effect[i, task[i]] = size[i]
    return cls, size, effect


def campaign(rule: Rule, rho: float, campaigns: int, hypotheses: int, seed: int, sigma: np.ndarray,
             rule_index: int = 0, fresh_seeds: bool = False) -> dict[str, Any]:
    """Run `campaigns` independent campaigns of `hypotheses` each through one rule, vectorised over campaigns."""
    from agent.graph import allowed_decisions

    population = np.random.default_rng([seed, 1])  # the same hypotheses for every rule
    rng = np.random.default_rng([seed, 2, rule_index])  # this rule's noise
    B, J = campaigns, TASKS
    sigma = np.asarray(sigma, dtype=float)[:J]
    unit = float(np.median(sigma))  # results in σ units: over the median σ
    seeds = "fresh" if fresh_seeds else rule.seeds
    mu = np.zeros((B, J))  # the current baseline's true level (metric units)
    shocks = rng.standard_normal((B, 1, max(rule.looks[-1], rule.baseline_runs)))  # this baseline's seed block
    base = draw_runs(rng, mu, sigma, rule.baseline_runs, rho, shocks if seeds == "block" else None)
    runs_chal = np.zeros(B)
    runs_base = np.full(B, float(rule.baseline_runs))
    measured = np.zeros(B)  # Σ of the Δ the rule saw at its promotions (mean over tasks)
    best_seen = base.mean(axis=(1, 2))  # keep/discard: the current best's one measured value
    counts: dict[str, list[int]] = {}  # key → [hypotheses, promoted]
    runs_by_class: dict[str, float] = {}
    promoted_classes = np.zeros(len(ORDER))
    improvement_code = CODE[Verdict.improvement]

    for _ in range(hypotheses):
        cls, size, effect = draw_hypotheses(population, B, J)
        own_pretraining = population.random(B) < PRETRAIN_SHARE
        effect = effect * sigma[None, :]
        common = None  # fresh seed shocks
        if seeds in ("block", "separate"):  # shared pretraining: the block's shocks, unless changed
            fresh = rng.standard_normal(shocks.shape)
            common = np.where(own_pretraining[:, None, None], fresh, shocks)
        chal = draw_runs(rng, mu + effect, sigma, rule.looks[-1], rho, common)
        if rule.protocol is None:  # keep/discard: one run, one number, no test
            value = (chal[..., 0] / sigma).mean(axis=1)
            promote = value > best_seen
            spent = np.ones(B)
            seen = value - best_seen
        else:
            path = look_path(rule.protocol, base, chal, rule.looks, horizontal_trim=rule.trim)
            code, k_stop = path.first_stop()
            promote = np.array([
                allowed_decisions(ORDER[c].value, rule.looks[k], list(rule.looks), supervised=False)[0] == "promote"
                for c, k in zip(code, k_stop)
            ])
            assert np.array_equal(promote, code == improvement_code)
            spent = np.asarray(rule.looks, dtype=float)[k_stop]
            seen = (path.task_delta[np.arange(B), k_stop] / sigma).mean(axis=1)
            promoted_classes += np.bincount(code[promote], minlength=len(ORDER))
        runs_chal += spent
        for i in range(B):
            name = PRIOR[cls[i]][0]
            key = f"{name}@{size[i]:g}"
            c = counts.setdefault(key, [0, 0])
            c[0] += 1
            c[1] += int(promote[i])
            runs_by_class[name] = runs_by_class.get(name, 0.0) + spent[i]
        measured += np.where(promote, seen, 0.0)
        mu = np.where(promote[:, None], mu + effect, mu)
        if rule.protocol is None:
            best_seen = np.where(promote, value, best_seen)
        elif promote.any():  # the new baseline's fresh runs on a new seed block
            shocks = np.where(promote[:, None, None], rng.standard_normal(shocks.shape), shocks)
            fresh = draw_runs(rng, mu, sigma, rule.baseline_runs, rho, shocks if seeds == "block" else None)
            base = np.where(promote[:, None, None], fresh, base)
            runs_base += promote * rule.baseline_runs

    def rate(pred: Any) -> float | None:
        n = sum(v[0] for k, v in counts.items() if pred(k))
        p = sum(v[1] for k, v in counts.items() if pred(k))
        return p / n if n else None

    def cls_of(key: str) -> str:
        return key.split("@")[0]

    def size_of(key: str) -> float:
        return float(key.split("@")[1])

    hyp_by_class = {name: sum(v[0] for k, v in counts.items() if cls_of(k) == name) for name, _, _ in PRIOR}
    true_gain = (mu / sigma).mean(axis=1)  # the final baseline's true improvement over the first, σ units
    total_runs = runs_chal + runs_base
    out = {
        "rule": rule.name,
        "protocol": rule.protocol or "keep/discard",
        "baseline_runs": rule.baseline_runs,
        "looks": list(rule.looks),
        "trim": rule.trim if rule.protocol else None,
        "rho": rho,
        "seeds": seeds,
        "sigma_unit": unit,
        "campaigns": campaigns,
        "hypotheses": hypotheses,
        "promoted": {
            **{f"horizontal@{g:g}": rate(lambda k, g=g: cls_of(k) == "horizontal" and size_of(k) == g)
               for g in HORIZONTAL_SIZES},
            "horizontal>=1": rate(lambda k: cls_of(k) == "horizontal" and size_of(k) >= 1),
            "one_task": rate(lambda k: cls_of(k) == "one_task"),
            "null": rate(lambda k: cls_of(k) == "null"),
            "harm": rate(lambda k: cls_of(k) in ("harm", "one_task_harm")),
            "null+harm": rate(lambda k: cls_of(k) in ("null", "harm", "one_task_harm")),
        },
        "challenger_runs_per_null": runs_by_class.get("null", 0.0) / max(hyp_by_class["null"], 1),
        "challenger_runs_per_hypothesis": float(runs_chal.mean() / hypotheses),
        "baseline_runs_per_hypothesis": float(runs_base.mean() / hypotheses),
        "runs_per_hypothesis": float(total_runs.mean() / hypotheses),
        "true_gain_per_1000_runs": float((true_gain / total_runs).mean() * 1000),
        "drift": {
            "true": float(true_gain.mean()),
            "measured": float(measured.mean()),
            "gap": float((measured - true_gain).mean()),
            "true_sd": float(true_gain.std()),
        },
    }
    return out


def check(rows: list[dict[str, Any]]) -> list[str]:
    """Issue 12's targets for the `sequential` rule; a list of misses (empty: all met)."""
    misses = []
    fixed10 = {r["rho"]: r["challenger_runs_per_null"] for r in rows if r["rule"] == "fixed-10"}
    for r in rows:
        if r["rule"] != "sequential":
            continue
        for key, want in TARGETS.get(r["rho"], {}).items():
            got = r["promoted"][key]
            if got is None or got < want:
                misses.append(f"rho {r['rho']}: {key} promoted {got} < {want}")
        if r["promoted"]["null+harm"] > FALSE_LIMIT:
            misses.append(f"rho {r['rho']}: nulls+harms promoted {r['promoted']['null+harm']:.4f} > {FALSE_LIMIT}")
        if r["rho"] in fixed10 and r["challenger_runs_per_null"] > RUNS_SHARE_LIMIT * fixed10[r["rho"]]:
            misses.append(f"rho {r['rho']}: {r['challenger_runs_per_null']:.2f} runs per null > "
                          f"{RUNS_SHARE_LIMIT:.0%} of fixed-10's {fixed10[r['rho']]:.2f}")
    return misses


def table(rows: list[dict[str, Any]], sigma_median: float | None) -> str:
    cols = ["h@0.5", "h@1", "h@2", "h@3", "1task", "null", "harm", "runs/null", "runs/hyp", "gain/1k", "true", "measured"]
    lines = []
    for rho in sorted({r["rho"] for r in rows}):
        lines.append(f"\nρ = {rho}  (share promoted; runs per task; gain and drift in σ units, mean over tasks)")
        lines.append(f"{'rule':<15}" + "".join(f"{c:>10}" for c in cols))
        for r in (r for r in rows if r["rho"] == rho):
            p = r["promoted"]
            vals = [p["horizontal@0.5"], p["horizontal@1"], p["horizontal@2"], p["horizontal@3"], p["one_task"], p["null"],
                    p["harm"]]
            cells = [f"{v:>10.3f}" for v in vals]
            cells += [f"{r['challenger_runs_per_null']:>10.2f}", f"{r['runs_per_hypothesis']:>10.2f}",
                      f"{r['true_gain_per_1000_runs']:>10.1f}", f"{r['drift']['true']:>10.2f}", f"{r['drift']['measured']:>10.2f}"]
            lines.append(f"{r['rule']:<15}" + "".join(cells))
    if sigma_median:
        lines.append(f"\nσ units → AUC: × the median per-task σ {sigma_median:.4f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--campaigns", type=int, default=300)
    ap.add_argument("--hypotheses", type=int, default=200)
    ap.add_argument("--rho", type=float, nargs="+", default=[0.02, 0.6])
    ap.add_argument("--noise", type=Path, default=ROOT / "benchmarks" / "results" / "headroom.json")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fresh-seeds", action="store_true", help="challengers draw fresh seed shocks (no shared seeds)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    noise = read_noise(args.noise)
    sigma = np.array(noise["sigma"], dtype=float)
    if len(sigma) < TASKS or not np.all(sigma > 0):
        raise SystemExit(f"{args.noise}: expected a positive σ for at least {TASKS} tasks")
    sigma_median = float(np.median(sigma))
    t0 = time.perf_counter()
    rows = []
    for rho in args.rho:
        for i, rule in enumerate(RULES):
            t = time.perf_counter()
            rows.append(campaign(rule, rho, args.campaigns, args.hypotheses, args.seed, sigma, i, args.fresh_seeds))
            print(f"  [{rule.name} ρ={rho}: {time.perf_counter() - t:.1f}s]", file=sys.stderr)
    misses = check(rows)
    doc = {
        "prior": [{"class": c, "share": s, "sizes": list(z)} for c, s, z in PRIOR],
        "tasks": TASKS,
        "noise": {**noise, "sigma_median": sigma_median},
        "rules": rows,
        "targets": {"per_rho": {str(k): v for k, v in TARGETS.items()}, "null+harm_max": FALSE_LIMIT,
                    "runs_per_null_max_share_of_fixed10": RUNS_SHARE_LIMIT},
        "misses": misses,
        "seconds": round(time.perf_counter() - t0, 1),
        "command": "benchmarks/loop_quality.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    if args.out:
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print("prior: " + ", ".join(f"{c} {s:.0%} {list(z)}σ" for c, s, z in PRIOR))
        print(f"noise: per-task σ from {noise['source']} (median {sigma_median:.4f}; the file's own ρ over its "
              f"{noise['seeds']} seeds: {noise['rho_measured']:.3f}); seeds "
              f"{'fresh for every rule' if args.fresh_seeds else 'per rule (block / separate / fresh)'}, "
              f"{PRETRAIN_SHARE:.0%} of hypotheses change pretraining; "
              f"{args.campaigns} campaigns × {args.hypotheses} hypotheses per rule")
        print(table(rows, sigma_median))
        print("\ntargets (sequential):", "all met" if not misses else "; ".join(misses))
    return 1 if misses else 0


if __name__ == "__main__":
    raise SystemExit(main())
