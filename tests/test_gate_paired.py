"""The paired protocol (README, The gate): tests on d_k = challenger_k - baseline_k, the lab's history as the
prior of their variance, looks from 1 run, and seeds that must vary."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipeline.gate import Verdict, evaluate
from pipeline.gate.plausibility import implausible
from pipeline.gate.sim import simulate

pytestmark = pytest.mark.unit

TASKS = [f"task{j}" for j in range(8)]
SIGMA = 0.01


def paired_data(effect: float, m: int, n: int | None = None, pair: float = 0.9, seed: int = 0,
                history: int = 0, **gate) -> dict:
    """Tasks whose challenger seed k shares most of the baseline's seed-k noise (correlation `pair`);
    `effect` in σ units on every task; `history` earlier null comparisons of 2 pairs each."""
    rng = np.random.default_rng(seed)
    n = n if n is not None else max(m, 2)
    tasks = []
    for j, t in enumerate(TASKS):
        b = 0.7 + 0.02 * j + SIGMA * rng.standard_normal(10)
        c = 0.7 + 0.02 * j + effect * SIGMA + pair * (b - 0.7 - 0.02 * j) + np.sqrt(1 - pair**2) * SIGMA * rng.standard_normal(10)
        tasks.append({"task": t, "baseline": list(b[:n]), "challenger": list(c[:m]), "history": list(b[:n])})
    pairs = [{t: list(np.sqrt(2 * (1 - pair)) * SIGMA * rng.standard_normal(2)) for t in TASKS} for _ in range(history)]
    return {"config": {"protocol": "paired", **gate}, "tasks": tasks, "pair_history": pairs, "at_look": True,
            "looks_done": [x for x in (1, 2, 5, 10) if x < m]}


def test_pairing_finds_a_gain_the_pooled_t_cannot_see():
    data = paired_data(0.25, m=10, n=10, pair=0.95, seed=3)
    paired = evaluate(data)
    pooled = evaluate({**data, "config": {"protocol": "sequential", "looks": [2, 5, 10]}, "pair_history": [],
                       "looks_done": [2, 5]})
    assert paired.verdict is Verdict.improvement, paired.reasons
    assert pooled.verdict is not Verdict.improvement
    assert paired.horizontal.t > 2 * pooled.horizontal.t
    assert paired.horizontal.pairs == 10 and all(t.pairs == 10 and t.pairs_dropped == 0 for t in paired.tasks)


def test_a_deterministic_no_op_is_futile_never_promoted():
    """Δ ≡ 0 with zero variance: t is 0, not 0/0, and the hypothesis stops."""
    data = paired_data(0.0, m=2, n=2)
    for t in data["tasks"]:
        t["challenger"] = list(t["baseline"][:2])
    r = evaluate(data)
    assert r.verdict is Verdict.futile
    assert r.horizontal.delta == 0 and r.horizontal.t == 0
    assert all(t.delta == 0 and t.t == 0 for t in r.tasks)


def test_a_seed_ignoring_challenger_is_held_not_promoted():
    """Every run repeats the baseline's best seed: a large, consistent Δ, but no spread over seeds."""
    data = paired_data(0.0, m=5, n=5)
    for t in data["tasks"]:
        t["challenger"] = [max(t["baseline"])] * 5
    r = evaluate(data)
    assert r.seed_spread is not None and r.seed_spread.held and r.seed_spread.ratio == 0
    from pipeline.lab import parse_config

    cfg = parse_config((Path(__file__).parents[1] / "pipeline" / "templates" / "transactions" / "research.toml").read_text())
    reason = implausible(r, cfg)
    assert reason and "seeds must vary" in reason and "do not vary with the seed" in reason


def test_a_repeated_draw_with_rounding_noise_reads_as_no_spread():
    """The real seed-ignoring branch's runs differ in the last bits (torch sums in another order):
    that is one draw repeated, ratio exactly 0, the same as bit-identical values."""
    data = paired_data(0.0, m=5, n=5)
    for t in data["tasks"]:
        best = max(t["baseline"])
        t["challenger"] = [best * (1 + k * 2.2e-16) for k in range(5)]
    r = evaluate(data)
    assert r.seed_spread is not None and r.seed_spread.held and r.seed_spread.ratio == 0, r.seed_spread


def test_spread_far_below_the_baseline_is_held_too():
    data = paired_data(0.0, m=10, n=10, pair=0.0, seed=5)
    for t in data["tasks"]:
        mean = float(np.mean(t["challenger"]))
        t["challenger"] = [mean + 0.05 * (v - mean) for v in t["challenger"]]  # 5 % of the spread
    r = evaluate(data)
    assert r.seed_spread.held and 0 < r.seed_spread.ratio < 0.05 and r.seed_spread.p_lower < 0.01


def test_an_unmatched_seed_is_dropped_and_said():
    data = paired_data(1.0, m=5, n=5)
    data["tasks"][0]["baseline"][3] = None  # a failed baseline run: seed 3 has no pair on task0
    r = evaluate(data)
    assert r.tasks[0].pairs == 4 and r.tasks[0].pairs_dropped == 1
    assert any("dropped from the paired tests" in x for x in r.reasons)


def test_look_one_without_history_runs_on_and_with_history_can_stop():
    fresh = evaluate(paired_data(-1.0, m=1))
    assert fresh.verdict is Verdict.escalate and any("no variance yet" in x for x in fresh.reasons)
    known = evaluate(paired_data(-1.0, m=1, history=10))
    assert known.verdict in (Verdict.futile, Verdict.harm)  # the history's variance judges one pair
    assert known.horizontal.boundary is None  # but one pair can never promote


def test_the_lazy_baseline_needs_only_the_seeds_the_look_has():
    r = evaluate(paired_data(0.5, m=2, n=2))
    assert r.baseline_runs_used == 2 * len(TASKS)


@pytest.mark.slow
@pytest.mark.parametrize("pair_rho,history_rho", [(0.0, 0.9), (0.95, 0.95), (0.5, 0.0)])
def test_the_error_rate_holds_whatever_this_hypothesis_pairs(pair_rho, history_rho):
    """Also when it pairs far worse than the lab's history (it changes pretraining): the boundaries
    stand on the unpaired bound (earlier arms' spread) and its own pairs, calibrated at pair
    correlation 0; the history of paired differences only decides when to stop."""
    r = simulate(protocol="paired", looks=(1, 2, 5, 10), rho=0.02, pair_rho=pair_rho, history_pair_rho=history_rho,
                 trials=6000, seed=11)
    assert r.improvement_rate <= 0.025 + 3 * r.standard_error(0.025), r.improvement_rate


def arm_history(count: int, seeds: int = 2, seed: int = 5) -> list[dict]:
    """Earlier arms of the lab (other commits): `count` arms of `seeds` runs each, by seed."""
    rng = np.random.default_rng(seed)
    return [{t: list(0.6 + 0.02 * j + SIGMA * rng.standard_normal(seeds)) for j, t in enumerate(TASKS)}
            for _ in range(count)]


def test_the_unpaired_bound_lets_two_pairs_promote_a_clear_gain_and_one_pair_never():
    """A 3σ gain on every task: with the lab's earlier arms behind the bound it is promoted on two
    pairs; one pair never decides (the challenger's own spread is unknown there), and with no
    earlier arm two pairs have 1 df of their own and run on."""
    one = evaluate({**paired_data(3.0, m=1, history=10), "arm_history": arm_history(20)})
    assert one.verdict is Verdict.escalate and one.horizontal.boundary is None
    data = paired_data(3.0, m=2, history=10)
    known = evaluate({**data, "arm_history": arm_history(20)})
    assert known.verdict is Verdict.improvement, known.reasons
    assert known.horizontal.pairs == 2 and known.horizontal.t >= known.horizontal.boundary
    fresh = evaluate(data)
    assert fresh.verdict is not Verdict.improvement


def test_a_variance_study_lets_the_labs_first_hypothesis_promote_a_large_gain_at_two_pairs():
    """No earlier comparison, so no earlier arm: the baseline's runs off the pairs that finished
    before the comparison began (`autoresearch variance`: seeds 2-9 here) are the bound's arm. The
    paired seeds' own baseline runs never are (they make the pairs' variance too)."""
    data = paired_data(3.0, m=2, n=2)
    assert evaluate(data).verdict is not Verdict.improvement  # 1 df of its own: it runs on
    studied = paired_data(3.0, m=2, n=10)
    for task, full in zip(data["tasks"], studied["tasks"]):
        task["history"] = full["history"]  # the baseline's 10 seeds, 2 of them this look's
    r = evaluate(data)
    assert r.verdict is Verdict.improvement and r.horizontal.pairs == 2, r.reasons
    assert r.baseline_runs_used == 2 * len(TASKS)


def test_a_challenger_noisier_than_the_lab_is_held():
    """Its per-seed spread far above the lab's earlier arms' (a branch that makes itself noisier buys
    lottery tickets): a gain it shows is held for review with the reason, never promoted automatically."""
    data = paired_data(6.0, m=5, n=5, history=10)
    rng = np.random.default_rng(4)
    common = 6 * SIGMA * rng.standard_normal(5)  # a seed-level shock on every task: its seeds spread widely
    for t in data["tasks"]:
        t["challenger"] = list(np.array(t["challenger"]) + common)
    r = evaluate({**data, "arm_history": arm_history(20)})
    assert r.seed_spread is not None and r.seed_spread.held, r.seed_spread
    assert r.seed_spread.noisier_ratio > 10 and r.seed_spread.p_upper < 0.01
    assert "noisier than the lab" in r.seed_spread.reason


@pytest.mark.slow
@pytest.mark.parametrize("rho", [0.02, 0.6])
def test_the_error_rate_holds_for_a_challenger_twice_as_noisy(rho):
    """The bound assumes a challenger no noisier than the lab unless its own runs say otherwise: its
    spread over the lab's, pooled across tasks (one df per task at two pairs), scales its arm of the
    bound, and the bound's df shrink to what that ratio is sure of (Satterthwaite, the tasks'
    correlation from the lab's arms). Held results count as improvements here (the strict reading).
    Measured at 20 000 trials: 0.018 (ρ 0.02) and 0.024 (ρ 0.6), were 0.039 and 0.043."""
    r = simulate(protocol="paired", looks=(1, 2, 5, 10), rho=rho, pair_rho=0.0, challenger_sd=2.0,
                 trials=6000, seed=11)
    assert r.improvement_rate <= 0.025 + 3 * r.standard_error(0.025), (r.improvement_rate, r.held_rate)


def test_a_noisier_challengers_bound_grows_and_is_calibrated_on_fewer_df():
    """At two pairs, a challenger whose runs spread 3× the lab's on every task: the pooled ratio sees
    it (8 df, where the horizontal spread alone has 1), the bound carries it, and its df shrink."""
    from pipeline.gate.looks import noise_ratio, paired_tests
    from pipeline.gate.stats import horizontal_values, summarize

    rng = np.random.default_rng(3)
    arms = rng.standard_normal((30, 8, 2))  # the lab: σ 1 on every task
    base = rng.standard_normal((8, 2))
    scale = np.ones(8)
    hb, _ = horizontal_values(base, base, base.mean(axis=-1), scale, 0.125)
    wide = 3.0 * rng.standard_normal((8, 2))
    calm = paired_tests(base, rng.standard_normal((8, 2)), scale, hb, 0.125, None, arms)
    noisy = paired_tests(base, wide, scale, hb, 0.125, None, arms)
    ratio, df = noise_ratio(summarize(wide), np.ones(8))
    assert 3.0 < float(ratio) < 20.0 and float(df) == 8
    assert float(noisy.bound.var) > 1.5 * float(calm.bound.var)
    assert int(noisy.bound.df) < int(calm.bound.df) == 20


def test_the_bound_is_twice_one_arms_spread_and_gives_way_to_the_pairs():
    from pipeline.gate.stats import PAIRED_BOUND_WEIGHT, bound_priors, trimmed_mean

    rng = np.random.default_rng(2)
    arms = rng.standard_normal((400, 8, 5)) * 2.0 + 7.0  # σ 2 on every task, levels centred away
    task, h = bound_priors(arms, np.full(8, 2.0), 0.125, np.full(8, 1), np.array(1))
    assert task.var == pytest.approx(np.full(8, 8.0), rel=0.05)  # 2·σ²
    one_arm = np.var(trimmed_mean(rng.standard_normal((50000, 8)), trim=0.125))  # a seed's value, σ units
    assert float(h.var) == pytest.approx(2 * one_arm, rel=0.1)
    assert int(h.df) == PAIRED_BOUND_WEIGHT and float(h.weight) == PAIRED_BOUND_WEIGHT
    _, h10 = bound_priors(arms, np.full(8, 2.0), 0.125, np.full(8, 10), np.array(10))
    assert float(h10.weight) == 2  # ⌈20 / 10⌉: at 10 pairs their own 9 df carry the variance


def test_a_challenger_as_noisy_as_its_baseline_is_not_called_noisier_because_the_labs_few_arms_were_quiet():
    """benchmarks/planted.py lost a 3.2σ gain this way: the lab's 2 earlier arms happened to spread
    half as much as this comparison's baseline, the noise ratio against them alone read 2.1× for a
    challenger no noisier than its baseline, and the widened bound hid the gain. The ratio's reference
    pools the arms with the baseline's own runs, each by its df; a challenger truly noisier than both
    is still seen."""
    from pipeline.gate.looks import _reference_spread, noise_ratio, paired_tests
    from pipeline.gate.stats import Prior, horizontal_values, summarize

    rng = np.random.default_rng(8)
    quiet = 0.5 * rng.standard_normal((2, 8, 2))  # the lab: 2 arms of 2 seeds, σ 0.5
    base = rng.standard_normal((8, 10))  # this baseline: σ 1, 10 seeds
    scale = np.ones(8)
    hb, _ = horizontal_values(base, base, base.mean(axis=-1), scale, 0.125)
    prior = Prior(var=np.full(8, 0.5), df=np.full(8, 2), weight=np.full(8, 2.0))
    ref = _reference_spread(prior, summarize(base))
    want = (2 * 0.25 + summarize(base).ss) / (2 + 9)
    assert ref == pytest.approx(want)
    assert _reference_spread(Prior(var=np.zeros(8), df=np.zeros(8, int), weight=np.zeros(8)),
                             summarize(base)) == pytest.approx(summarize(base).var)  # no lab arm: the baseline's
    like = rng.standard_normal((8, 10))  # as noisy as its baseline
    loud = 3.0 * rng.standard_normal((8, 10))
    calm = paired_tests(base, like, scale, hb, 0.125, None, quiet)
    noisy = paired_tests(base, loud, scale, hb, 0.125, None, quiet)
    assert float(noisy.bound.var) > 2.0 * float(calm.bound.var)
    # against the quiet arms alone the same challenger reads ~4× as noisy; against the pooled reference, ~1×
    assert float(noise_ratio(summarize(like), np.full(8, 0.25))[0]) > 3.0
    assert float(noise_ratio(summarize(like), ref)[0]) < 1.5
