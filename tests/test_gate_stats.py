"""The vectorised building blocks against textbook implementations."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from pipeline.gate.stats import (
    Prior,
    bh_qvalues,
    history_prior,
    pooled_t,
    summarize,
    trimmed_mean,
    variance_ratio_p,
    welch_t,
)

pytestmark = pytest.mark.unit


def test_pooled_t_is_student_two_sample_t():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(50, 5)), rng.normal(0.3, 1, size=(50, 7))
    got = pooled_t(summarize(x), summarize(y))
    want = stats.ttest_ind(y, x, axis=1, equal_var=True)
    assert got.t == pytest.approx(want.statistic)
    assert got.df == pytest.approx(np.full(50, 10.0))


def test_welch_t_matches_scipy():
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(20, 5)), rng.normal(0, 3, size=(20, 4))
    got = welch_t(summarize(x), summarize(y))
    want = stats.ttest_ind(y, x, axis=1, equal_var=False)
    assert got.t == pytest.approx(want.statistic)
    assert 2 * stats.t.sf(np.abs(got.t), got.df) == pytest.approx(want.pvalue)


def test_nan_runs_are_ignored():
    x = np.array([[1.0, 2.0, np.nan, 3.0]])
    arm = summarize(x)
    assert arm.count[0] == 3 and arm.mean[0] == pytest.approx(2.0) and arm.ss[0] == pytest.approx(2.0)


def test_moderated_variance_adds_prior_weight_and_df():
    x, y = np.array([0.0, 1.0, 2.0]), np.array([1.0, 3.0])
    prior = Prior(var=np.array(4.0), df=np.array(50), weight=np.array(30.0))
    got = pooled_t(summarize(x), summarize(y), prior)
    ss = 2.0 + 2.0
    var = (30 * 4.0 + ss) / (30 + 2 + 1)
    assert got.df == pytest.approx(33.0)
    assert got.se == pytest.approx(np.sqrt(var * (1 / 3 + 1 / 2)))


def test_history_prior_caps_weight_at_30():
    rng = np.random.default_rng(2)
    h = rng.normal(size=(2, 45))
    h[1, 10:] = np.nan  # 10 runs on the second task
    p = history_prior(h, (2,))
    assert list(p.df) == [44, 9] and list(p.weight) == [30.0, 9.0]
    assert p.var[0] == pytest.approx(np.var(h[0], ddof=1))


def test_the_25_percent_trimmed_mean_matches_scipy_and_ignores_nan():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(100, 8))
    assert trimmed_mean(x, -1, 0.25) == pytest.approx(stats.trim_mean(x, 0.25, axis=1))
    y = x.copy()
    y[:, 3] = np.nan
    want = [np.average(np.sort(r[np.isfinite(r)]), weights=[0, 0.25, 1, 1, 1, 0.25, 0]) for r in y]
    assert trimmed_mean(y, -1, 0.25) == pytest.approx(want)


def test_the_trimmed_mean_ignores_one_huge_value():
    x = np.array([0.1, -0.2, 0.0, 0.3, -0.1, 0.2, -0.3, 0.05])
    big = x.copy()
    big[0] = 1e6
    assert abs(trimmed_mean(big, -1, 0.25) - trimmed_mean(x, -1, 0.25)) < 0.2


def bh_reference(p: list[float]) -> list[float]:
    """Benjamini-Hochberg adjusted p-values, the textbook loop."""
    m = len(p)
    order = sorted(range(m), key=lambda i: p[i])
    q = [0.0] * m
    prev = 1.0
    for rank in range(m, 0, -1):
        i = order[rank - 1]
        prev = min(prev, p[i] * m / rank)
        q[i] = prev
    return q


def test_bh_qvalues_match_reference_and_skip_nan():
    rng = np.random.default_rng(4)
    for _ in range(20):
        p = list(rng.uniform(0, 0.2, size=9))
        assert bh_qvalues(np.array(p)) == pytest.approx(bh_reference(p))
    q = bh_qvalues(np.array([0.01, np.nan, 0.04, 0.03]))
    assert np.isnan(q[1]) and q[[0, 2, 3]] == pytest.approx(bh_reference([0.01, 0.04, 0.03]))


def test_variance_ratio_p_is_the_f_test():
    rng = np.random.default_rng(5)
    y = rng.normal(0, 3, size=6)
    p = variance_ratio_p(np.array(1.5), np.array(9), summarize(y))
    assert p == pytest.approx(stats.f.sf(np.var(y, ddof=1) / 1.5, 5, 9))


def test_trimmed_mean_matches_scipy_and_bounds_one_task():
    from pipeline.gate.stats import trimmed_mean

    rng = np.random.default_rng(3)
    x = rng.normal(size=(50, 8))
    assert trimmed_mean(x, trim=0.125) == pytest.approx(stats.trim_mean(x, 0.125, axis=1))
    assert trimmed_mean(x, trim=0.0) == pytest.approx(x.mean(axis=1))
    big = x.copy()
    big[:, 0] = 100.0
    # one task moved to +100 moves the statistic no further than the other tasks' largest value
    assert np.all(trimmed_mean(big, trim=0.125) <= x[:, 1:].max(axis=1) + 1e-12)
    with pytest.raises(ValueError):
        trimmed_mean(x, trim=0.5)


@pytest.mark.parametrize("values,trim,want", [
    ([1.0, 3.0], 0.125, 2.0),                                  # two tasks: the plain mean
    ([0.0, 1.0, 5.0], 0.125, (0.0 * 5 + 1.0 * 8 + 5.0 * 5) / 18),  # three: weights 5/18, 8/18, 5/18
    ([0.0, 1.0, 2.0, 9.0], 0.125, (0.0 + 2 * 1.0 + 2 * 2.0 + 9.0) / 6),  # four: 1/6, 1/3, 1/3, 1/6
    ([0.0, np.nan, 1.0, 2.0, 9.0], 0.125, (0.0 + 2 * 1.0 + 2 * 2.0 + 9.0) / 6),  # NaN left out
    ([np.nan, np.nan], 0.125, np.nan),
])
def test_trimmed_mean_at_few_tasks(values, trim, want):
    from pipeline.gate.stats import trimmed_mean

    got = float(trimmed_mean(np.array(values), trim=trim))
    assert (np.isnan(got) and np.isnan(want)) or got == pytest.approx(want)
