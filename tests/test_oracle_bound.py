"""benchmarks/oracle_bound.py: the known-variance bound on what any paired gate can bank is computed right.

Its two pieces are checked against independent computations: the variance of the per-seed
horizontal paired difference against loop_quality's own noise model drawn by Monte Carlo, and the
z boundaries against the normal distribution (one look) and against the α they must spend.
"""

import math
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import loop_quality as lq  # noqa: E402
import oracle_bound as ob  # noqa: E402


@pytest.mark.parametrize("rho", [0.02, 0.6])
def test_pair_sd_matches_the_noise_model(rho):
    pair = np.array([0.52, 0.94, 0.76, 0.78, 0.79, 0.93, 0.59, 0.89])
    rng = np.random.default_rng(3)
    base = lq.draw_noise(rng, 4000, 8, 20, rho)
    chal = lq.paired_noise(rng, base, np.broadcast_to(pair, (4000, 8)), rho)
    drawn = (chal - base).mean(axis=1).std()
    assert ob.pair_sd(pair, rho) == pytest.approx(drawn, rel=0.02)
    # pairing helps: the sd is below the unpaired one, √(2/J·(1 + (J-1)ρ))
    assert ob.pair_sd(pair, rho) < math.sqrt(2 / 8 * (1 + 7 * rho))


def test_one_look_boundary_is_the_normal_quantile():
    upper = ob.z_boundaries((4,), "pocock", futility_p=0.3, alpha=0.025)
    assert upper[0] == pytest.approx(stats.norm.isf(0.025), abs=0.01)


def test_boundaries_spend_alpha_with_binding_futility():
    looks, alpha, fut = (1, 2, 5, 10), 0.01, 0.3
    upper = ob.z_boundaries(looks, "pocock", fut, alpha)
    zf = ob.futility_z(looks, fut, None)
    rng = np.random.default_rng(11)  # fresh null paths, not the calibration's
    m = np.array(looks, float)
    z = np.cumsum(rng.standard_normal((400_000, 4)) * np.sqrt(np.diff(np.concatenate([[0.0], m]))), axis=1) / np.sqrt(m)
    alive, crossed = np.ones(len(z), bool), np.zeros(len(z), bool)
    for k in range(4):
        up = alive & (z[:, k] >= upper[k])
        crossed |= up
        alive &= ~up & (z[:, k] > zf[k])
    assert crossed.mean() == pytest.approx(alpha, abs=0.0015)
    # look 1 has no earlier look and no futility before it: its boundary is the normal quantile of
    # the α that Pocock spending gives its information fraction
    first = ob.spending("pocock", np.array([looks[0] / looks[-1]]), alpha)[0]
    assert upper[0] == pytest.approx(stats.norm.isf(first), abs=0.02)


@pytest.mark.parametrize("rho", [0.02, 0.6])
def test_look2_ceiling_is_the_power_of_a_z_test_on_two_unpaired_pairs(rho):
    """The look-2 ceiling of issue 34 against a Monte Carlo of loop_quality's noise: two challenger
    runs 2σ up on every task, paired with no correlation (the case a gate must survive), judged by a
    one-look z on the plain mean over tasks with the unpaired variance known."""
    pair = np.array([0.52, 0.94, 0.76, 0.78, 0.79, 0.93, 0.59, 0.89])
    alpha = 0.01
    c = ob.look2_ceiling(pair, rho, alpha)
    rng = np.random.default_rng(5)
    n = 200_000
    base = lq.draw_noise(rng, n, 8, 2, rho)
    chal = 2.0 + lq.draw_noise(rng, n, 8, 2, rho)
    h = (chal - base).mean(axis=1).mean(axis=1)  # per hypothesis: the mean over 2 seeds of the mean over tasks
    z = h / (ob.pair_sd(np.zeros(8), rho) / math.sqrt(2))
    drawn = (z >= stats.norm.isf(alpha)).mean()
    assert c["power_unpaired"] == pytest.approx(drawn, abs=0.005)
    assert c["power_known_pairing"] > c["power_unpaired"]  # pairing the oracle is told of helps
    # the α look 2 needs for 90 % under the unpaired variance gives exactly that power
    assert stats.norm.cdf(c["z_unpaired"] - stats.norm.isf(c["alpha_needed"])) == pytest.approx(0.90)
