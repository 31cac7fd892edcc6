"""Modest-trial checks of the simulator; the 200 000-trial numbers live in benchmarks/gate_sim.py.

Tolerances: a rate estimated from N trials has SE = sqrt(p(1-p)/N); bounds are the target plus
4 SE (a false alarm about once in 30 000 runs of this test, and the simulation is seeded anyway).
"""

from __future__ import annotations

import math

import numpy as np

import pytest

from pipeline.errors import UserError
from pipeline.gate.sim import simulate

pytestmark = pytest.mark.unit

N = 20_000
ALPHA = 0.025


def limit(p: float, n: int = N) -> float:
    return p + 4 * math.sqrt(p * (1 - p) / n)


@pytest.mark.slow
@pytest.mark.parametrize("rho", [0.0, 0.6])
def test_sequential_false_positive_rates_stay_within_alpha(rho):
    r = simulate(protocol="sequential", rho=rho, trials=N, seed=101)
    assert r.improvement_rate <= limit(ALPHA)
    assert r.horizontal_rate_all_looks <= limit(ALPHA)
    # per task: 8 tasks per trial, so at least N independent-enough draws; keep the conservative SE
    assert r.per_task_rate_all_looks <= limit(ALPHA)
    assert r.mean_challenger_runs <= 4.0
    assert r.to_json()["false_positive_rate"] == r.improvement_rate


@pytest.mark.slow
def test_fixed_protocol_inflates_the_per_task_rate():
    r = simulate(protocol="fixed", trials=N, seed=102)
    assert r.per_task_rate_all_looks > limit(ALPHA)


def test_one_huge_task_is_not_a_horizontal_improvement():
    r = simulate(protocol="sequential", effect=10.0, affected=1, trials=N, seed=103)
    assert r.improvement_rate <= limit(ALPHA)
    assert r.per_task_rate > 0.95  # the task itself is found
    assert r.verdict_rates["single_task"] > 0.8


def test_power_at_two_sigma_with_up_to_ten_runs():
    r = simulate(protocol="sequential", effect=2.0, tasks=1, trials=N, seed=104)
    assert r.improvement_rate >= 0.88 - 4 * math.sqrt(0.88 * 0.12 / N)
    assert "power" in r.to_json()


def test_seeded_simulation_is_reproducible():
    a = simulate(trials=3000, seed=5, chunk=1000)
    b = simulate(trials=3000, seed=5, chunk=1000)
    assert a == b


@pytest.mark.parametrize(
    "kwargs",
    [dict(rho=1.0), dict(protocol="bayes"), dict(tasks=0), dict(alpha=0.7), dict(looks=(5, 2)), dict(affected=9)],
)
def test_bad_settings_are_user_errors(kwargs):
    with pytest.raises(UserError) as e:
        simulate(trials=10, **kwargs)
    assert isinstance(e.value, UserError)


@pytest.mark.slow
@pytest.mark.parametrize("protocol,hib,trim,tasks", [("sequential", True, 0.125, 8), ("sequential", False, 0.25, 3),
                                                     ("fixed", True, 0.125, 4)])
def test_look_path_judges_every_look_as_evaluate_does(protocol, hib, trim, tasks):
    """The simulator's batched looks are the gate's: verdict and horizontal Δ equal `evaluate`'s at each look."""
    from pipeline.gate import evaluate
    from pipeline.gate.sim import look_path
    from pipeline.gate.verdict import ORDER

    rng = np.random.default_rng(11)
    b, n, looks = 40, 5, (2, 4, 6)
    effect = rng.choice([0.0, 0.8, 2.0], size=(b, 1, 1))
    base = rng.normal(size=(b, tasks, n))
    chal = rng.normal(size=(b, tasks, looks[-1])) + effect
    sign = 1.0 if hib else -1.0
    path = look_path(protocol, base, chal, looks, horizontal_trim=trim)
    for i in range(b):
        for k, m in enumerate(looks):
            r = evaluate({
                "config": {"protocol": protocol, "baseline_runs": n, "looks": list(looks), "horizontal_trim": trim,
                           "higher_is_better": hib},
                "tasks": [{"task": f"t{j}", "baseline": list(sign * base[i, j]), "challenger": list(sign * chal[i, j, :m])}
                          for j in range(tasks)],
                "looks_done": [x for x in looks if x < m], "at_look": True,
            })
            assert r.verdict == ORDER[path.codes[i, k]], (i, k)
            assert r.horizontal.delta == pytest.approx(path.horizontal_delta[i, k])
