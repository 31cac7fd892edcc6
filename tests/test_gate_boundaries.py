"""Lan-DeMets O'Brien-Fleming boundaries calibrated on the t scale."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from scipy import stats

from pipeline.gate.boundaries import (
    fixed_boundaries,
    information_fractions,
    obf_spending,
    sequential_boundaries,
)

pytestmark = pytest.mark.unit


def test_spending_function_shape():
    t = np.linspace(0.05, 1, 40)
    s = obf_spending(t, 0.025)
    assert np.all(np.diff(s) > 0)
    assert s[-1] == pytest.approx(0.025, abs=1e-12)
    # O'Brien-Fleming shape: almost nothing early
    assert obf_spending(0.25, 0.025) < 1e-4


def test_information_fractions_of_default_plan():
    # 5 baseline runs: information 1/(1/5 + 1/m) at m = 2, 5, 10
    f = information_fractions(5, (2, 5, 10), 10)
    assert f == pytest.approx([(1 / 0.7) / (1 / 0.3), (1 / 0.4) / (1 / 0.3), 1.0])


@pytest.mark.parametrize("prior_df,weight", [(0, 0.0), (9, 9.0), (60, 30.0)])
def test_boundaries_monotone_and_spend_exactly_alpha(prior_df, weight):
    b = sequential_boundaries(5, (2, 5, 10), 10, 0.025, prior_df, weight)
    assert sum(b.increments) == pytest.approx(0.025, abs=1e-12)
    assert b.spent[-1] == pytest.approx(0.025, abs=1e-12)
    assert all(i > 0 for i in b.increments)
    assert list(b.upper) == sorted(b.upper, reverse=True)  # the bar lowers as information grows
    assert list(b.nominal) == sorted(b.nominal)
    assert b.nominal[-1] < 0.025  # the price of the interim looks


def null_crossings(n: int, looks: tuple[int, ...], upper: tuple[float, ...], sims: int, seed: int) -> np.ndarray:
    """First-crossing frequencies of the plain pooled t at each look, from raw simulated runs."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((sims, n))
    y = rng.standard_normal((sims, looks[-1]))
    alive = np.ones(sims, bool)
    out = []
    for m, u in zip(looks, upper):
        t = stats.ttest_ind(y[:, :m], x, axis=1, equal_var=True).statistic
        hit = alive & (t >= u)
        out.append(hit.mean())
        alive &= ~hit
    return np.array(out)


@pytest.mark.slow
def test_boundaries_hold_alpha_on_independent_simulation():
    """Raw runs (not the calibrator's sufficient statistics), another seed: each look's crossing
    probability matches the α spent there within 4 binomial standard errors."""
    b = sequential_boundaries(5, (2, 5, 10), 10, 0.025)
    sims = 200_000
    got = null_crossings(5, b.looks, b.upper, sims, seed=7)
    for g, want in zip(got, b.increments):
        assert abs(g - want) <= 4 * math.sqrt(want * (1 - want) / sims) + 1e-5
    total_se = math.sqrt(0.025 * 0.975 / sims)
    assert abs(got.sum() - 0.025) <= 4 * total_se


def test_fixed_boundaries_inflate_on_the_same_simulation():
    b = fixed_boundaries(5, (2, 5, 10), 0.025)
    assert b.upper == pytest.approx([stats.t.isf(0.025, df) for df in (5, 8, 13)])
    got = null_crossings(5, b.looks, b.upper, 100_000, seed=8)
    assert got.sum() > 0.025 + 4 * math.sqrt(0.025 * 0.975 / 100_000)


def test_large_df_first_look_is_normal_theory():
    # with plenty of df the t boundary of the first look is the z quantile of the α spent there
    b = sequential_boundaries(200, (200, 400, 600), 600, 0.025, 1000, 1000.0)
    assert b.upper[0] == pytest.approx(stats.norm.isf(b.spent[0]), abs=0.03)


def test_unplanned_look_recomputes_from_spending_function():
    planned = sequential_boundaries(5, (2, 5), 10, 0.025)
    unplanned = sequential_boundaries(5, (2, 4), 10, 0.025)
    assert unplanned.spent[1] == pytest.approx(float(obf_spending(information_fractions(5, (2, 4), 10)[1], 0.025)))
    assert unplanned.spent[1] < planned.spent[1]
    assert unplanned.upper[1] > planned.upper[1]
    beyond = sequential_boundaries(5, (2, 5, 10, 12), 10, 0.025)
    assert beyond.spent[-1] == pytest.approx(0.025) and beyond.fractions[-1] == 1.0


def test_boundaries_are_cached():
    sequential_boundaries(5, (2, 5, 10), 10, 0.025, 4, 4.0)
    t0 = time.perf_counter()
    a = sequential_boundaries(5, (2, 5, 10), 10, 0.025, 4, 4.0)
    b = sequential_boundaries(5, (2, 5, 10), 10, 0.025, 4, 4.0)
    assert a is b and time.perf_counter() - t0 < 0.01
