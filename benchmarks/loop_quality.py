"""The loop scored as a decision rule (issue 12): what it banks, what it wastes, what it fools itself with.

    .venv/bin/python benchmarks/loop_quality.py [--campaigns 300] [--hypotheses 200] [--rho 0.02 0.6]
        [--noise benchmarks/results/headroom.json | --noise VARIANCE.json] [--in-flight 1 4 16] [--overlap 0]
        [--json] [--out FILE]

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
- `paired`      — this product's default gate: the paired tests on seed k, the lazy baseline, looks
                  1/2/5/10, the unpaired bound from the campaign's earlier arms (its last `ARMS` arms of
                  2 seeds or more: challengers that reached look 2, baselines replaced by a promotion)
                  and its last `HISTORY` comparisons' paired differences (the futility prior);
- `paired-f0.2` — the same with `[gate] futility_p = 0.2`: fewer runs on nulls, less power at 0.5σ;
- `sequential`  — the previous default gate (10 baseline runs, looks 2/5/10, trim 0.125, `block` seeds);
- `sequential-v1` — the gate as it was before issue 12 (5 baseline runs, interquartile mean, `separate` seeds);
- `fixed-5v2`   — the seed's protocol: pooled t at nominal α, 5 baseline runs, 2 challenger runs,
                  re-tested at 5 and 10 (same verdict table and escalation);
- `fixed-10`    — pooled t at nominal α, one look at 10 runs against 10 baseline runs;
- `keep-discard` — karpathy/autoresearch: one challenger run against the current best's one measured
                  run, kept if its mean over tasks is higher; a kept run *is* the new best's measurement.

In flight (issue 22, `--in-flight K ...`, default 1 4 16): with k hypotheses measured at once, each
campaign has k slots, each measuring one hypothesis at a time at one run per time unit (a look of m
runs ends m time units after the measurement began; the lazy baseline's runs and a new champion's
re-verification take no slot time). Every step takes, in each campaign, the measurement that ends
first. A measurement is judged when it begins, through all its looks, against the baseline and with
the lab's histories of that moment (the histories move on as other hypotheses end: a simplification,
at k = 1 exact). A promote decision against a baseline that is no longer the current one is what the
product's promote node re-bases (`agent.graph.rebase`, ARCHITECTURE's data-flow step 5): the
hypothesis is measured again from its first look against the current baseline, on that baseline's seed
block, through the same gate, in the same slot (those runs count), and promoted only if that
comparison says `improvement`; its earlier looks never promote. Interaction: effects add (its true
effect against the new baseline is its own); `--overlap F` makes a share F of re-bases overlapping
ones, whose effect against the new baseline is × `OVERLAP_KEEP` (0.5). k = 1 is the sequential code
path (`campaign`); `concurrent_campaign` at k = 1 reproduces it number for number
(tests/test_loop_quality.py checks). Reported besides: re-bases per hypothesis, the share of
hypotheses re-based and of those promoted in the end, the campaign's span in one slot's run times per
hypothesis, and the gain per run over keep/discard's at the same k.

Reported per rule: the share of each class promoted (horizontal gains by size, one-task gains, nulls,
harms), runs per hypothesis (challenger runs, plus baseline runs), true improvement banked per 1000
runs, and the baseline's drift after the campaign: the true improvement of the final baseline over
the first (mean over tasks, σ units) against what the rule measured (the sum of the Δ it saw at each
promotion). Exit status 1 if the default rule (`paired`) misses a target (issue 19's, `check`), at
any number in flight.
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
Prior = tuple[tuple[str, float, tuple[float, ...]], ...]
CLASSES = ("null", "horizontal", "one_task", "harm", "one_task_harm")
PRIOR: Prior = (
    ("null", 0.70, (0.0,)),
    ("horizontal", 0.12, HORIZONTAL_SIZES),   # every task improves by the size
    ("one_task", 0.06, (1.0, 2.0, 3.0)),       # one task improves, the rest do not move
    ("harm", 0.08, (-0.5, -1.0, -2.0)),        # every task gets worse
    ("one_task_harm", 0.04, (-3.0,)),          # one task gets much worse
)
PRETRAIN_SHARE = 0.4  # hypotheses that change pretraining: their seeds' pretraining is their own
PRETRAIN_PAIR = 0.5  # ... so they pair at half the measured correlation (only the fine-tuning seed is shared;
# pessimistic: headroom.json's add_pix_source, which changes pretraining, pairs at a median 0.69)
MAX_PAIR = 0.95
HISTORY = 10  # earlier comparisons the paired rule's prior keeps (2 pairs each), per campaign
ARMS = 20  # earlier arms (2 seeds or more) the paired rule's unpaired bound keeps, per campaign
DEFAULT_RULE = "paired"
TARGET_RUNS = 2.0  # issue 19: challenger plus baseline runs per hypothesis
TARGET_GAIN_BUNDLED = 0.6  # true gain per 1000 runs, as a share of keep/discard's, under the bundled prior
TARGET_GAIN_OTHER = 1.0  # ... under any other prior (the small-effect ones of benchmarks/priors/)
TARGET_NULL = 0.01
TARGET_HARM = 0.005
TARGET_H05 = 0.80  # horizontal gains of 0.5σ promoted, at ρ 0.02
OVERLAP_KEEP = 0.5  # --overlap: a re-based hypothesis that overlaps what was promoted keeps this share of its effect


@dataclass(frozen=True)
class Rule:
    name: str
    protocol: str | None  # None: keep/discard
    baseline_runs: int
    looks: tuple[int, ...]
    trim: float = 0.125
    seeds: str = "fresh"  # block | separate | fresh (see the module docstring)
    lazy: bool = False  # the baseline's seed k is run when a challenger first reaches it
    futility_p: float = 0.30


RULES = (
    Rule("paired", "paired", 10, (1, 2, 5, 10), 0.125, "block", lazy=True),
    Rule("paired-f0.2", "paired", 10, (1, 2, 5, 10), 0.125, "block", lazy=True, futility_p=0.20),
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
    if "auc" in doc:  # benchmarks/headroom.py: tasks × seeds of the template baseline and its variants
        runs = np.array(doc["auc"]["baseline"], dtype=float)
        sigma = runs.std(axis=1, ddof=1)
        corr = np.corrcoef(runs.T, rowvar=False)
        rho = float(np.nanmean(corr[np.triu_indices(len(runs), 1)]))
        variants = [np.array(v, dtype=float) for k, v in doc["auc"].items() if k != "baseline"]
        pair = np.median([[np.corrcoef(runs[j], v[j])[0, 1] for j in range(len(runs))] for v in variants], axis=0) \
            if variants else np.zeros(len(runs))
        return {"source": str(path), "tasks": doc["tasks"], "sigma": sigma.tolist(), "rho_measured": rho,
                "seeds": int(runs.shape[1]), "pair": np.clip(pair, 0.0, MAX_PAIR).tolist()}
    tasks = doc["tasks"]  # autoresearch variance --json, or variance --pair --json
    sd = [tasks[t].get("sd", tasks[t].get("baseline_sd")) for t in tasks]
    pair = [tasks[t].get("pair_correlation") or 0.0 for t in tasks]
    return {"source": str(path), "tasks": list(tasks), "sigma": sd,
            "rho_measured": doc.get("mean_cross_task_correlation"), "seeds": doc.get("runs"),
            "pair": np.clip(np.array(pair, dtype=float), 0.0, MAX_PAIR).tolist()}


def draw_noise(rng: np.random.Generator, b: int, j: int, seeds: int, rho: float) -> np.ndarray:
    """(B, J, seeds) unit run noise with cross-task correlation ρ (a seed's shock common to every task)."""
    common = rng.standard_normal((b, 1, seeds))
    own = rng.standard_normal((b, j, seeds))
    return math.sqrt(rho) * common + math.sqrt(1 - rho) * own


def paired_noise(rng: np.random.Generator, base: np.ndarray, pair: np.ndarray, rho: float) -> np.ndarray:
    """Unit noise of a challenger's runs whose seed k correlates at `pair` (B, J) with the baseline's
    seed k (`base`, unit noise), keeping the cross-task correlation ρ."""
    fresh = draw_noise(rng, base.shape[0], base.shape[1], base.shape[2], rho)
    r = pair[..., None]
    return r * base + np.sqrt(1 - r**2) * fresh


def draw_hypotheses(rng: np.random.Generator, b: int, j: int, prior: Prior) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per campaign: class index, size (σ) and the effect vector (B, J) of one hypothesis."""
    shares = np.array([p[1] for p in prior])
    cls = rng.choice(len(prior), size=b, p=shares / shares.sum())
    size = np.array([rng.choice(prior[c][2]) for c in cls])
    effect = np.zeros((b, j))
    task = rng.integers(0, j, size=b)
    for i, c in enumerate(cls):
        name = prior[c][0]
        if name in ("horizontal", "harm"):
            effect[i] = size[i]
        elif name in ("one_task", "one_task_harm"):
            effect[i, task[i]] = size[i]
    return cls, size, effect


def _push_arms(arm_hist: np.ndarray, arm_next: np.ndarray, runs: np.ndarray, width: np.ndarray,
               keep: np.ndarray) -> None:
    """Earlier arms join the bound's history `arm_hist` (B, ARMS, J, block), a ring per campaign
    at `arm_next`: `runs` (B, J, ≥ width) of which the first `width` seeds were run, where `keep`
    (and 2 seeds or more: one seed has no spread)."""
    keep = keep & (width >= 2)
    if not keep.any():
        return
    B, _, J, block = arm_hist.shape
    cols = np.arange(block)[None, None, :] < width[:, None, None]
    padded = np.full((B, J, block), np.nan)
    padded[..., : runs.shape[-1]] = runs[..., :block]
    padded = np.where(cols, padded, np.nan)
    rows = np.flatnonzero(keep)
    arm_hist[rows, arm_next[rows] % ARMS] = padded[rows]
    arm_next[rows] += 1


def campaign(rule: Rule, rho: float, campaigns: int, hypotheses: int, seed: int, sigma: np.ndarray,
             rule_index: int = 0, fresh_seeds: bool = False, pair: np.ndarray | None = None,
             prior: Prior = PRIOR) -> dict[str, Any]:
    """Run `campaigns` independent campaigns of `hypotheses` each through one rule, vectorised over campaigns."""
    from agent.graph import allowed_decisions

    population = np.random.default_rng([seed, 1])  # the same hypotheses for every rule
    rng = np.random.default_rng([seed, 2, rule_index])  # this rule's noise
    B, J = campaigns, TASKS
    sigma = np.asarray(sigma, dtype=float)[:J]
    pair = np.zeros(J) if pair is None else np.asarray(pair, dtype=float)[:J]
    unit = float(np.median(sigma))  # results in σ units: over the median σ
    seeds = "fresh" if fresh_seeds else rule.seeds
    block = max(rule.looks[-1], rule.baseline_runs)
    mu = np.zeros((B, J))  # the current baseline's true level (metric units)
    base_u = draw_noise(rng, B, J, block, rho)  # the current baseline's seed block (unit noise)
    depth = np.zeros(B, int)  # lazy: the baseline seeds run so far
    runs_chal = np.zeros(B)
    runs_base = np.zeros(B) if rule.lazy else np.full(B, float(rule.baseline_runs))
    pair_hist = np.full((B, J, HISTORY, 2), np.nan)  # the lab's latest paired differences (the paired prior)
    arm_hist = np.full((B, ARMS, J, block), np.nan)  # earlier arms' runs (the paired rule's unpaired bound)
    arm_next = np.zeros(B, int)

    def push_arms(runs: np.ndarray, width: np.ndarray, keep: np.ndarray) -> None:
        _push_arms(arm_hist, arm_next, runs, width, keep)
    measured = np.zeros(B)  # Σ of the Δ the rule saw at its promotions (mean over tasks)
    best_seen = (base_u[..., :1] * sigma[None, :, None]).mean(axis=(1, 2))  # keep/discard: the best's one run
    counts: dict[str, list[int]] = {}  # key → [hypotheses, promoted]
    runs_by_class: dict[str, float] = {}
    improvement_code = CODE[Verdict.improvement]
    looks = np.asarray(rule.looks)

    for h in range(hypotheses):
        cls, size, effect = draw_hypotheses(population, B, J, prior)
        own_pretraining = population.random(B) < PRETRAIN_SHARE
        effect = effect * sigma[None, :]
        if seeds == "block":  # seed k shared with the baseline: pretraining (unless changed) and fine-tuning
            r = np.where(own_pretraining[:, None], PRETRAIN_PAIR * pair[None, :], pair[None, :])
            chal_u = paired_noise(rng, base_u[..., : rule.looks[-1]], r, rho)
        else:
            chal_u = draw_noise(rng, B, J, rule.looks[-1], rho)
        chal = mu[..., None] + effect[..., None] + sigma[None, :, None] * chal_u
        base = mu[..., None] + sigma[None, :, None] * base_u
        if rule.protocol is None:  # keep/discard: one run, one number, no test
            value = (chal[..., 0] / sigma).mean(axis=1)
            promote = value > best_seen
            spent = np.ones(B)
            seen = value - best_seen
        else:
            path = look_path(rule.protocol, base if rule.lazy else base[..., : rule.baseline_runs], chal, rule.looks,
                             horizontal_trim=rule.trim, futility_p=rule.futility_p,
                             pair_history=pair_hist if rule.lazy else None, base_depth=depth if rule.lazy else None,
                             arm_history=arm_hist if rule.lazy else None)
            code, k_stop = path.first_stop()
            held = path.held[np.arange(B), k_stop]
            promote = np.array([
                allowed_decisions(ORDER[c].value, rule.looks[k], list(rule.looks), supervised=False)[0] == "promote"
                for c, k in zip(code, k_stop)
            ]) & ~held
            assert np.array_equal(promote, (code == improvement_code) & ~held)
            spent = looks[k_stop].astype(float)
            seen = (path.task_delta[np.arange(B), k_stop] / sigma).mean(axis=1)
            if rule.lazy:
                grown = np.maximum(depth, np.maximum(looks[k_stop], 2))
                runs_base += grown - depth
                depth = grown
                d = chal[..., :2] - base[..., :2]  # this comparison's first pairs join the history
                d = np.where((looks[k_stop] >= 2)[:, None, None], d, np.nan)
                pair_hist[:, :, h % HISTORY] = np.where(np.isfinite(d), d, pair_hist[:, :, h % HISTORY])
                push_arms(chal, looks[k_stop], np.ones(B, bool))
        runs_chal += spent
        for i in range(B):
            name = prior[cls[i]][0]
            key = f"{name}@{size[i]:g}"
            c = counts.setdefault(key, [0, 0])
            c[0] += 1
            c[1] += int(promote[i])
            runs_by_class[name] = runs_by_class.get(name, 0.0) + spent[i]
        measured += np.where(promote, seen, 0.0)
        mu = np.where(promote[:, None], mu + effect, mu)
        if rule.protocol is None:
            best_seen = np.where(promote, value, best_seen)
        elif promote.any():  # the new baseline's runs on a new seed block
            if rule.lazy:  # the old baseline's runs join the bound's history
                push_arms(base, depth, promote)
            base_u = np.where(promote[:, None, None], draw_noise(rng, B, J, block, rho), base_u)
            if rule.lazy:  # its re-verification is its first look's seeds, its challengers' first baseline runs
                first = max(rule.looks[0], 2)
                runs_base += promote * first
                depth = np.where(promote, first, depth)
            else:
                runs_base += promote * rule.baseline_runs

    return summary(rule, rho, campaigns, hypotheses, seeds, unit, prior, counts, runs_by_class, sigma, mu,
                   runs_chal, runs_base, measured,
                   {"in_flight": 1, "overlap": 0.0, "rebases_per_hypothesis": 0.0, "rebased_share": 0.0,
                    "rebased_promoted": None, "span_per_hypothesis": float(runs_chal.mean() / hypotheses)})


def concurrent_campaign(rule: Rule, rho: float, campaigns: int, hypotheses: int, seed: int, sigma: np.ndarray,
                        rule_index: int = 0, fresh_seeds: bool = False, pair: np.ndarray | None = None,
                        prior: Prior = PRIOR, in_flight: int = 1, overlap: float = 0.0,
                        trace: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """`campaign` with `in_flight` hypotheses measured at once in each campaign (issue 22).

    Each campaign has `in_flight` slots; a slot measures one hypothesis at a time, a run per time unit
    (the lazy baseline's runs and a champion's re-verification take no slot time). A measurement is
    judged through its looks when it starts (`look_path` against the baseline of that moment, with
    the lab's histories of that moment), so it ends `looks[stop]` time units later; each step takes,
    in every campaign at once, the measurement that ends first (ties: the lower slot). At its end it
    is decided as `campaign` decides; a promote decision against a baseline that has moved since it
    started is a re-base: measured again from its first look against the current baseline, on that
    baseline's seed block, in the same slot (those runs count), and promoted only on that comparison. Effects
    add: its true effect against the new baseline is its own; with `overlap` > 0 that share of
    re-bases halves it (`OVERLAP_KEEP`: its change overlaps what was promoted meanwhile).

    The same hypotheses in the same order as `campaign` (campaign b's i-th hypothesis is the i-th
    draw's row b) and the same noise stream, drawn in the same order when `in_flight` is 1: the
    result is then `campaign`'s, number for number. `trace`, if a list, gets one dict per
    measurement's end: campaign, hypothesis, its base generation and the current one, the decision.
    """
    from agent.graph import allowed_decisions

    population = np.random.default_rng([seed, 1])
    rng = np.random.default_rng([seed, 2, rule_index])
    coin = np.random.default_rng([seed, 3, rule_index])  # overlapping re-bases (drawn only if overlap > 0)
    B, J, H, S = campaigns, TASKS, hypotheses, max(int(in_flight), 1)
    sigma = np.asarray(sigma, dtype=float)[:J]
    pair = np.zeros(J) if pair is None else np.asarray(pair, dtype=float)[:J]
    unit = float(np.median(sigma))
    seeds = "fresh" if fresh_seeds else rule.seeds
    block = max(rule.looks[-1], rule.baseline_runs)
    last = rule.looks[-1]
    rows = np.arange(B)
    hyp_cls, hyp_size = np.zeros((H, B), int), np.zeros((H, B))
    hyp_effect, hyp_own = np.zeros((H, B, J)), np.zeros((H, B), bool)
    for i in range(H):  # the population, in campaign's order of draws
        cls, size, effect = draw_hypotheses(population, B, J, prior)
        hyp_own[i] = population.random(B) < PRETRAIN_SHARE
        hyp_cls[i], hyp_size[i], hyp_effect[i] = cls, size, effect * sigma[None, :]

    mu = np.zeros((B, J))
    base_u = draw_noise(rng, B, J, block, rho)
    gen = np.zeros(B, int)  # the current baseline's generation (promotions so far)
    gen_depth = np.zeros((B, H + 2), int)  # lazy: the seeds run so far of each generation's baseline
    runs_chal = np.zeros(B)
    runs_base = np.zeros(B) if rule.lazy else np.full(B, float(rule.baseline_runs))
    pair_hist = np.full((B, J, HISTORY, 2), np.nan)
    arm_hist = np.full((B, ARMS, J, block), np.nan)
    arm_next = np.zeros(B, int)
    ended = np.zeros(B, int)  # measurements ended so far (the paired history's ring index)

    def push_arms(runs: np.ndarray, width: np.ndarray, keep: np.ndarray) -> None:
        _push_arms(arm_hist, arm_next, runs, width, keep)
    measured = np.zeros(B)
    best_seen = (base_u[..., :1] * sigma[None, :, None]).mean(axis=(1, 2))
    counts: dict[str, list[int]] = {}
    runs_by_class: dict[str, float] = {}
    improvement_code = CODE[Verdict.improvement]
    looks = np.asarray(rule.looks)
    # the slots: what each is measuring, against which baseline, and how that measurement ends
    s_hyp = np.full((B, S), -1)
    s_gen = np.zeros((B, S), int)
    s_end = np.full((B, S), np.inf)
    s_promote = np.zeros((B, S), bool)
    s_spent = np.zeros((B, S), int)
    s_seen, s_value = np.zeros((B, S)), np.zeros((B, S))
    s_effect = np.zeros((B, S, J))  # its true effect against the baseline it is measured against
    s_chal, s_base = np.zeros((B, S, J, last)), np.zeros((B, S, J, block))
    rebased = np.zeros((B, H), int)  # re-bases per hypothesis
    banked = np.zeros((B, H), bool)  # promoted in the end
    next_h = np.zeros(B, int)

    def start(go: np.ndarray, slot: np.ndarray, idx: np.ndarray, effect: np.ndarray, t0: np.ndarray) -> None:
        """Measure hypothesis `idx` (with true effect `effect` against the current baseline) in `slot`
        from `t0`, where `go`: its noise and its whole look path, drawn and judged now."""
        if not go.any():
            return
        own = hyp_own[np.minimum(idx, H - 1), rows]
        if seeds == "block":
            r = np.where(own[:, None], PRETRAIN_PAIR * pair[None, :], pair[None, :])
            chal_u = paired_noise(rng, base_u[..., :last], r, rho)
        else:
            chal_u = draw_noise(rng, B, J, last, rho)
        chal = mu[..., None] + effect[..., None] + sigma[None, :, None] * chal_u
        base = mu[..., None] + sigma[None, :, None] * base_u
        value = np.zeros(B)
        if rule.protocol is None:
            value = (chal[..., 0] / sigma).mean(axis=1)
            promote = value > best_seen
            spent = np.ones(B, int)
            seen = value - best_seen
        else:
            depth = gen_depth[rows, gen]
            path = look_path(rule.protocol, base if rule.lazy else base[..., : rule.baseline_runs], chal, rule.looks,
                             horizontal_trim=rule.trim, futility_p=rule.futility_p,
                             pair_history=pair_hist if rule.lazy else None, base_depth=depth if rule.lazy else None,
                             arm_history=arm_hist if rule.lazy else None)
            code, k_stop = path.first_stop()
            held = path.held[rows, k_stop]
            promote = np.array([
                bool(g) and allowed_decisions(ORDER[c].value, rule.looks[k], list(rule.looks), supervised=False)[0]
                == "promote" for c, k, g in zip(code, k_stop, go)
            ]) & ~held
            assert np.array_equal(promote, (code == improvement_code) & ~held & go)
            spent = looks[k_stop]
            seen = (path.task_delta[rows, k_stop] / sigma).mean(axis=1)
        at = np.flatnonzero(go)
        sl = slot[at]
        s_hyp[at, sl], s_gen[at, sl], s_end[at, sl] = idx[at], gen[at], t0[at] + spent[at]
        s_promote[at, sl], s_spent[at, sl] = promote[at], spent[at]
        s_seen[at, sl], s_value[at, sl] = seen[at], value[at]
        s_effect[at, sl], s_chal[at, sl], s_base[at, sl] = effect[at], chal[at], base[at]

    for slot in range(min(S, H)):  # the first `in_flight` hypotheses start at once
        go = next_h < H
        start(go, np.full(B, slot), next_h, hyp_effect[np.minimum(next_h, H - 1), rows], np.zeros(B))
        next_h += go

    span = np.zeros(B)
    while True:
        s = np.argmin(s_end, axis=1)
        now = s_end[rows, s]
        on = np.isfinite(now)
        if not on.any():
            break
        span = np.where(on, now, span)
        h_idx, g = s_hyp[rows, s], s_gen[rows, s]
        spent = np.where(on, s_spent[rows, s], 0)
        runs_chal += spent
        chal, base = s_chal[rows, s], s_base[rows, s]
        if rule.protocol is not None and rule.lazy:
            d0 = gen_depth[rows, g]
            grown = np.where(on, np.maximum(d0, np.maximum(spent, 2)), d0)
            runs_base += grown - d0
            gen_depth[rows, g] = grown
            d = chal[..., :2] - base[..., :2]  # this comparison's first pairs join the history
            d = np.where(((spent >= 2) & on)[:, None, None], d, np.nan)
            col = ended % HISTORY
            pair_hist[rows, :, col] = np.where(np.isfinite(d), d, pair_hist[rows, :, col])
            push_arms(chal, spent, on)
        ended += on
        wants = on & s_promote[rows, s]
        stale = wants & (g != gen)  # its base moved while it was measured: re-based, not promoted
        promote = wants & ~stale
        final = on & ~stale
        for i in np.flatnonzero(on):
            name = prior[hyp_cls[h_idx[i], i]][0]
            runs_by_class[name] = runs_by_class.get(name, 0.0) + spent[i]
            if final[i]:
                banked[i, h_idx[i]] = promote[i]
                c = counts.setdefault(f"{name}@{hyp_size[h_idx[i], i]:g}", [0, 0])
                c[0] += 1
                c[1] += int(promote[i])
            if trace is not None:
                trace.append({"campaign": int(i), "hypothesis": int(h_idx[i]), "slot": int(s[i]),
                              "ended": float(now[i]), "runs": int(spent[i]), "base_generation": int(g[i]),
                              "generation": int(gen[i]), "rebases": int(rebased[i, h_idx[i]]),
                              "effect": float((s_effect[i, s[i]] / sigma).mean()),
                              "decision": "rebase" if stale[i] else "promote" if promote[i] else "stop"})
        measured += np.where(promote, s_seen[rows, s], 0.0)
        effect = s_effect[rows, s]
        mu = np.where(promote[:, None], mu + effect, mu)
        if rule.protocol is None:
            best_seen = np.where(promote, s_value[rows, s], best_seen)
        elif promote.any():
            if rule.lazy:
                push_arms(base, gen_depth[rows, g], promote)
            base_u = np.where(promote[:, None, None], draw_noise(rng, B, J, block, rho), base_u)
            if rule.lazy:
                first = max(rule.looks[0], 2)
                runs_base += promote * first
                gen_depth[rows[promote], gen[promote] + 1] = first
            else:
                runs_base += promote * rule.baseline_runs
        gen = gen + promote
        # the slot's next measurement: the re-based hypothesis again, or the campaign's next one
        if stale.any():
            rebased[rows[stale], h_idx[stale]] += 1
            if overlap > 0:
                shrink = stale & (coin.random(B) < overlap)
                effect = np.where(shrink[:, None], OVERLAP_KEEP * effect, effect)
        fresh = final & (next_h < H)
        go = stale | fresh
        s_end[rows[on & ~go], s[on & ~go]] = np.inf
        s_hyp[rows[on & ~go], s[on & ~go]] = -1
        idx = np.where(stale, h_idx, next_h)
        start(go, s, idx, np.where(stale[:, None], effect, hyp_effect[np.minimum(next_h, H - 1), rows]), now)
        next_h += fresh

    ever = rebased > 0
    extra = {"in_flight": S, "overlap": overlap, "rebases_per_hypothesis": float(rebased.sum() / (B * H)),
             "rebased_share": float(ever.mean()),
             "rebased_promoted": float(banked[ever].mean()) if ever.any() else None,  # of the re-based ones
             "span_per_hypothesis": float(span.mean() / H)}
    return summary(rule, rho, campaigns, hypotheses, seeds, unit, prior, counts, runs_by_class, sigma, mu,
                   runs_chal, runs_base, measured, extra)


def summary(rule: Rule, rho: float, campaigns: int, hypotheses: int, seeds: str, unit: float, prior: Prior,
            counts: dict[str, list[int]], runs_by_class: dict[str, float], sigma: np.ndarray, mu: np.ndarray,
            runs_chal: np.ndarray, runs_base: np.ndarray, measured: np.ndarray,
            extra: dict[str, Any]) -> dict[str, Any]:
    """A rule's row: shares promoted by class, runs, gain per run and drift (`extra` joins it)."""

    def rate(pred: Any) -> float | None:
        n = sum(v[0] for k, v in counts.items() if pred(k))
        p = sum(v[1] for k, v in counts.items() if pred(k))
        return p / n if n else None

    def cls_of(key: str) -> str:
        return key.split("@")[0]

    def size_of(key: str) -> float:
        return float(key.split("@")[1])

    sizes = sorted({size_of(k) for k in counts if cls_of(k) == "horizontal"})
    hyp_by_class = {name: sum(v[0] for k, v in counts.items() if cls_of(k) == name) for name, _, _ in prior}
    true_gain = (mu / sigma).mean(axis=1)  # the final baseline's true improvement over the first, σ units
    total_runs = runs_chal + runs_base
    out: dict[str, Any] = {
        "rule": rule.name,
        "protocol": rule.protocol or "keep/discard",
        "baseline_runs": rule.baseline_runs,
        "lazy_baseline": rule.lazy,
        "looks": list(rule.looks),
        "futility_p": rule.futility_p if rule.protocol else None,
        "trim": rule.trim if rule.protocol else None,
        "rho": rho,
        "seeds": seeds,
        "sigma_unit": unit,
        "campaigns": campaigns,
        "hypotheses": hypotheses,
        "promoted": {
            **{f"horizontal@{g:g}": rate(lambda k, g=g: cls_of(k) == "horizontal" and size_of(k) == g)
               for g in sizes},
            "horizontal>=1": rate(lambda k: cls_of(k) == "horizontal" and size_of(k) >= 1),
            "one_task": rate(lambda k: cls_of(k) == "one_task"),
            "null": rate(lambda k: cls_of(k) == "null"),
            "harm": rate(lambda k: cls_of(k) in ("harm", "one_task_harm")),
            "null+harm": rate(lambda k: cls_of(k) in ("null", "harm", "one_task_harm")),
        },
        "challenger_runs_per_null": runs_by_class.get("null", 0.0) / max(hyp_by_class.get("null", 0), 1),
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
        **extra,
    }
    return out


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 19's targets for the default rule (`paired`), per (prior, ρ, in flight): each target's
    value, bound and whether it is met. The gain is judged against keep/discard's at the same number
    in flight (else at 1; not judged without a keep/discard row)."""
    keep = {(r["prior"], r["rho"], r.get("in_flight", 1)): r["true_gain_per_1000_runs"]
            for r in rows if r["rule"] == "keep-discard"}
    out = []
    for r in rows:
        if r["rule"] != DEFAULT_RULE:
            continue
        k = r.get("in_flight", 1)
        got: dict[str, Any] = {"prior": r["prior"], "rho": r["rho"], "in_flight": k}
        got["null"] = {"value": r["promoted"]["null"] or 0, "max": TARGET_NULL}
        got["harm"] = {"value": r["promoted"]["harm"] or 0, "max": TARGET_HARM}
        got["runs_per_hypothesis"] = {"value": r["runs_per_hypothesis"], "max": TARGET_RUNS}
        kd = keep.get((r["prior"], r["rho"], k), keep.get((r["prior"], r["rho"], 1)))
        if kd is not None:
            share = TARGET_GAIN_BUNDLED if r["prior"] == "bundled" else TARGET_GAIN_OTHER
            got["gain_per_1000_runs"] = {"value": r["true_gain_per_1000_runs"], "min": share * kd,
                                         "keep_discard": kd, "ratio": r["true_gain_per_1000_runs"] / kd if kd else None}
        if r["prior"] == "bundled" and r["rho"] == 0.02:
            got["horizontal@0.5"] = {"value": r["promoted"].get("horizontal@0.5"), "min": TARGET_H05}
        for t in got.values():
            if isinstance(t, dict):
                t["met"] = t["value"] is not None and t["value"] <= t.get("max", math.inf) and t["value"] >= t.get(
                    "min", -math.inf)
        out.append(got)
    return out


def check(rows: list[dict[str, Any]]) -> list[str]:
    """Issue 19's targets for the default rule (`paired`); a list of misses (empty: all met)."""
    misses = []
    for t in targets(rows):
        where = f"prior {t['prior']}, rho {t['rho']}" + (f", {t['in_flight']} in flight" if t["in_flight"] != 1 else "")
        if not t["runs_per_hypothesis"]["met"]:
            misses.append(f"{where}: {t['runs_per_hypothesis']['value']:.2f} runs per hypothesis > {TARGET_RUNS}")
        g = t.get("gain_per_1000_runs")
        if g is not None and not g["met"]:
            misses.append(f"{where}: gain/1k {g['value']:.1f} < {g['min']:.1f}")
        if not t["null"]["met"]:
            misses.append(f"{where}: nulls promoted {t['null']['value']:.4f} > {TARGET_NULL}")
        if not t["harm"]["met"]:
            misses.append(f"{where}: harms promoted {t['harm']['value']:.4f} > {TARGET_HARM}")
        h05 = t.get("horizontal@0.5")
        if h05 is not None and not h05["met"]:
            misses.append(f"{where}: horizontal@0.5 promoted {h05['value']} < {TARGET_H05}")
    return misses


def target_lines(rows: list[dict[str, Any]]) -> str:
    """One line per default-rule row: each target, its value and whether it is met."""
    lines = []
    for t in targets(rows):
        cells = [f"nulls {t['null']['value']:.4f} (≤ {TARGET_NULL}) {'met' if t['null']['met'] else 'MISSED'}",
                 f"harms {t['harm']['value']:.4f} (≤ {TARGET_HARM}) {'met' if t['harm']['met'] else 'MISSED'}",
                 f"runs/hyp {t['runs_per_hypothesis']['value']:.2f} (≤ {TARGET_RUNS}) "
                 f"{'met' if t['runs_per_hypothesis']['met'] else 'MISSED'}"]
        g = t.get("gain_per_1000_runs")
        if g is not None:
            cells.append(f"gain/1k {g['value']:.1f} = {g['ratio']:.2f} × keep/discard's {g['keep_discard']:.1f} "
                         f"(≥ {g['min'] / g['keep_discard'] if g['keep_discard'] else 0:.1f} ×) "
                         f"{'met' if g['met'] else 'MISSED'}")
        h05 = t.get("horizontal@0.5")
        if h05 is not None:
            cells.append(f"h@0.5 {h05['value']:.3f} (≥ {TARGET_H05}) {'met' if h05['met'] else 'MISSED'}")
        lines.append(f"  prior {t['prior']}, ρ {t['rho']}, {t['in_flight']:>2} in flight: " + "; ".join(cells))
    return "\n".join(lines)


def table(rows: list[dict[str, Any]], sigma_median: float | None) -> str:
    lines = []
    many = any(r.get("in_flight", 1) != 1 for r in rows)  # concurrency: its columns, and k in the rule's name
    width = 20 if many else 15
    for prior in dict.fromkeys(r["prior"] for r in rows):
        for rho in sorted({r["rho"] for r in rows if r["prior"] == prior}):
            group = [r for r in rows if r["prior"] == prior and r["rho"] == rho]
            keep = {r.get("in_flight", 1): r["true_gain_per_1000_runs"] for r in group if r["rule"] == "keep-discard"}
            sizes = [k for k in group[0]["promoted"] if k.startswith("horizontal@")]
            cols = [k.replace("horizontal", "h") for k in sizes] + ["1task", "null", "harm", "runs/null", "chal/hyp",
                                                                      "base/hyp", "runs/hyp", "gain/1k", "true", "measured"]
            if many:
                cols += [" rebase/hyp", "rebased", "reb→prom", "span/hyp", "gain÷kd"]
            lines.append(f"\nprior {prior}, ρ = {rho}  (share promoted; runs per task; gain and drift in σ units, "
                         "mean over tasks)")
            lines.append(f"{'rule':<{width}}" + "".join(f"{c:>10}" for c in cols))
            for r in group:
                p = r["promoted"]
                vals = [p[k] for k in sizes] + [p["one_task"], p["null"], p["harm"]]
                cells = [f"{v:>10.3f}" if v is not None else f"{'—':>10}" for v in vals]
                cells += [f"{r['challenger_runs_per_null']:>10.2f}", f"{r['challenger_runs_per_hypothesis']:>10.2f}",
                          f"{r['baseline_runs_per_hypothesis']:>10.2f}", f"{r['runs_per_hypothesis']:>10.2f}",
                          f"{r['true_gain_per_1000_runs']:>10.1f}", f"{r['drift']['true']:>10.2f}",
                          f"{r['drift']['measured']:>10.2f}"]
                name = r["rule"]
                if many:
                    k = r.get("in_flight", 1)
                    kd = keep.get(k)
                    name = f"{name} k={k}"
                    rp = r.get("rebased_promoted")
                    cells += [f"{r.get('rebases_per_hypothesis', 0.0):>10.3f}", f"{r.get('rebased_share', 0.0):>10.3f}",
                              f"{rp:>10.3f}" if rp is not None else f"{'—':>10}",
                              f"{r['span_per_hypothesis']:>10.2f}",
                              f"{r['true_gain_per_1000_runs'] / kd:>10.2f}" if kd else f"{'—':>10}"]
                lines.append(f"{name:<{width}}" + "".join(cells))
    if many:
        lines.append("\nrebase/hyp: re-bases per hypothesis; rebased: share of hypotheses re-based at least once; "
                     "reb→prom: share of those promoted in the end; span/hyp: the campaign's length in run times "
                     "of one slot, per hypothesis; gain÷kd: gain/1k over keep/discard's at the same k")
    if sigma_median:
        lines.append(f"\nσ units → AUC: × the median per-task σ {sigma_median:.4f}")
    return "\n".join(lines)


def read_prior(path: Path) -> Prior:
    """A prior file: a JSON list of {"class", "share", "sizes"} with the classes of `CLASSES`."""
    try:
        doc = json.loads(path.read_text())
        prior = tuple((str(c["class"]), float(c["share"]), tuple(float(x) for x in c["sizes"])) for c in doc)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"{path}: expected a JSON list of {{\"class\", \"share\", \"sizes\"}} ({e})") from None
    bad = [c for c, _, _ in prior if c not in CLASSES]
    if bad or not prior or any(sh <= 0 or not z for _, sh, z in prior):
        raise SystemExit(f"{path}: classes must be among {', '.join(CLASSES)}, shares positive, sizes non-empty")
    return prior


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--campaigns", type=int, default=300)
    ap.add_argument("--hypotheses", type=int, default=200)
    ap.add_argument("--rho", type=float, nargs="+", default=[0.02, 0.6])
    ap.add_argument("--noise", type=Path, default=ROOT / "benchmarks" / "results" / "headroom.json",
                    help="per-task σ and pair correlation: headroom.json, or `autoresearch variance --pair REV --json`")
    ap.add_argument("--prior", type=Path, nargs="+", default=[],
                    help="prior files (benchmarks/priors/*.json), scored beside the bundled prior")
    ap.add_argument("--rules", nargs="+", default=None, help=f"rules to score (default all: "
                                                              f"{', '.join(r.name for r in RULES)})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fresh-seeds", action="store_true", help="challengers draw fresh seed shocks (no shared seeds)")
    ap.add_argument("--in-flight", type=int, nargs="+", default=[1, 4, 16], metavar="K",
                    help="hypotheses measured at once per campaign (1: one after another; more: re-bases)")
    ap.add_argument("--overlap", type=float, default=0.0, metavar="F",
                    help=f"share of re-bases whose effect against the new baseline is × {OVERLAP_KEEP} (default 0: "
                         "effects add)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    if any(k < 1 for k in args.in_flight) or not 0 <= args.overlap <= 1:
        raise SystemExit("--in-flight: expected 1 or more; --overlap: expected a share in [0, 1]")
    noise = read_noise(args.noise)
    sigma = np.array(noise["sigma"], dtype=float)
    if len(sigma) < TASKS or not np.all(sigma > 0):
        raise SystemExit(f"{args.noise}: expected a positive σ for at least {TASKS} tasks")
    pair = np.array(noise.get("pair") or [0.0] * len(sigma), dtype=float)
    sigma_median = float(np.median(sigma))
    priors: dict[str, Prior] = {"bundled": PRIOR, **{p.stem: read_prior(p) for p in args.prior}}
    rules = [r for r in RULES if args.rules is None or r.name in args.rules]
    t0 = time.perf_counter()
    rows = []
    for pname, prior in priors.items():
        for rho in args.rho:
            for rule in rules:
                for k in args.in_flight:
                    t = time.perf_counter()
                    if k == 1:  # one after another: the sequential code path itself
                        row = campaign(rule, rho, args.campaigns, args.hypotheses, args.seed, sigma, RULES.index(rule),
                                       args.fresh_seeds, pair, prior)
                    else:
                        row = concurrent_campaign(rule, rho, args.campaigns, args.hypotheses, args.seed, sigma,
                                                  RULES.index(rule), args.fresh_seeds, pair, prior, k, args.overlap)
                    rows.append({"prior": pname, **row})
                    print(f"  [{pname} {rule.name} ρ={rho} k={k}: {time.perf_counter() - t:.1f}s]", file=sys.stderr)
    misses = check(rows) if any(r.name == "keep-discard" for r in rules) else []
    doc = {
        "priors": {k: [{"class": c, "share": s, "sizes": list(z)} for c, s, z in v] for k, v in priors.items()},
        "tasks": TASKS,
        "noise": {**noise, "sigma_median": sigma_median},
        "rules": rows,
        "targets": {"rule": DEFAULT_RULE, "runs_per_hypothesis_max": TARGET_RUNS,
                    "gain_vs_keep_discard_bundled": TARGET_GAIN_BUNDLED, "gain_vs_keep_discard_other": TARGET_GAIN_OTHER,
                    "null_max": TARGET_NULL, "harm_max": TARGET_HARM, "horizontal@0.5_min_rho_0.02": TARGET_H05},
        "in_flight": args.in_flight,
        "overlap": args.overlap,
        "overlap_keep": OVERLAP_KEEP,
        "target_rows": targets(rows) if any(r.name == "keep-discard" for r in rules) else [],
        "misses": misses,
        "seconds": round(time.perf_counter() - t0, 1),
        "command": "benchmarks/loop_quality.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    if args.out:
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        for pname, prior in priors.items():
            print(f"prior {pname}: " + ", ".join(f"{c} {s:.0%} {list(z)}σ" for c, s, z in prior))
        print(f"noise: per-task σ from {noise['source']} (median {sigma_median:.4f}; the file's own ρ over its "
              f"{noise['seeds']} seeds: {noise['rho_measured']:.3f}); pair correlation of seed k per task "
              f"{', '.join(f'{x:.2f}' for x in pair[:TASKS])} (hypotheses that change pretraining, "
              f"{PRETRAIN_SHARE:.0%}: × {PRETRAIN_PAIR}); seeds "
              f"{'fresh for every rule' if args.fresh_seeds else 'per rule (block / separate / fresh)'}; "
              f"{args.campaigns} campaigns × {args.hypotheses} hypotheses per rule")
        if args.in_flight != [1]:
            print(f"in flight per campaign: {', '.join(map(str, args.in_flight))} (a re-based hypothesis is measured "
                  "again from its first look against the current baseline; effects add" +
                  (f"; {args.overlap:.0%} of re-bases keep × {OVERLAP_KEEP} of their effect)" if args.overlap else ")"))
        print(table(rows, sigma_median))
        if args.in_flight != [1] and any(r.name == "keep-discard" for r in rules):
            print(f"\ntargets of {DEFAULT_RULE}, per row:\n" + target_lines(rows))
        print(f"\ntargets ({DEFAULT_RULE}):", "all met" if not misses else "; ".join(misses))
    return 1 if misses else 0


if __name__ == "__main__":
    raise SystemExit(main())
