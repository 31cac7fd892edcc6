"""Error control across the stream (issue 34, item 2): `[gate] online_fdr = "lond"` gives the i-th
comparison of the lab the level α_i = min(alpha, fdr · γ_i · (D + 1)), once, in the store.

Through the real measurement API on a simulated lab: runs queued by `queue_look`, finished through
the real queue with planted values, judged by `Experiment.judge_look` (the real gate).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from pipeline.gate.online_fdr import gamma, lond_alpha, lord_alpha
from support.lab import set_research
from test_in_flight import effect_branches, sim_lab

pytestmark = pytest.mark.integration


def test_gamma_is_onlinefdrs_lond_sequence_and_alpha_grows_with_discoveries() -> None:
    # R onlineFDR's default for LOND: 0.07720838 * log(max(j, 2)) / (j * exp(sqrt(log(j))))
    assert gamma(1) == pytest.approx(0.07720838 * math.log(2))
    assert gamma(10) == pytest.approx(0.07720838 * math.log(10) / (10 * math.exp(math.sqrt(math.log(10)))))
    assert all(gamma(i + 1) < gamma(i) for i in range(2, 50))
    assert lond_alpha(3, 2, 0.05, 0.025) == pytest.approx(3 * lond_alpha(3, 0, 0.05, 0.025))
    assert lond_alpha(1, 1000, 0.05, 0.025) == 0.025  # never looser than testing it alone


def test_lord_plus_plus_levels_earn_wealth_back_at_each_discovery() -> None:
    """LORD++ (opt-in in the benchmark only): α_i = γ_i·w0 + (fdr − w0)·γ_{i−τ1} + fdr·Σ_{j≥2} γ_{i−τj}."""
    fdr, w0 = 0.05, 0.005  # onlineFDR's default w0 = fdr / 10
    assert lord_alpha(7, [], fdr, 1.0) == pytest.approx(gamma(7) * w0)
    # no discovery: the levels of the whole stream spend at most the initial wealth
    assert sum(lord_alpha(i, [], fdr, 1.0) for i in range(1, 20000)) < w0
    assert lord_alpha(7, [3], fdr, 1.0) == pytest.approx(gamma(7) * w0 + (fdr - w0) * gamma(4))
    assert lord_alpha(7, [3, 5], fdr, 1.0) == pytest.approx(gamma(7) * w0 + (fdr - w0) * gamma(4) + fdr * gamma(2))
    assert lord_alpha(7, [5, 3], fdr, 1.0) == lord_alpha(7, [3, 5], fdr, 1.0)  # the order they are given in
    assert lord_alpha(4, [3, 9], fdr, 1.0) == lord_alpha(4, [3], fdr, 1.0)  # only discoveries before the test
    # unlike LOND's, the level does not decay while discoveries keep coming
    assert lord_alpha(1001, list(range(1, 1001, 10)), fdr, 1.0) > 5 * lond_alpha(1001, 100, fdr, 1.0)
    assert lord_alpha(2, [1], fdr, 0.001) == 0.001  # never looser than the cap (the lab's alpha)
    with pytest.raises(ValueError):
        lord_alpha(3, [], fdr, 1.0, w0=0.06)


def test_each_comparison_gets_its_level_once_and_the_stream_survives_a_restart(tmp_path: Path) -> None:
    from pipeline import experiment, labrepo
    from pipeline.experiment import Experiment
    from pipeline.lab import load_lab
    from pipeline.store import Owner, Result

    root = sim_lab(tmp_path / "lab")
    set_research(root, "baseline_runs = 5", 'baseline_runs = 5\nonline_fdr = "lond"')
    effect_branches(root, {"a": 1.0, "b": 1.0})
    lab = load_lab(root)
    assert lab.config.gate.online_fdr == "lond" and lab.config.gate.fdr == 0.05
    store = experiment.open_store(lab)
    exp = Experiment(lab, store)
    base = "autoresearch/baseline"
    level = {0: 0.50, 1: 0.53, 2: 0.46, 3: 0.56, 4: 0.44}
    wobble = {0: 0.001, 1: -0.001, 2: 0.0, 3: 0.002, 4: -0.002}

    def finish(commit: str, lift: float) -> None:
        sha = labrepo.resolve_commit(lab, commit)
        for claim in store.claim(Owner.current(), 100, commits=[sha]):
            r = claim.run
            value = level[r.seed] + 0.01 * int(r.task[1:]) + lift + (wobble[r.seed] if lift else 0.0)
            assert store.finish(claim, Result(run_id=r.id, commit=sha, task=r.task, seed=r.seed, value=value,
                                              dataset_id="sim-s0"))
        time.sleep(0.01)

    assert exp.stream() == {"procedure": "lond", "fdr": 0.05, "tests": 0, "discoveries": 0,
                            "next_alpha": lond_alpha(1, 0, 0.05, 0.025)}
    exp.queue_look(base, "a", 5)
    finish(base, 0.0)
    finish("a", 0.2)  # a large, steady gain on both tasks: a discovery even at α_1
    first = exp.judge_look(base, "a", 5)
    assert first.alpha == pytest.approx(lond_alpha(1, 0, 0.05, 0.025)) and first.verdict.value == "improvement"
    assert exp.judge_look(base, "a", 5).to_json() == first.to_json()  # judged again: the same level, no new test
    assert exp.stream()["tests"] == 1 and exp.stream()["discoveries"] == 1
    exp.queue_look(base, "b", 2)
    finish("b", 0.0)
    second = exp.judge_look(base, "b", 2)
    assert second.alpha == pytest.approx(lond_alpha(2, 1, 0.05, 0.025))  # D = 1 before it: twice γ_2's share
    store.dispose()
    # a restart: a new handle on the same store finds the same stream and the same levels
    again = Experiment(lab, experiment.open_store(lab))
    assert again.stream() == {"procedure": "lond", "fdr": 0.05, "tests": 2, "discoveries": 1,
                              "next_alpha": lond_alpha(3, 1, 0.05, 0.025)}
    assert again.judge_look(base, "b", 2).alpha == second.alpha
    again.store.dispose()


def test_a_promotion_with_no_replication_asked_any_more_is_a_discovery(tmp_path: Path) -> None:
    """`replicate_runs` lowered to 0 after a comparison's look: the look did not count its improvement
    (a replicated one would have), so the promotion does, once; with `online_fdr = "off"` nothing."""
    from pipeline import experiment
    from pipeline.experiment import Experiment
    from pipeline.lab import load_lab

    root = sim_lab(tmp_path / "lab")
    set_research(root, "baseline_runs = 5", 'baseline_runs = 5\nonline_fdr = "lond"')
    lab = load_lab(root)
    store = experiment.open_store(lab)
    exp = Experiment(lab, store)
    base, chal, other = "b" * 40, "c" * 40, "d" * 40
    store.fdr_test(chal, base, lambda i, d: 0.01)
    store.fdr_test(other, base, lambda i, d: 0.01)
    exp.promoted_unreplicated(base, chal)
    exp.promoted_unreplicated(base, chal)  # the promote node run again after a crash
    assert store.fdr_stream() == (2, 1)
    set_research(root, 'online_fdr = "lond"', 'online_fdr = "off"')
    Experiment(load_lab(root), store).promoted_unreplicated(base, other)
    assert store.fdr_stream() == (2, 1)
    store.dispose()
