"""`evaluate` on constructed datasets: every verdict, failed-run rules, flags and orientation.

The datasets use exact residual patterns (mean 0, sd 1 within each arm and task, rotated across
tasks) so each task's Δ is exactly the planted effect and no verdict hangs on a random draw.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from pipeline.errors import UserError
from pipeline.gate import GateInput, TaskRuns, Verdict, evaluate
from pipeline.gate.stats import bh_qvalues

pytestmark = pytest.mark.unit

SIGMA = 0.01
LEVELS = [0.62, 0.71, 0.78, 0.81, 0.84, 0.88, 0.90, 0.93]  # tasks at different AUC levels


def pattern(k: int, shift: int) -> list[float]:
    """k residuals with mean 0 and sd 1, rotated by `shift` (different per task)."""
    base = np.linspace(-1.0, 1.0, k) if k > 1 else np.zeros(1)
    if k > 1:
        base = base / base.std(ddof=1)
    return list(np.roll(base, shift))


def dataset(
    effects: list[float],
    m: int,
    n: int = 5,
    failed: dict[int, list[int]] | None = None,
    chal_sd: list[float] | None = None,
    sign: float = 1.0,
    **gate,
) -> dict:
    """Tasks with the given effects (in σ units, + = better), m challenger and n baseline runs, on
    unrelated seeds (the two-sample protocols' verdict table: `sequential` unless `protocol` says;
    the paired protocol's verdicts are tests/test_gate_paired.py's)."""
    gate.setdefault("protocol", "sequential")
    tasks = []
    for j, eff in enumerate(effects):
        level = LEVELS[j % len(LEVELS)]
        sd = SIGMA * (chal_sd[j] if chal_sd else 1.0)
        b = [level + sign * SIGMA * r for r in pattern(n, j)]
        c = [level + sign * (eff * SIGMA + sd * r) for r in pattern(m, 3 * j + 1)]
        for k in (failed or {}).get(j, []):
            c[k] = None
        tasks.append({"task": f"task{j}", "baseline": b, "challenger": c, "history": list(b)})
    return {"config": {"higher_is_better": sign > 0, **gate}, "tasks": tasks}


def test_improvement_when_all_tasks_improve():
    r = evaluate(dataset([3.0] * 8, m=5))
    assert r.verdict is Verdict.improvement and r.is_look
    assert r.horizontal.t >= r.horizontal.boundary
    assert all(t.delta == pytest.approx(3 * SIGMA) for t in r.tasks)


def test_escalate_when_promising_but_no_boundary_yet():
    r = evaluate(dataset([1.0] * 8, m=2))
    assert r.verdict is Verdict.escalate
    assert r.horizontal.p_one_sided < 0.30 and r.horizontal.t < r.horizontal.boundary
    assert r.next_look == 5 and r.horizontal.mde_next is not None and all(t.mde_next for t in r.tasks)


def test_futile_when_not_promising_at_an_interim_look():
    r = evaluate(dataset([-0.5] * 8, m=2))
    assert r.verdict is Verdict.futile
    assert r.horizontal.p_one_sided >= 0.30


def test_inconclusive_at_the_last_look_without_a_boundary():
    r = evaluate(dataset([0.1] * 8, m=10))
    assert r.verdict is Verdict.inconclusive and r.last_look and r.next_look is None
    assert r.horizontal.mde_next is None


def test_harm_when_one_task_gets_clearly_worse():
    r = evaluate(dataset([0.0] * 7 + [-6.0], m=5))
    assert r.verdict is Verdict.harm
    assert [t.task for t in r.tasks if "harm" in t.flags] == ["task7"]


def test_harm_overrides_a_horizontal_improvement():
    r = evaluate(dataset([3.0] * 7 + [-8.0], m=10))
    assert r.horizontal.t >= r.horizontal.boundary
    assert r.verdict is Verdict.harm


@pytest.mark.parametrize("m", [2, 5, 10])
def test_one_task_improving_hugely_is_not_horizontal(m):
    """One task +50σ, seven exactly unchanged: never `improvement`; at the last look a single-task win."""
    r = evaluate(dataset([50.0] + [0.0] * 7, m=m))
    assert r.verdict is not Verdict.improvement
    assert r.horizontal.breadth_task == "task0" and r.horizontal.breadth_required
    if m == 10:
        assert r.verdict is Verdict.single_task
        assert [t.task for t in r.tasks if "win" in t.flags] == ["task0"]


def test_single_task_at_the_last_look():
    r = evaluate(dataset([6.0] + [0.0] * 7, m=10))
    assert r.verdict is Verdict.single_task


def test_bh_on_both_tails_flags_wins_and_harms():
    r = evaluate(dataset([5.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0, -5.0], m=10))
    flags = {t.task: t.flags for t in r.tasks}
    assert "win" in flags["task0"] and "win" in flags["task1"] and "harm" in flags["task7"]
    assert not any(f in flags[f"task{j}"] for j in range(2, 7) for f in ("win", "harm"))
    q = bh_qvalues(np.array([t.p for t in r.tasks]))
    assert [t.q for t in r.tasks] == pytest.approx(list(q))
    assert r.verdict is Verdict.harm


def test_two_failed_runs_make_a_look_not_promising():
    r = evaluate(dataset([3.0] * 8, m=5, failed={0: [1], 3: [4]}))
    assert r.failures.failed_runs == 2 and r.failures.not_promising
    assert r.verdict is Verdict.futile
    assert r.failures.sensitivity and "worst case" in r.failures.sensitivity
    assert r.failures.sensitivity_verdict is not None


def test_one_failed_run_is_reported_with_a_worst_case_line():
    r = evaluate(dataset([3.0] * 8, m=5, failed={2: [0]}))
    assert r.failures.failed_runs == 1 and not r.failures.not_promising
    assert r.verdict is Verdict.improvement
    assert r.failures.sensitivity_verdict is Verdict.improvement
    assert r.tasks[2].challenger_runs == 4 and r.tasks[2].failed_runs == 1
    assert r.challenger_runs_used == 40


def test_worst_case_sensitivity_can_change_the_verdict():
    # one task: its failed run scored as the worst value seen drags the improvement below the bar
    r = evaluate(dataset([3.0], m=5, failed={0: [2]}))
    assert r.verdict is Verdict.improvement
    assert r.failures.sensitivity_verdict is Verdict.escalate
    assert "→ escalate" in r.failures.sensitivity
    # the failed run adds no information: the task's schedule is (2, 4) successful runs
    assert r.tasks[0].challenger_runs == 4


def test_failed_runs_stay_failed_between_looks_and_count_once():
    data = dataset([0.0] * 8, m=5, failed={1: [0, 2]})
    r = evaluate(data)
    assert r.failures.failed_runs == 2 and r.verdict is Verdict.futile


def test_unstable_challenger_is_flagged_with_welch_beside():
    r = evaluate(dataset([1.0] * 8, m=10, chal_sd=[8.0] + [1.0] * 7))
    t0 = r.tasks[0]
    assert "unstable" in t0.flags and t0.variance_ratio_p < 0.05
    assert t0.welch is not None and t0.welch.p is not None and t0.welch.df < 13
    assert all("unstable" not in t.flags for t in r.tasks[1:])


def test_lower_is_better_metrics_are_oriented():
    r = evaluate(dataset([3.0] * 8, m=5, sign=-1.0))
    assert r.verdict is Verdict.improvement
    assert all(t.delta == pytest.approx(-3 * SIGMA) for t in r.tasks)
    assert all(t.ci_high < 0 for t in r.tasks)


def test_between_looks_has_estimates_but_no_verdict_or_labels():
    data = dataset([3.0] * 8, m=3)
    r = evaluate(data)
    assert not r.is_look and r.verdict is None and r.reasons == []
    assert all(not ({"win", "harm"} & set(t.flags)) for t in r.tasks)
    assert all(t.ci_low is not None and t.delta is not None for t in r.tasks)
    # a pending run (shorter list) also means between looks
    data = dataset([3.0] * 8, m=5)
    data["tasks"][0]["challenger"] = data["tasks"][0]["challenger"][:4]
    assert evaluate(data).verdict is None


def test_unplanned_look_recomputes_boundaries():
    data = dataset([3.0] * 8, m=4)
    data["at_look"] = True
    r = evaluate(data)
    assert r.is_look and r.looks_done == [2, 4] and r.verdict is not None
    planned = evaluate(dataset([3.0] * 8, m=5))
    assert r.horizontal.boundary > planned.horizontal.boundary


def test_fixed_protocol_uses_nominal_per_task_tests():
    r = evaluate(dataset([4.0] + [0.0] * 7, m=2, protocol="fixed"))
    t0 = r.tasks[0]
    assert t0.p == pytest.approx(t0.p_nominal) and t0.p_nominal < 0.05 and "win" in t0.flags
    seq = evaluate(dataset([4.0] + [0.0] * 7, m=2))
    assert "win" not in seq.tasks[0].flags  # the same data is far from a sequential boundary at look 1


def test_moderated_variance_uses_history_once():
    data = dataset([1.0] * 8, m=5)
    for j, t in enumerate(data["tasks"]):
        t["history"] = t["baseline"] + [LEVELS[j] + SIGMA * r for r in pattern(12, j)]
    r = evaluate(data)
    assert all(t.prior_df == 11 for t in r.tasks)
    runs = TaskRuns(**data["tasks"][0])
    assert len(runs.extra_history()) == 12
    capped = dataset([1.0] * 8, m=5)
    for j, t in enumerate(capped["tasks"]):
        t["history"] = [LEVELS[j] + SIGMA * r for r in pattern(40, j)]
    r = evaluate(capped)
    assert all(t.prior_df == 39 for t in r.tasks)
    assert all(t.df == pytest.approx(30 + 4 + 4) for t in r.tasks)  # prior weight capped at 30 df


def test_record_is_json_safe_and_round_trips():
    r = evaluate(dataset([3.0] * 8, m=5, failed={0: [0]}))
    text = json.dumps(r.model_dump(mode="json"), allow_nan=False)
    again = type(r).model_validate(json.loads(text))
    assert again == r


def test_bad_input_is_a_user_error():
    with pytest.raises(UserError) as e:
        evaluate({"tasks": [{"task": "a", "baseline": [0.8], "challenger": [0.8, 0.81]}]})
    assert isinstance(e.value, UserError) and "baseline" in str(e.value)
    with pytest.raises(UserError):
        evaluate({"tasks": [{"task": "a", "baseline": [0.8, 0.7], "challenger": [math.inf]}]})
    with pytest.raises(UserError):
        evaluate({"tasks": [{"task": "a", "baseline": [0.8, 0.7], "challenger": [0.8]}] * 2})
    assert isinstance(GateInput.model_validate(dataset([0.0] * 2, m=2)), GateInput)


def test_config_from_research_toml():
    from pipeline.gate import GateConfig
    from pipeline.lab import LabConfigError, parse_config

    lab = parse_config(
        '[lab]\nname = "x"\neditable = ["model.py"]\n[benchmark]\nhigher_is_better = false\n'
        '[[stage]]\nname = "finetune"\nrun = "python train.py --out {out}"\n'
        '[gate]\nprotocol = "fixed"\nlooks = [2, 4, 8]\n'
    )
    cfg = lab.gate
    assert isinstance(cfg, GateConfig)  # one model of [gate], for the lab and the gate
    assert cfg.protocol == "fixed" and cfg.looks == (2, 4, 8) and cfg.higher_is_better is False
    with pytest.raises(LabConfigError, match=r"gate\.higher_is_better.*\[benchmark\]"):
        parse_config('[lab]\nname = "x"\neditable = ["model.py"]\n[[stage]]\nname = "f"\nrun = "true {out}"\n'
                     '[gate]\nhigher_is_better = false\n')


def test_task_without_challenger_runs_yet_has_no_test():
    data = dataset([1.0, 1.0], m=2)
    data["tasks"][1]["challenger"] = []
    r = evaluate(data)
    assert r.verdict is None and r.tasks[1].t is None and r.tasks[1].df is None and r.tasks[1].q is None
