"""The loop scored as a decision rule (issue 12): what it banks, what it wastes, what it fools itself with.

    .venv/bin/python benchmarks/loop_quality.py [--campaigns 300] [--hypotheses 200] [--rho 0.02 0.6]
        [--noise benchmarks/results/headroom.json | --noise VARIANCE.json] [--in-flight 1 4 16] [--overlap 0]
        [--rules RULE ...] [--fdp [--picture FILE.png]] [--json] [--out FILE]

One population of hypotheses is drawn from a stated prior (`PRIOR` below: mostly no effect, gains of
0.5-3σ on every task or on one, some harms) and run, one campaign of `--hypotheses` after another,
through whole decision rules. Every rule but keep/discard (and the peers' of `--fdp`) is judged by the real gate code
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
                  1/2/5/10, α 0.01, futility p 0.20 (issue 34), the unpaired bound from the campaign's
                  earlier arms (its last `ARMS` arms of 2 seeds or more: challengers that reached look 2,
                  baselines replaced by a promotion) and its last `HISTORY` comparisons' paired
                  differences (the futility prior);
- `paired-0.025` — the same at the paired gate's earlier defaults, `[gate] alpha = 0.025` and `futility_p
                  = 0.3`: more power at 0.5σ, more runs on nulls and more false discoveries;
- `sequential`  — the previous default gate (10 baseline runs, looks 2/5/10, trim 0.125, `block` seeds);
- `sequential-v1` — the gate as it was before issue 12 (5 baseline runs, interquartile mean, `separate` seeds);
- `fixed-5v2`   — the seed's protocol: pooled t at nominal α, 5 baseline runs, 2 challenger runs,
                  re-tested at 5 and 10 (same verdict table and escalation);
- `fixed-10`    — pooled t at nominal α, one look at 10 runs against 10 baseline runs;
- `keep-discard` — karpathy/autoresearch: one challenger run against the current best's one measured
                  run, kept if its mean over tasks is higher; a kept run *is* the new best's measurement;
- `paired-lond`, `paired-0.025-lond` — opt-in (`--rules`, in flight 1 only): `paired` and `paired-0.025`
                  under `[gate] online_fdr = "lond"` (pipeline/gate/online_fdr.py). Each campaign is one
                  lab's stream: its i-th hypothesis is its i-th comparison, run through the whole gate
                  (every boundary, the p-values) at α_i = lond_alpha(i, D, `LOND_FDR`, α), D its
                  comparisons whose gate said `improvement` before (`judge`: one `look_path` per distinct
                  α). On their base rule's noise stream (common random numbers). Their boundaries are
                  calibrated by `fast_paired_boundaries`, the product's calibration on the same null
                  paths, bit for bit, without re-drawing the paths for every α.

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
promotion), and the false-discovery proportion (FDP: promoted nulls, harms and one-task harms ÷ all
promotions, pooled over campaigns; None where nothing was promoted). Exit status 1 if the default rule
(`paired`) misses a target (issue 19's, `check`), at any number in flight.

False discoveries against the rules other loops use (issue 34, `--fdp`, in flight 1): the peers'
rules as they are used (`PEERS`: keep/discard with a noise floor, karpathy/autoresearch#560;
rerun-if-promising, #218; autocrucible's median of 3; senpai's 7 baseline seeds against one
challenger run), each at every threshold of `PEER_THRESHOLDS` (× σ_floor, the sd of one run's mean
over tasks, given them exactly: generous), on fresh seeds (`peer_campaign`). Per (prior, ρ): every
rule's runs per hypothesis, gain per 1000 runs, FDP and power at 0.25/0.5/1/2σ; each peer's threshold as
its users state it and its variant with the most gain at FDP ≤ 5 % (tuned on the same prior, the most
favourable to the peer); the default rule against issue 34's targets (FDP ≤ 5 %, gain ≥ that best
peer's: misses join the exit status); and its gap to benchmarks/oracle_bound.py's known-variance
oracle at the same FDP (the oracle's most gain over `ORACLE_LOOKS` × shapes × `ORACLE_FUTILITY` ×
`ORACLE_ALPHAS` among designs whose FDP is at most the default rule's; its FDP is set by α only
through this grid, so "the same FDP" is "at most", and the gap is reported, not judged).
`--picture` draws gain per 1000 runs against FDP, one point per rule and variant, one panel per
(prior, ρ): benchmarks/results/loop_quality_fdp.png.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
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

from pipeline.gate.online_fdr import lond_alpha, lord_alpha  # noqa: E402
from pipeline.gate.sim import LookPath, look_path  # noqa: E402
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
FALSE_CLASSES = ("null", "harm", "one_task_harm")  # a promotion of these is a false discovery (FDP's numerator)
TARGET_FDP = 0.05  # issue 34: the default rule's false-discovery proportion, and the peers' it is judged against
# the peers' thresholds, × σ_floor (the sd of one run's mean over tasks)
PEER_THRESHOLDS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 2.75, 3.0, 3.5, 4.0, 5.0, 6.0)
RERUN_TRIGGER = 1.0  # rerun-if-promising: a first run this many σ_floor above the best earns two more
SENPAI_BASELINE = 7  # senpai: baseline seeds per champion
ORACLE_LOOKS = ((1, 2, 5, 10), (1, 2, 4, 8), (1, 2))  # the oracle designs scanned for the default rule's gap
ORACLE_FUTILITY = (0.1, 0.2, 0.3)
ORACLE_ALPHAS = (0.025, 0.01, 0.005, 0.0025, 0.001, 0.0005, 0.00025)


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
    peer: str | None = None  # a peer's rule (`PEERS`, scored by `peer_campaign`), with its threshold (× σ_floor)
    threshold: float | None = None
    alpha: float = 0.025  # `[gate] alpha`: the one-sided level (with `online_fdr`, the cap on α_i)
    online_fdr: str | None = None  # "lond": each comparison at α_i = lond_alpha(i, D, LOND_FDR, alpha); "lord":
    # LORD++'s lord_alpha(i, τ, LOND_FDR, alpha), floored to 2 significant digits (opt-in, measured only)
    stream: str | None = None  # the rule whose noise stream (and hypotheses) it shares: common random numbers
    confirm: int = 0  # a promotion first confirmed on this many fresh pairs per task (horizontal mean Δ > 0)
    confirm_p: float | None = None  # ... by a one-sided t test at this level instead (pooled over tasks)
    confirm_gate: bool = False  # ... by the gate's horizontal test at one look of the fresh pairs, level confirm_p
    confirm_own: bool = False  # ... by the product's (`[gate] replicate_runs`): the fresh per-seed horizontal
    # values on this hypothesis's own paired spread


RULES = (
    Rule("paired", "paired", 10, (1, 2, 5, 10), 0.125, "block", lazy=True, futility_p=0.20, alpha=0.01),
    Rule("paired-0.025", "paired", 10, (1, 2, 5, 10), 0.125, "block", lazy=True),
    Rule("sequential", "sequential", 10, (2, 5, 10), 0.125, "block"),
    Rule("sequential-v1", "sequential", 5, (2, 5, 10), 0.25, "separate"),
    Rule("fixed-5v2", "fixed", 5, (2, 5, 10), 0.25, "fresh"),
    Rule("fixed-10", "fixed", 10, (10,), 0.125, "fresh"),
    Rule("keep-discard", None, 1, (1,), 0.125, "fresh"),
    # opt-in (`--rules`): the same gates under online FDR control, on their noise streams
    Rule("paired-lond", "paired", 10, (1, 2, 5, 10), 0.125, "block", lazy=True, futility_p=0.20, alpha=0.01,
         online_fdr="lond", stream="paired"),
    Rule("paired-lord", "paired", 10, (1, 2, 5, 10), 0.125, "block", lazy=True, futility_p=0.20, alpha=0.01,
         online_fdr="lord", stream="paired"),
    Rule("paired-0.025-lond", "paired", 10, (1, 2, 5, 10), 0.125, "block", lazy=True, online_fdr="lond",
         stream="paired-0.025"),
    # opt-in: the default gate, its promotions confirmed on 2 fresh pairs per task (a replication step)
    Rule("paired-confirm2", "paired", 10, (1, 2, 5, 10), 0.125, "block", lazy=True, futility_p=0.20, alpha=0.01,
         stream="paired", confirm=2),
    Rule("paired-confirm2-t10", "paired", 10, (1, 2, 5, 10), 0.125, "block", lazy=True, futility_p=0.20, alpha=0.01,
         stream="paired", confirm=2, confirm_p=0.10),
    # opt-in: the product's replication step, `[gate] replicate_runs = 2`: the fresh per-seed horizontal
    # values tested on this hypothesis's own paired spread (the decisive look's and the fresh pairs':
    # `replication.own_spread_test`), level 0.10
    Rule("paired-replicate2", "paired", 10, (1, 2, 5, 10), 0.125, "block", lazy=True, futility_p=0.20,
         alpha=0.01, stream="paired", confirm=2, confirm_p=0.10, confirm_own=True),
    # opt-in: the same step on the gate's unpaired bound (its horizontal test at one look of the fresh
    # pairs, the bound from the baseline's and the earlier arms' runs): its level holds for any pairing,
    # at most of its power
    Rule("paired-replicate2-bound", "paired", 10, (1, 2, 5, 10), 0.125, "block", lazy=True, futility_p=0.20,
         alpha=0.01, stream="paired", confirm=2, confirm_p=0.10, confirm_gate=True),
)
LOND_FDR = 0.05  # `[gate] fdr`: the stream's false discovery rate under `online_fdr = "lond"`
STREAMS = [r.name for r in RULES if r.stream is None]  # noise streams: a rule's index here (the peers' follow)


def _floor2(x: float) -> float:
    """x floored to 2 significant digits (0.002675 → 0.0026)."""
    if x <= 0:
        return x
    e = math.floor(math.log10(x)) - 1
    return round(math.floor(x / 10.0**e + 1e-9) * 10.0**e, 15)  # 1e-9: 0.0029/1e-4 is 28.999...


def stream_index(rule: Rule) -> int:
    """The index of `rule`'s noise stream: its own, or that of the rule it shares one with."""
    return STREAMS.index(rule.stream or rule.name)


def default_rules() -> list[Rule]:
    """The rules scored without `--rules`: all but the online-FDR ones (opt-in: LOND's boundaries
    differ at every comparison and cost a calibration each)."""
    return [r for r in RULES if r.online_fdr is None and not r.confirm]


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


def run_values(level: np.ndarray, u: np.ndarray, sigma: np.ndarray) -> np.ndarray:
    """Each run's metric in σ units, the mean over tasks (what keep/discard and the peers compare):
    `level` (…, J) the arm's true level in metric units, `u` (…, J, n) its runs' unit noise → (…, n)."""
    return ((level[..., None] + sigma[:, None] * u) / sigma[:, None]).mean(axis=-2)


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


def judge(rule: Rule, base: np.ndarray, chal: np.ndarray, depth: np.ndarray, pair_hist: np.ndarray,
          arm_hist: np.ndarray, alpha: np.ndarray | None = None) -> LookPath:
    """`look_path` for one step of every campaign under `rule`. `alpha` (B,): each campaign's level
    for this comparison (online FDR), else the rule's own: the gate is run once per distinct α on
    the campaigns that have it, so α enters every boundary, p-value and flag it computes."""
    kw: dict[str, Any] = {"horizontal_trim": rule.trim, "futility_p": rule.futility_p}
    lazy = rule.lazy
    base = base if lazy else base[..., : rule.baseline_runs]
    if alpha is None:
        return look_path(rule.protocol, base, chal, rule.looks, alpha=rule.alpha, **kw,
                         pair_history=pair_hist if lazy else None, base_depth=depth if lazy else None,
                         arm_history=arm_hist if lazy else None)
    B = base.shape[0]
    parts: dict[str, np.ndarray] = {}
    for a in np.unique(alpha):
        on = alpha == a
        path = look_path(rule.protocol, base[on], chal[on], rule.looks, alpha=float(a), **kw,
                         pair_history=pair_hist[on] if lazy else None, base_depth=depth[on] if lazy else None,
                         arm_history=arm_hist[on] if lazy else None)
        for f in dataclasses.fields(LookPath):
            if f.name == "looks":
                continue
            v = getattr(path, f.name)
            out = parts.setdefault(f.name, np.empty((B, *v.shape[1:]), dtype=v.dtype))
            out[on] = v
    return LookPath(looks=tuple(int(x) for x in rule.looks), **parts)


# LOND gives every comparison its own α, so a campaign's boundaries are calibrated afresh at nearly
# every look: `pipeline.gate.boundaries.paired_boundaries` draws its 2M null paths each time (0.1-0.8 s).
# `fast_paired_boundaries` is the same calibration on the same paths, drawn once per (looks, prior df):
# only the largest ⌈α·2M⌉ values of a look matter once the paths that crossed before are set aside,
# so each look keeps its ⌈FAST_ALPHA_MAX·2M⌉ + a few largest (sorted) and α only walks down them. The LOND rules run with
# it in place of the product's (`fast_boundaries`); tests/test_loop_quality.py checks it equal to the
# product's, bit for bit.
FAST_ALPHA_MAX = 0.025  # the largest α it serves (a larger one goes to the product's calibration)


@functools.lru_cache(maxsize=1024)
def _null_tops(looks: tuple[int, ...], prior_df: int, sims: int, seed: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Per look, the indices and values of the ⌈FAST_ALPHA_MAX · size⌉ + a few largest of the
    reflected null paths (`calibrate`'s sample), descending; and the sample's size."""
    from pipeline.gate import boundaries as gb

    paths = gb.null_paired_paths(looks, prior_df, sims, seed)
    paths = np.where(np.isfinite(paths), paths, np.nan)
    sample = np.concatenate([paths, -paths])
    total = sample.shape[0]
    top = min(total, int(math.ceil(FAST_ALPHA_MAX * total)) + 4 * len(looks) + 16)
    idx = np.empty((len(looks), top), dtype=np.int64)
    val = np.empty((len(looks), top))
    for k in range(len(looks)):
        col = np.where(np.isfinite(sample[:, k]), sample[:, k], -np.inf)
        part = np.argpartition(-col, top - 1)[:top]
        order = part[np.argsort(-col[part], kind="stable")]
        idx[k], val[k] = order, sample[order, k]
    return idx, val, total


@functools.lru_cache(maxsize=65536)
def fast_paired_boundaries(looks: tuple[int, ...], planned_max: int, alpha: float, prior_df: int = 0,
                           sims: int | None = None, seed: int | None = None) -> Any:
    """`pipeline.gate.boundaries.paired_boundaries`, the same numbers, α walked down each look's
    largest null values (`_null_tops`) instead of partitioning all of them."""
    from pipeline.gate import boundaries as gb
    from pipeline.gate.stats import bound_weight
    from scipy import stats

    sims = gb.CALIBRATION_SIMS if sims is None else sims
    seed = gb.CALIBRATION_SEED if seed is None else seed
    if not 0 < alpha <= FAST_ALPHA_MAX:
        return gb.paired_boundaries(looks, planned_max, alpha, prior_df, sims, seed)
    looks = gb.normalize_schedule(looks)
    final = max(planned_max, looks[-1])
    fractions = np.array([m / final for m in looks], dtype=float)
    spent = gb.spending(gb.PAIRED_SPENDING, fractions, alpha)
    if looks[-1] >= planned_max:
        spent[-1] = alpha
    dfs = tuple(gb.paired_df(m, float(bound_weight(prior_df, m)) if prior_df > 0 else 0.0) for m in looks)
    usable = np.array([df >= 1 and m >= gb.MIN_DECIDING_PAIRS for df, m in zip(dfs, looks)])
    spent = np.where(usable, spent, 0.0)
    spent = np.maximum.accumulate(spent)
    increments = np.diff(np.concatenate([[0.0], spent]))
    idx, val, total = _null_tops(looks, prior_df, sims, seed)
    upper = np.empty(len(looks))
    dead = np.empty(0, dtype=np.int64)  # the paths that crossed at an earlier look
    for k in range(len(looks)):
        if not usable[k]:
            upper[k] = np.inf
            continue
        count = int(round(increments[k] * total))
        need = count + 1 + dead.size
        if need > idx.shape[1]:
            raise AssertionError("fast_paired_boundaries: too few null values kept")
        alive = ~np.isin(idx[k, :need], dead)
        a_idx, a_val = idx[k, :need][alive], val[k, :need][alive]
        if count <= 0:
            upper[k] = float(a_val[0]) + 1e-9
        else:  # midpoint between the count-th and (count+1)-th largest values, as `calibrate` takes it
            upper[k] = 0.5 * (a_val[count] + a_val[count - 1])
            dead = np.concatenate([dead, a_idx[a_val >= upper[k]]])
    nominal = tuple(float(stats.t.sf(u, df)) if df >= 1 else 0.0 for u, df in zip(upper, dfs))
    return gb.Boundaries(looks=looks, fractions=tuple(float(f) for f in fractions),
                         spent=tuple(float(x) for x in spent), upper=tuple(float(u) for u in upper), df=dfs, nominal=nominal)


@contextlib.contextmanager
def fast_boundaries(on: bool = True) -> Any:
    """While inside, the paired protocol calibrates with `fast_paired_boundaries` (`on`: else a no-op)."""
    import pipeline.gate.boundaries as paired_protocol  # the paired protocol reads it from there at each call

    if not on:
        yield
        return
    before = paired_protocol.paired_boundaries
    paired_protocol.paired_boundaries = fast_paired_boundaries
    try:
        yield
    finally:
        paired_protocol.paired_boundaries = before


def replicated(fresh: np.ndarray, p: float | None) -> np.ndarray:
    """The replication step's verdict on fresh paired differences (B, tasks, pairs) in σ_task units:
    their horizontal mean above 0 (p None), or a one-sided t test of it at level p on the spread of
    the pairs within each task, pooled over tasks (tasks × (pairs − 1) df; needs 2 pairs or more)."""
    mean = fresh.mean(axis=(1, 2))
    if p is None:
        return mean > 0
    from scipy import stats

    j, c = fresh.shape[1], fresh.shape[2]
    df = j * (c - 1)
    s2 = ((fresh - fresh.mean(axis=2, keepdims=True)) ** 2).sum(axis=(1, 2)) / df
    t = mean / np.sqrt(s2 / (j * c))
    return t > stats.t.ppf(1 - p, df)


def replicated_by_gate(rule: Rule, candidate: np.ndarray, mu: np.ndarray, effect: np.ndarray, sigma: np.ndarray,
                       confirm_b: np.ndarray, confirm_u: np.ndarray, base: np.ndarray, depth: np.ndarray,
                       arm_hist: np.ndarray) -> np.ndarray:
    """The replication on the gate's unpaired bound for each campaign whose gate granted a promotion:
    `pipeline.gate.evaluate` at one look of the `rule.confirm` fresh pairs, level `rule.confirm_p`,
    σ_task from the baseline's own runs (its first `depth` seeds) and the bound from the earlier arms
    (`arm_hist`), metric units; passed where the horizontal t reaches the look's boundary."""
    from pipeline.gate import evaluate
    from pipeline.gate.inputs import GateConfig

    cfg = GateConfig(protocol="paired", baseline_runs=rule.baseline_runs, looks=rule.looks, alpha=rule.alpha,
                     horizontal_trim=rule.trim).model_dump()
    cfg.update(alpha=rule.confirm_p, looks=[rule.confirm])
    out = np.zeros(candidate.shape[0], bool)
    s = sigma[None, :, None]
    fresh_b = mu[..., None] + s * confirm_b
    fresh_c = mu[..., None] + effect[..., None] + s * confirm_u
    for i in np.flatnonzero(candidate):
        J = base.shape[1]
        arms = [{f"t{j}": [float(v) for v in arm_hist[i, a, j] if np.isfinite(v)] for j in range(J)}
                for a in range(arm_hist.shape[1]) if np.isfinite(arm_hist[i, a]).sum() >= 2 * J]
        tasks = [{"task": f"t{j}", "baseline": [float(v) for v in fresh_b[i, j]],
                  "challenger": [float(v) for v in fresh_c[i, j]],
                  "history": [float(v) for v in base[i, j, : depth[i]]] + [float(v) for v in fresh_b[i, j]]}
                 for j in range(J)]
        inp = {"config": cfg, "tasks": tasks, "pair_history": [], "arm_history": arms, "looks_done": [],
               "at_look": True}
        hz = evaluate(inp).horizontal
        out[i] = hz.t is not None and hz.boundary is not None and hz.t >= hz.boundary
    return out


def fdr_per_lab(wrong: np.ndarray, made: np.ndarray) -> float:
    """The false discovery rate as online FDR procedures bound it: each campaign (one lab's stream)
    its false promotions ÷ max(its promotions, 1), averaged over campaigns."""
    return float((wrong / np.maximum(made, 1)).mean())


def campaign(rule: Rule, rho: float, campaigns: int, hypotheses: int, seed: int, sigma: np.ndarray,
             rule_index: int = 0, fresh_seeds: bool = False, pair: np.ndarray | None = None,
             prior: Prior = PRIOR, alphas: list[dict[str, np.ndarray]] | None = None) -> dict[str, Any]:
    """Run `campaigns` independent campaigns of `hypotheses` each through one rule, vectorised over campaigns.

    With `rule.online_fdr` ("lond" or "lord"), each campaign is one lab's stream: its i-th hypothesis
    is its i-th comparison (in flight 1, no re-bases), judged through the whole gate at
    α_i = lond_alpha(i, D, LOND_FDR, rule.alpha), D the comparisons before it whose gate said
    `improvement` (held ones included: the gate's verdict, as `Experiment.judge_look` books it), or
    at LORD++'s level given the indices τ of those comparisons.
    `alphas`, if a list, gets per comparison {"i", "alpha", "discoveries"} (arrays over campaigns)."""
    from agent.graph import allowed_decisions

    population = np.random.default_rng([seed, 1])  # the same hypotheses for every rule
    rng = np.random.default_rng([seed, 2, rule_index])  # this rule's noise
    confirm_rng = np.random.default_rng([seed, 4, rule_index])  # `rule.confirm`'s fresh pairs: drawn at every
    # hypothesis, so a rule with the step and one without see the same noise hypothesis by hypothesis
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
    best_seen = run_values(np.zeros((B, J)), base_u[..., :1], sigma)[:, 0]  # keep/discard: the best's one run
    counts: dict[str, list[int]] = {}  # key → [hypotheses, promoted, promoted by look 2]
    runs_by_class: dict[str, float] = {}
    improvement_code = CODE[Verdict.improvement]
    looks = np.asarray(rule.looks)
    found = np.zeros(B, int)  # online FDR: each campaign's discoveries so far
    made, wrong = np.zeros(B), np.zeros(B)  # each campaign's promotions, and of them nulls and harms
    false_codes = np.array([name in FALSE_CLASSES for name, _, _ in prior])
    found_at: list[list[int]] = [[] for _ in range(B)]  # ... and the indices of the comparisons that made them
    alpha_sum = np.zeros(B)

    for h in range(hypotheses):
        cls, size, effect = draw_hypotheses(population, B, J, prior)
        own_pretraining = population.random(B) < PRETRAIN_SHARE
        effect = effect * sigma[None, :]
        # seed k's correlation with the baseline's: pretraining (unless this hypothesis changes it) and fine-tuning
        r = np.where(own_pretraining[:, None], PRETRAIN_PAIR * pair[None, :], pair[None, :])
        if seeds == "block":  # seed k shared with the baseline
            chal_u = paired_noise(rng, base_u[..., : rule.looks[-1]], r, rho)
        else:
            chal_u = draw_noise(rng, B, J, rule.looks[-1], rho)
        chal = mu[..., None] + effect[..., None] + sigma[None, :, None] * chal_u
        base = mu[..., None] + sigma[None, :, None] * base_u
        confirm_u = None  # `rule.confirm`: the confirming pairs' challenger noise
        candidate = np.zeros(B, bool)  # the gate granted a promotion (before the replication step)
        if rule.confirm:
            confirm_b = draw_noise(confirm_rng, B, J, rule.confirm, rho)
            confirm_u = paired_noise(confirm_rng, confirm_b, r, rho)
        if rule.protocol is None:  # keep/discard: one run, one number, no test
            value = (chal[..., 0] / sigma).mean(axis=1)
            promote = value > best_seen
            spent = np.ones(B)
            seen = value - best_seen
        else:
            alpha = None
            if rule.online_fdr == "lond":  # the (h+1)-th comparison of every campaign's stream
                alpha = np.array([lond_alpha(h + 1, int(d), LOND_FDR, rule.alpha) for d in found])
                alpha_sum += alpha
                if alphas is not None:
                    alphas.append({"i": np.full(B, h + 1), "alpha": alpha, "discoveries": found.copy()})
            elif rule.online_fdr == "lord":  # LORD++: each discovery earns wealth back (independence only)
                # floored to 2 significant digits (a lower level keeps the guarantee): boundaries are
                # calibrated once per level, and LORD's levels are as many as the discovery histories
                alpha = np.array([_floor2(lord_alpha(h + 1, taus, LOND_FDR, rule.alpha)) for taus in found_at])
                alpha_sum += alpha
                if alphas is not None:
                    alphas.append({"i": np.full(B, h + 1), "alpha": alpha, "discoveries": found.copy()})
            elif rule.online_fdr is not None:
                raise ValueError(f"online_fdr {rule.online_fdr!r}: expected 'lond', 'lord' or None")
            with fast_boundaries(alpha is not None):
                path = judge(rule, base, chal, depth, pair_hist, arm_hist, alpha)
            code, k_stop = path.first_stop()
            held = path.held[np.arange(B), k_stop]
            promote = np.array([
                allowed_decisions(ORDER[c].value, rule.looks[k], list(rule.looks), supervised=False)[0] == "promote"
                for c, k in zip(code, k_stop)
            ]) & ~held
            assert np.array_equal(promote, (code == improvement_code) & ~held)
            found += code == improvement_code
            for i in np.flatnonzero(code == improvement_code):
                found_at[i].append(h + 1)
            spent = looks[k_stop].astype(float)
            candidate = promote.copy()
            if rule.confirm:
                # the replication: the old baseline and the challenger on the first `confirm` seeds of the
                # block a promoted challenger would start, paired; promoted only if their horizontal mean
                # Δ > 0. The old baseline's runs there are the step's cost; the challenger's become the new
                # champion's first baseline runs (counted below as its first look's), lost only where it
                # is not confirmed
                c = rule.confirm
                if rule.confirm_own:
                    from pipeline.gate.replication import own_spread_test
                    from pipeline.gate.stats import paired_horizontal

                    fresh_h = paired_horizontal(effect[..., None] + sigma[None, :, None] * (confirm_u - confirm_b),
                                                np.broadcast_to(sigma, (B, J)), rule.trim)
                    for i in np.flatnonzero(promote):
                        m = int(looks[k_stop[i]])
                        look_h = paired_horizontal(chal[i, :, :m] - base[i, :, :m], sigma, rule.trim)
                        promote[i] = own_spread_test(look_h, fresh_h[i], float(rule.confirm_p or 0.1))[4]
                elif rule.confirm_gate:
                    promote &= replicated_by_gate(rule, promote, mu, effect, sigma, confirm_b, confirm_u, base,
                                                  np.maximum(depth, np.maximum(looks[k_stop], 2)), arm_hist)
                else:
                    fresh = effect[..., None] / sigma[None, :, None] + (confirm_u - confirm_b)  # (B, J, c), σ units
                    promote &= replicated(fresh, rule.confirm_p)
                runs_base += c * candidate
                spent = spent + c * (candidate & ~promote)
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
            c = counts.setdefault(key, [0, 0, 0])
            c[0] += 1
            c[1] += int(promote[i])
            c[2] += int(promote[i] and spent[i] <= 2)
            runs_by_class[name] = runs_by_class.get(name, 0.0) + spent[i]
        measured += np.where(promote, seen, 0.0)
        made += promote
        wrong += promote & false_codes[cls]
        mu = np.where(promote[:, None], mu + effect, mu)
        if rule.protocol is None:
            best_seen = np.where(promote, value, best_seen)
        elif candidate.any():  # the new baseline's runs on a new seed block (drawn as without the step)
            if rule.lazy:  # the old baseline's runs join the bound's history
                push_arms(base, depth, promote)
            new_u = draw_noise(rng, B, J, block, rho)
            if confirm_u is not None:  # its first seeds are those it was confirmed on
                new_u[..., : rule.confirm] = confirm_u
            base_u = np.where(promote[:, None, None], new_u, base_u)
            if rule.lazy:  # its re-verification is its first look's seeds, its challengers' first baseline runs
                first = max(rule.looks[0], 2)
                runs_base += promote * first
                depth = np.where(promote, first, depth)
            else:
                runs_base += promote * rule.baseline_runs

    extra: dict[str, Any] = {"in_flight": 1, "overlap": 0.0, "rebases_per_hypothesis": 0.0, "rebased_share": 0.0,
                             "rebased_promoted": None, "span_per_hypothesis": float(runs_chal.mean() / hypotheses),
                             "fdr_per_lab": fdr_per_lab(wrong, made)}
    if rule.online_fdr:
        extra["online_fdr"] = {"procedure": rule.online_fdr, "fdr": LOND_FDR, "cap": rule.alpha,
                               "alpha_mean": float(alpha_sum.mean() / hypotheses),
                               "discoveries_mean": float(found.mean()),
                               "next_alpha_mean": float(np.mean([
                                   lond_alpha(hypotheses + 1, int(d), LOND_FDR, rule.alpha) for d in found]
                                   if rule.online_fdr == "lond" else
                                   [_floor2(lord_alpha(hypotheses + 1, t, LOND_FDR, rule.alpha)) for t in found_at]))}
    return summary(rule, rho, campaigns, hypotheses, seeds, unit, prior, counts, runs_by_class, sigma, mu,
                   runs_chal, runs_base, measured, extra)


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

    if rule.online_fdr or rule.confirm:
        raise ValueError(f"{rule.name}: online FDR and the replication step are simulated in flight 1 only (`campaign`)")
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
    made, wrong = np.zeros(B), np.zeros(B)  # each campaign's promotions, and of them nulls and harms
    false_codes = np.array([name in FALSE_CLASSES for name, _, _ in prior])
    best_seen = run_values(np.zeros((B, J)), base_u[..., :1], sigma)[:, 0]
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
            path = judge(rule, base, chal, depth, pair_hist, arm_hist)
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
                c = counts.setdefault(f"{name}@{hyp_size[h_idx[i], i]:g}", [0, 0, 0])
                c[0] += 1
                c[1] += int(promote[i])
                c[2] += int(promote[i] and spent[i] <= 2)
            if trace is not None:
                trace.append({"campaign": int(i), "hypothesis": int(h_idx[i]), "slot": int(s[i]),
                              "ended": float(now[i]), "runs": int(spent[i]), "base_generation": int(g[i]),
                              "generation": int(gen[i]), "rebases": int(rebased[i, h_idx[i]]),
                              "effect": float((s_effect[i, s[i]] / sigma).mean()),
                              "decision": "rebase" if stale[i] else "promote" if promote[i] else "stop"})
        measured += np.where(promote, s_seen[rows, s], 0.0)
        made += promote
        wrong += promote & false_codes[hyp_cls[h_idx, rows]]
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
             "span_per_hypothesis": float(span.mean() / H),
             "fdr_per_lab": fdr_per_lab(wrong, made)}
    return summary(rule, rho, campaigns, hypotheses, seeds, unit, prior, counts, runs_by_class, sigma, mu,
                   runs_chal, runs_base, measured, extra)


@dataclass(frozen=True)
class Peer:
    """A rule other loops use instead of a test, scored with a threshold grid (`PEER_THRESHOLDS`, in
    σ_floor: the sd of one run's mean over tasks, as the lab's variance study measures it)."""
    name: str
    chal_runs: int  # a challenger's runs when measured in full
    first_runs: int  # the first baseline's runs
    as_used: tuple[float, ...]  # the thresholds its users state
    what: str


PEERS = (
    Peer("threshold", 1, 1, (1.0, 2.0, 3.0), "keep/discard with a noise floor: keep if the one run beats the best's "
         "run by > t (karpathy/autoresearch#560: 'discard anything under 2σ'); t = 0 is keep/discard"),
    Peer("rerun", 3, 1, (0.0,), f"rerun-if-promising (karpathy/autoresearch#218): one run; two more if it beats the "
         f"best by > {RERUN_TRIGGER:g}σ_floor; keep if the mean of the 3 beats the best by > t"),
    Peer("median3", 3, 3, (0.0,), "autocrucible with evaluation.repeat 3 (what its `validate` advises at CV > 5 %): "
         "the median of 3 runs, kept if it beats the best's median by > t"),
    Peer("senpai7v1", 1, SENPAI_BASELINE, (0.0,), f"senpai: {SENPAI_BASELINE} baseline seeds per champion, one "
         "challenger run, kept if it beats the baseline's mean by > t"),
)


def peer_campaign(peer: Peer, rho: float, campaigns: int, hypotheses: int, seed: int, sigma: np.ndarray,
                  rule_index: int, prior: Prior = PRIOR,
                  thresholds: tuple[float, ...] = PEER_THRESHOLDS) -> list[dict[str, Any]]:
    """`campaign` for a peer's rule at every threshold at once: one row per threshold (`summary`'s).

    The rules compare one number per run, the mean over tasks in σ units (`run_values`), on fresh
    seeds, as keep/discard does. The best's number is the kept challenger's own (its one run, the mean
    or the median of its 3: the winner's curse included); senpai's is the mean of its champion's
    `SENPAI_BASELINE` runs, drawn again at each promotion (those runs count). The same hypotheses as
    every rule; one noise stream (`rule_index`) shared by the thresholds, which differ only by what
    they promoted (common random numbers). The threshold family with `rule_index` of keep/discard
    draws keep/discard's noise in keep/discard's order, so its t = 0 is keep/discard, number for
    number (tests/test_loop_quality.py checks)."""
    population = np.random.default_rng([seed, 1])  # the same hypotheses for every rule
    rng = np.random.default_rng([seed, 2, rule_index])
    B, J, T, H = campaigns, TASKS, len(thresholds), hypotheses
    sigma = np.asarray(sigma, dtype=float)[:J]
    unit = float(np.median(sigma))
    floor = math.sqrt(rho + (1 - rho) / J)  # σ_floor: the sd of one run's mean over tasks (σ units)
    cut = np.asarray(thresholds, dtype=float)[:, None] * floor  # (T, 1)
    trigger = RERUN_TRIGGER * floor
    mu = np.zeros((T, B, J))
    first = run_values(np.zeros((B, J)), draw_noise(rng, B, J, peer.first_runs, rho), sigma)  # (B, n)
    best = np.broadcast_to(np.median(first, axis=-1) if peer.name == "median3" else first.mean(axis=-1), (T, B)).copy()
    runs_chal = np.zeros((T, B))
    runs_base = np.full((T, B), float(peer.first_runs))
    measured = np.zeros((T, B))
    counts: list[dict[str, list[int]]] = [{} for _ in range(T)]
    runs_by_class: list[dict[str, float]] = [{} for _ in range(T)]
    for _ in range(H):
        cls, size, effect = draw_hypotheses(population, B, J, prior)
        population.random(B)  # whether it changes pretraining (no matter on fresh seeds): keeps the draws in step
        effect = effect * sigma[None, :]
        runs = run_values(mu + effect, draw_noise(rng, B, J, peer.chal_runs, rho)[None], sigma)  # (T, B, n)
        if peer.name == "threshold":
            value, spent = runs[..., 0], np.ones((T, B))
        elif peer.name == "rerun":
            promising = runs[..., 0] - best > trigger
            value = np.where(promising, runs.mean(axis=-1), runs[..., 0])
            spent = np.where(promising, 3.0, 1.0)
        elif peer.name == "median3":
            value, spent = np.median(runs, axis=-1), np.full((T, B), 3.0)
        else:  # senpai
            value, spent = runs[..., 0], np.ones((T, B))
        seen = value - best
        promote = seen > cut
        if peer.name == "rerun":
            promote &= promising
        runs_chal += spent
        keys = np.array([f"{prior[c][0]}@{z:g}" for c, z in zip(cls, size)])
        for key in np.unique(keys):
            on = keys == key
            name = key.split("@")[0]
            n, won, paid = int(on.sum()), promote[:, on].sum(axis=1), spent[:, on].sum(axis=1)
            for t in range(T):
                c = counts[t].setdefault(key, [0, 0])
                c[0] += n
                c[1] += int(won[t])
                runs_by_class[t][name] = runs_by_class[t].get(name, 0.0) + float(paid[t])
        measured += np.where(promote, seen, 0.0)
        mu = np.where(promote[..., None], mu + effect, mu)
        if peer.name == "senpai7v1":
            if promote.any():  # the new champion's seeds
                fresh = run_values(mu, draw_noise(rng, T * B, J, SENPAI_BASELINE, rho).reshape(T, B, J, -1), sigma)
                best = np.where(promote, fresh.mean(axis=-1), best)
                runs_base += promote * SENPAI_BASELINE
        else:
            best = np.where(promote, value, best)
    rows = []
    for t, k in enumerate(thresholds):
        rule = Rule(f"{peer.name}@{k:g}", None, peer.first_runs, (peer.chal_runs,), seeds="fresh", peer=peer.name,
                    threshold=float(k))
        rows.append(summary(rule, rho, campaigns, hypotheses, "fresh", unit, prior, counts[t], runs_by_class[t], sigma,
                            mu[t], runs_chal[t], runs_base[t], measured[t],
                            {"in_flight": 1, "overlap": 0.0, "rebases_per_hypothesis": 0.0, "rebased_share": 0.0,
                             "rebased_promoted": None, "span_per_hypothesis": float(runs_chal[t].mean() / H),
                             "as_used": float(k) in peer.as_used or (peer.name == "threshold" and k == 0),
                             "noise_floor": floor}))
    return rows


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
    promotions = sum(v[1] for v in counts.values())
    false = sum(v[1] for k, v in counts.items() if cls_of(k) in FALSE_CLASSES)
    out: dict[str, Any] = {
        "rule": rule.name,
        "protocol": rule.protocol or rule.peer or "keep/discard",
        "peer": rule.peer,
        "threshold": rule.threshold,
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
        # issue 34: horizontal gains of 2σ or more promoted by look 2 (2 challenger runs), of all of them
        # (None: none in this prior, or a rule that does not record it: the peers, in flight > 1)
        "horizontal>=2_by_look2": (lambda n, e: e / n if n else None)(
            *(sum(v[i] for k, v in counts.items() if cls_of(k) == "horizontal" and size_of(k) >= 2 and len(v) > 2)
              for i in (0, 2))),
        "promotions": promotions,  # over all campaigns
        "false_promotions": false,  # of them nulls, harms and one-task harms
        "fdp": false / promotions if promotions else None,  # pooled over campaigns; None: nothing promoted
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
            group = [r for r in rows if r["prior"] == prior and r["rho"] == rho and not r.get("peer")]
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


def oracle_designs(prior: Prior, rho: float, campaigns: int, hypotheses: int, seed: int, sigma: np.ndarray,
                   pair: np.ndarray, bounds: dict[tuple[Any, ...], np.ndarray]) -> list[dict[str, Any]]:
    """benchmarks/oracle_bound.py's known-variance oracle on this population, one row per design of
    `bounds` ((looks, shape, futility p, α) → its z boundaries): its FDP, gain per 1000 runs, runs."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import oracle_bound as ob

    out = []
    for (looks, shape, fut, alpha), upper in bounds.items():
        row = ob.oracle_campaign(looks, upper, ob.futility_z(looks, fut, None), rho, campaigns, hypotheses, seed,
                                 sigma, pair, prior)
        out.append({"looks": list(looks), "shape": shape, "futility_p": fut, "alpha": alpha,
                    **{k: (float(v) if v is not None else None) for k, v in row.items()}})
    return out


def oracle_bounds() -> dict[tuple[Any, ...], np.ndarray]:
    """The oracle designs scanned for the default rule's gap, with their boundaries (computed once)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import oracle_bound as ob

    return {(lk, sh, f, a): ob.z_boundaries(lk, sh, f, a) for lk in ORACLE_LOOKS for sh in ob.SHAPES
            for f in ORACLE_FUTILITY for a in ORACLE_ALPHAS}


def _fdp0(r: dict[str, Any]) -> float:
    """A row's FDP, 0 where it promoted nothing (V / max(R, 1))."""
    return r["fdp"] or 0.0


def best_at(rows: list[dict[str, Any]], fdp_max: float, gain: str = "true_gain_per_1000_runs") -> dict[str, Any] | None:
    """The row with the most gain per 1000 runs among those with FDP ≤ `fdp_max` (None: none)."""
    ok = [r for r in rows if _fdp0(r) <= fdp_max + 1e-12]
    return max(ok, key=lambda r: r[gain]) if ok else None


def fdp_verdicts(rows: list[dict[str, Any]],
                 oracle: dict[tuple[str, float], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Issue 34, per (prior, ρ), one after another: the default rule's FDP and gain, each peer's
    variant with the most gain at FDP ≤ `TARGET_FDP` (tuned on this prior: the most favourable to the
    peer), and the oracle's most gain at the default rule's FDP (its gap) and at `TARGET_FDP`."""
    out = []
    for prior in dict.fromkeys(r["prior"] for r in rows):
        for rho in sorted({r["rho"] for r in rows if r["prior"] == prior}):
            group = [r for r in rows if r["prior"] == prior and r["rho"] == rho and r.get("in_flight", 1) == 1]
            default = next((r for r in group if r["rule"] == DEFAULT_RULE), None)
            peers = [r for r in group if r.get("peer")]
            if default is None or not peers:
                continue
            best = {p.name: best_at([r for r in peers if r["peer"] == p.name], TARGET_FDP) for p in PEERS}
            top = best_at([b for b in best.values() if b], TARGET_FDP)
            got: dict[str, Any] = {"prior": prior, "rho": rho, "rule": DEFAULT_RULE, "fdp": default["fdp"],
                                   "gain_per_1000_runs": default["true_gain_per_1000_runs"],
                                   "runs_per_hypothesis": default["runs_per_hypothesis"],
                                   "fdp_met": _fdp0(default) <= TARGET_FDP,
                                   "h2_by_look2": default.get("horizontal>=2_by_look2"),
                                   "best_peer_by_family": {k: v and v["rule"] for k, v in best.items()},
                                   "best_peer": top and top["rule"],
                                   "best_peer_gain": top and top["true_gain_per_1000_runs"],
                                   "best_peer_fdp": top and top["fdp"],
                                   "best_peer_promotions": top and top["promotions"]}
            anyone = best_at([r for r in group if r["promotions"]], TARGET_FDP)  # gate rules and peers alike
            got["best_rule"] = anyone and anyone["rule"]
            got["best_rule_gain"] = anyone and anyone["true_gain_per_1000_runs"]
            got["best_rule_fdp"] = anyone and anyone["fdp"]
            got["gain_ratio"] = (default["true_gain_per_1000_runs"] / top["true_gain_per_1000_runs"]
                                 if top and top["true_gain_per_1000_runs"] > 0 else None)
            got["gain_met"] = top is None or default["true_gain_per_1000_runs"] >= top["true_gain_per_1000_runs"]
            designs = oracle.get((prior, rho), [])
            if designs:
                same = best_at(designs, _fdp0(default), "gain/1k")
                five = best_at(designs, TARGET_FDP, "gain/1k")
                low = min(designs, key=_fdp0)
                got["oracle"] = {
                    "designs": len(designs), "lowest_fdp": low["fdp"], "lowest_fdp_design": _design(low),
                    "at_default_fdp": same and {**same, "design": _design(same)},
                    "at_target_fdp": five and {**five, "design": _design(five)},
                    "gap_at_default_fdp": (1 - default["true_gain_per_1000_runs"] / same["gain/1k"])
                    if same and same["gain/1k"] > 0 else None,
                }
            out.append(got)
    return out


def _design(d: dict[str, Any]) -> str:
    return f"looks {','.join(map(str, d['looks']))} {d['shape']} α {d['alpha']:g} futility {d['futility_p']:g}"


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.1f}%"


def fdp_table(rows: list[dict[str, Any]], verdicts: list[dict[str, Any]]) -> str:
    """Per (prior, ρ): every gate rule (an online-FDR one with its levels), each peer as its users
    state it and its best variant at FDP ≤ `TARGET_FDP`; then every peer's threshold grid; then the
    default rule's verdicts. Without peers (no `--fdp`), the gate rules alone."""
    lines = []
    cols = ("runs/hyp", "gain/1k", "FDP", "FDR/lab", "promoted", "h@0.25", "h@0.5", "h@1", "h@2", "null", "harm")
    by_cell = {(v["prior"], v["rho"]): v for v in verdicts}
    for prior in dict.fromkeys(r["prior"] for r in rows):
        for rho in sorted({r["rho"] for r in rows if r["prior"] == prior}):
            group = [r for r in rows if r["prior"] == prior and r["rho"] == rho and r.get("in_flight", 1) == 1]
            peers = [r for r in group if r.get("peer")]
            if not group:
                continue
            floor = f"; peer thresholds t in σ_floor = {peers[0]['noise_floor']:.3f}σ" if peers else ""
            lines.append(f"\nprior {prior}, ρ = {rho}: FDP = (nulls + harms + one-task harms promoted) ÷ all promoted, "
                         "pooled over campaigns; FDR/lab = each campaign's false ÷ max(its promotions, 1), averaged "
                         "(the form of rate online FDR procedures bound, LOND over its own discoveries; — : not recorded); "
                         f"power = share of horizontal gains of 0.25/0.5/1/2σ promoted (— : none in this prior)"
                         + floor)
            lines.append(f"{'rule':<30}" + "".join(f"{c:>10}" for c in cols))

            def line(r: dict[str, Any], note: str = "") -> str:
                p = r["promoted"]
                cells = [f"{r['runs_per_hypothesis']:>10.2f}", f"{r['true_gain_per_1000_runs']:>10.2f}",
                         f"{_pct(r['fdp']):>10}", f"{_pct(r.get('fdr_per_lab')):>10}", f"{r['promotions']:>10}"]
                cells += [f"{p.get(k):>10.3f}" if p.get(k) is not None else f"{'—':>10}"
                          for k in ("horizontal@0.25", "horizontal@0.5", "horizontal@1", "horizontal@2", "null",
                                    "harm")]
                return f"{r['rule'] + note:<30}" + "".join(cells)
            for r in group:
                if not r.get("peer"):
                    lines.append(line(r))
            for r in group:
                o = r.get("online_fdr")
                if o:
                    lines.append(f"  {r['rule']}: {o['procedure'].upper()} at FDR {o['fdr']:g}, α_i ≤ {o['cap']:g}: "
                                 f"mean α_i {o['alpha_mean']:.2e} over the {r['hypotheses']} comparisons; "
                                 f"discoveries per campaign {o['discoveries_mean']:.1f}; the next comparison's α "
                                 f"{o['next_alpha_mean']:.1e}")
            if not peers:
                continue
            for peer in PEERS:
                fam = [r for r in peers if r["peer"] == peer.name]
                for r in fam:
                    if r["as_used"]:
                        lines.append(line(r, " (as used)"))
                b = best_at(fam, TARGET_FDP)
                lines.append(line(b, " (best ≤5%)") if b else f"{peer.name + ' (best ≤5%)':<30}  none of "
                             f"{len(fam)} thresholds has FDP ≤ {TARGET_FDP:.0%}")
            lines.append("  every peer's threshold grid: gain/1k | FDP at threshold t (× σ_floor)")
            lines.append(f"{'t':>6}" + "".join(f"{p.name:>24}" for p in PEERS))
            for t in PEER_THRESHOLDS:
                cells = []
                for p in PEERS:
                    r = next(r for r in peers if r["peer"] == p.name and r["threshold"] == t)
                    cells.append(f"{r['true_gain_per_1000_runs']:>14.2f} | {_pct(r['fdp']):>6}")
                lines.append(f"{t:>6g}" + "".join(f"{c:>24}" for c in cells))
            v = by_cell.get((prior, rho))
            if v:
                lines.append(verdict_line(v))
    return "\n".join(lines)


def verdict_line(v: dict[str, Any]) -> str:
    """The default rule against issue 34's targets in one (prior, ρ) cell."""
    cells = [f"FDP {_pct(v['fdp'])} (≤ {TARGET_FDP:.0%}) {'met' if v['fdp_met'] else 'MISSED'}"]
    if v.get("h2_by_look2") is not None:
        cells.append(f"horizontal gains ≥ 2σ promoted by look 2: {_pct(v['h2_by_look2'])} (≥ 90%) "
                     f"{'met' if v['h2_by_look2'] >= 0.9 else 'MISSED'}")
    if v["best_peer"] and v["best_peer_promotions"]:
        cells.append(f"gain/1k {v['gain_per_1000_runs']:.2f} vs the best peer at FDP ≤ {TARGET_FDP:.0%}, "
                     f"{v['best_peer']} ({v['best_peer_gain']:.2f}, FDP {_pct(v['best_peer_fdp'])} on "
                     f"{v['best_peer_promotions']} promotions): "
                     + (f"{v['gain_ratio']:.2f}×" if v["gain_ratio"] is not None else "—")
                     + f" (≥ 1×) {'met' if v['gain_met'] else 'MISSED'}")
    else:
        cells.append(f"gain/1k {v['gain_per_1000_runs']:.2f}; no peer threshold promotes anything at FDP ≤ "
                     f"{TARGET_FDP:.0%} (best peer: 0) {'met' if v['gain_met'] else 'MISSED'}")
    if v["best_rule"]:
        cells.append(f"most gain of any rule at FDP ≤ {TARGET_FDP:.0%}: {v['best_rule']} ({v['best_rule_gain']:.2f}, "
                     f"FDP {_pct(v['best_rule_fdp'])})")
    else:
        cells.append(f"no rule that promotes anything has FDP ≤ {TARGET_FDP:.0%}")
    o = v.get("oracle")
    if o:
        if o["at_default_fdp"] is None:
            cells.append(f"oracle: none of its {o['designs']} designs reaches FDP ≤ {_pct(v['fdp'])} (its lowest "
                         f"{_pct(o['lowest_fdp'])}, {o['lowest_fdp_design']}): no gap at the same FDP")
        else:
            s = o["at_default_fdp"]
            gap = o["gap_at_default_fdp"]
            cells.append(f"oracle at FDP ≤ {_pct(v['fdp'])}: {s['gain/1k']:.2f} ({s['design']}, FDP {_pct(s['fdp'])}, "
                         f"{s['runs/hyp']:.2f} runs/hyp): gap " + (f"{100 * gap:.0f}%" if gap is not None else "—")
                         + (f" (≤ 20%) {'met' if gap <= 0.2 else 'MISSED'}" if gap is not None else ""))
        f = o["at_target_fdp"]
        if f:
            cells.append(f"oracle at FDP ≤ {TARGET_FDP:.0%}: {f['gain/1k']:.2f} ({f['design']}, FDP {_pct(f['fdp'])})")
            if v["best_peer_gain"] and v["best_peer_gain"] > f["gain/1k"]:
                cells.append(f"{v['best_peer']} banks more than it: the oracle bounds paired sequential gates, "
                             "which pay for baseline runs on shared seeds, not a rule that takes a kept run as the "
                             "champion's measurement")
    return f"  {v['rule']}: " + "; ".join(cells)


def fdp_misses(verdicts: list[dict[str, Any]]) -> list[str]:
    """Issue 34's targets for the default rule that are missed (the oracle gap is reported, not judged)."""
    misses = []
    for v in verdicts:
        where = f"prior {v['prior']}, rho {v['rho']}"
        if not v["fdp_met"]:
            misses.append(f"{where}: FDP {_pct(v['fdp'])} > {TARGET_FDP:.0%}")
        if not v["gain_met"]:
            misses.append(f"{where}: gain/1k {v['gain_per_1000_runs']:.1f} < {v['best_peer']}'s "
                          f"{v['best_peer_gain']:.1f} at FDP ≤ {TARGET_FDP:.0%}")
    return misses


def pareto_picture(rows: list[dict[str, Any]], oracle: dict[tuple[str, float], list[dict[str, Any]]],
                   path: Path, title: str) -> None:
    """Gain per 1000 runs against FDP, one panel per (prior, ρ), one point per rule and variant: the
    gate's rules labelled, each peer's thresholds a line (its as-used thresholds ringed), the
    oracle's designs grey with their frontier dashed. FDP on a square-root axis, to open up 0-10 %."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cells = [(p, rho) for p in dict.fromkeys(r["prior"] for r in rows)
             for rho in sorted({r["rho"] for r in rows if r["prior"] == p})
             if any(r.get("peer") for r in rows if r["prior"] == p and r["rho"] == rho)]
    if not cells:
        return
    rhos = sorted({rho for _, rho in cells})
    priors = list(dict.fromkeys(p for p, _ in cells))
    fig = Figure(figsize=(6.2 * len(priors), 5.2 * len(rhos)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(rhos), len(priors), squeeze=False)
    colours = {"threshold": "tab:blue", "rerun": "tab:orange", "median3": "tab:green", "senpai7v1": "tab:purple"}
    gate_marks = {"paired": ("*", "red", 260), "paired-0.025": ("P", "darkred", 110), "sequential": ("s", "black", 60),
                  "sequential-v1": ("D", "dimgray", 50), "fixed-5v2": ("^", "saddlebrown", 70),
                  "fixed-10": ("v", "olive", 70), "keep-discard": ("o", "tab:blue", 90),
                  "paired-lond": ("X", "orangered", 110), "paired-0.025-lond": ("X", "darkorange", 90)}
    ticks = [0, 2, 5, 10, 20, 50, 100]
    for ax in axes.flat:
        ax.set_visible(False)
    for prior, rho in cells:
        ax = axes[rhos.index(rho), priors.index(prior)]
        ax.set_visible(True)
        group = [r for r in rows if r["prior"] == prior and r["rho"] == rho and r.get("in_flight", 1) == 1]
        designs = oracle.get((prior, rho), [])
        if designs:
            xs = [100 * _fdp0(d) for d in designs]
            ax.scatter(xs, [d["gain/1k"] for d in designs], s=10, color="0.75", zorder=1,
                       label="oracle designs (known variance)")
            front = sorted(designs, key=_fdp0)
            fx, fy, top = [], [], -math.inf
            for d in front:
                top = max(top, d["gain/1k"])
                fx.append(100 * _fdp0(d))
                fy.append(top)
            ax.step(fx, fy, where="post", color="0.45", linestyle="--", linewidth=1.2, zorder=2,
                    label="oracle frontier")
        for p in PEERS:
            fam = sorted((r for r in group if r.get("peer") == p.name), key=lambda r: r["threshold"])
            xs = [100 * _fdp0(r) for r in fam]
            ys = [r["true_gain_per_1000_runs"] for r in fam]
            ax.plot(xs, ys, "-", marker=".", color=colours[p.name], linewidth=1.2, markersize=5, zorder=3,
                    label=f"{p.name} (t = 0…{PEER_THRESHOLDS[-1]:g}σ_floor)")
            for r in fam:
                if r["as_used"] and r["threshold"] > 0 or (r["as_used"] and p.name != "threshold"):
                    ax.scatter([100 * _fdp0(r)], [r["true_gain_per_1000_runs"]], s=70, facecolors="none",
                               edgecolors=colours[p.name], linewidths=1.5, zorder=4)
                    ax.annotate(r["rule"], (100 * _fdp0(r), r["true_gain_per_1000_runs"]), textcoords="offset points",
                                xytext=(5, -10), fontsize=7.5, color=colours[p.name])
            b = best_at(fam, TARGET_FDP)
            if b:
                ax.scatter([100 * _fdp0(b)], [b["true_gain_per_1000_runs"]], s=120, marker="o",
                           facecolors=colours[p.name], edgecolors="black", linewidths=0.8, zorder=5)
        for r in group:
            if r.get("peer"):
                continue
            m, c, s = gate_marks.get(r["rule"], ("x", "black", 50))
            x, y = 100 * _fdp0(r), r["true_gain_per_1000_runs"]
            ax.scatter([x], [y], marker=m, color=c, s=s, zorder=6, edgecolors="white" if m == "*" else None,
                       linewidths=0.5,
                       label=r["rule"] if r["rule"] != "keep-discard" else "keep-discard (= threshold t 0)")
            ax.annotate(r["rule"], (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8, color=c,
                        weight="bold" if r["rule"] == DEFAULT_RULE else "normal")
        ax.axvline(100 * TARGET_FDP, color="red", linestyle=":", linewidth=1.2)
        ax.text(100 * TARGET_FDP, 1.0, " FDP 5 %", color="red", fontsize=8, va="top",
                transform=ax.get_xaxis_transform())
        ax.set_xscale("function", functions=(lambda x: np.sqrt(np.clip(x, 0, None)), lambda x: np.square(x)))
        ax.set_xlim(0, 100)
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{t}%" for t in ticks])
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.set_title(f"prior {prior}, ρ = {rho}", fontsize=11)
        ax.set_xlabel("FDP: false promotions ÷ all promotions (√ scale)")
        ax.set_ylabel("true gain per 1000 runs (σ, mean over tasks)")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 3 * len(priors)), fontsize=9,
               markerscale=0.9)
    fig.suptitle(title + "\nfilled circle: a peer's best threshold with FDP ≤ 5 % (tuned on this prior); ringed: its "
                 "threshold as its users state it; dotted: FDP 5 %", fontsize=10.5)
    fig.savefig(path, dpi=110)


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
    ap.add_argument("--rules", nargs="+", default=None, help=f"rules to score (default: "
                    f"{', '.join(r.name for r in default_rules())}; opt-in: "
                    f"{', '.join(r.name for r in RULES if r not in default_rules())}, in flight 1 only)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fresh-seeds", action="store_true", help="challengers draw fresh seed shocks (no shared seeds)")
    ap.add_argument("--in-flight", type=int, nargs="+", default=[1, 4, 16], metavar="K",
                    help="hypotheses measured at once per campaign (1: one after another; more: re-bases)")
    ap.add_argument("--overlap", type=float, default=0.0, metavar="F",
                    help=f"share of re-bases whose effect against the new baseline is × {OVERLAP_KEEP} (default 0: "
                         "effects add)")
    ap.add_argument("--fdp", action="store_true",
                    help="issue 34: also the peers' rules at every threshold (in flight 1), every rule's FDP, the "
                         "default rule's FDP and gain against the best peer at FDP ≤ 5 %%, and its gap to the oracle")
    ap.add_argument("--picture", type=Path, default=None, help="with --fdp: the Pareto picture (PNG) here")
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
    unknown = sorted(set(args.rules or ()) - {r.name for r in RULES})
    if unknown:
        raise SystemExit(f"--rules: unknown {', '.join(unknown)}; expected among {', '.join(r.name for r in RULES)}")
    rules = default_rules() if args.rules is None else [r for r in RULES if r.name in args.rules]
    if any(r.online_fdr or r.confirm for r in rules) and args.in_flight != [1]:
        raise SystemExit("--rules: the online-FDR and replication rules are simulated in flight 1 only (--in-flight 1)")
    t0 = time.perf_counter()
    rows = []
    for pname, prior in priors.items():
        for rho in args.rho:
            for rule in rules:
                for k in args.in_flight:
                    t = time.perf_counter()
                    if k == 1:  # one after another: the sequential code path itself
                        row = campaign(rule, rho, args.campaigns, args.hypotheses, args.seed, sigma, stream_index(rule),
                                       args.fresh_seeds, pair, prior)
                    else:
                        row = concurrent_campaign(rule, rho, args.campaigns, args.hypotheses, args.seed, sigma,
                                                  stream_index(rule), args.fresh_seeds, pair, prior, k, args.overlap)
                    rows.append({"prior": pname, **row})
                    print(f"  [{pname} {rule.name} ρ={rho} k={k}: {time.perf_counter() - t:.1f}s]", file=sys.stderr)
    oracle: dict[tuple[str, float], list[dict[str, Any]]] = {}
    verdicts: list[dict[str, Any]] = []
    if args.fdp:
        bounds = oracle_bounds()
        kd_index = STREAMS.index("keep-discard")
        for pname, prior in priors.items():
            for rho in args.rho:
                for i, peer in enumerate(PEERS):  # threshold: keep/discard's noise, so its t = 0 is keep/discard
                    t = time.perf_counter()
                    index = kd_index if peer.name == "threshold" else len(STREAMS) + i
                    rows += [{"prior": pname, **r} for r in peer_campaign(peer, rho, args.campaigns, args.hypotheses,
                                                                          args.seed, sigma, index, prior)]
                    print(f"  [{pname} {peer.name} ×{len(PEER_THRESHOLDS)} ρ={rho}: {time.perf_counter() - t:.1f}s]",
                          file=sys.stderr)
                t = time.perf_counter()
                oracle[(pname, rho)] = oracle_designs(prior, rho, args.campaigns, args.hypotheses, args.seed, sigma,
                                                      pair, bounds)
                print(f"  [{pname} oracle ×{len(bounds)} ρ={rho}: {time.perf_counter() - t:.1f}s]", file=sys.stderr)
        verdicts = fdp_verdicts(rows, oracle)
    misses = check(rows) if any(r.name == "keep-discard" for r in rules) else []
    misses += fdp_misses(verdicts)
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
        "fdp": {"target": TARGET_FDP, "false_classes": list(FALSE_CLASSES), "peer_thresholds": list(PEER_THRESHOLDS),
                "rerun_trigger": RERUN_TRIGGER,
                "peers": [{"name": p.name, "what": p.what, "as_used": list(p.as_used)} for p in PEERS],
                "verdicts": verdicts,
                "oracle": [{"prior": k[0], "rho": k[1], "designs": v} for k, v in oracle.items()],
                } if args.fdp else None,
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
        if not args.fdp and any(r.online_fdr for r in rules):
            print("\nfalse discoveries and gain per run of the gate rules, in flight 1 (online FDR: LOND, "
                  "onlineFDR's γ, each campaign one lab's stream; no peers: see --fdp)")
            print(fdp_table(rows, verdicts))
        if args.fdp:
            print("\nissue 34: false discoveries and gain per run, in flight 1. Peers (fresh seeds, one number per "
                  "run: the mean over tasks in σ units; σ_floor, the sd of one such run, known exactly):")
            for p in PEERS:
                print(f"  {p.name}: {p.what}")
            looks = ", ".join(",".join(map(str, lk)) for lk in ORACLE_LOOKS)
            print(f"oracle: benchmarks/oracle_bound.py's known-variance z on the same population, "
                  f"{len(next(iter(oracle.values())))} designs (looks {looks}; "
                  f"Pocock and O'Brien-Fleming; futility p {', '.join(map(str, ORACLE_FUTILITY))}; "
                  f"α {', '.join(f'{a:g}' for a in ORACLE_ALPHAS)}); its gap: its most gain among designs whose FDP "
                  f"is ≤ the default rule's")
            print(fdp_table(rows, verdicts))
        judged = any(r.name == "keep-discard" for r in rules) or args.fdp
        print(f"\ntargets ({DEFAULT_RULE}):", ("all met" if not misses else "; ".join(misses)) if judged else
              "not judged (they need the keep-discard row or --fdp)")
    if args.fdp and args.picture:
        pareto_picture(rows, oracle, args.picture, f"Gain per run against false discoveries "
                       f"(benchmarks/loop_quality.py --fdp: {args.campaigns} campaigns × {args.hypotheses} hypotheses "
                       f"per rule, in flight 1)")
    return 1 if misses else 0


if __name__ == "__main__":
    raise SystemExit(main())
