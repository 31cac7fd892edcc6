"""Lower-is-better metrics (`[benchmark] higher_is_better = false`, e.g. logloss) end to end.

The gate judges a decrease as an improvement and a rise as a harm; everything a person or the LLM
reads (the gate's evidence, the summary, the digest, status, the re-verification line, the history
shown to the policy, the pictures' axis labels) says that lower is better and calls a decrease an
improvement. The agent-level tests use the real command-harness lab of `autoresearch init --harness
command` (metric logloss, 3 tasks) with gate records made by the real `evaluate`; nothing is trained.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.gate import Verdict, evaluate, render_markdown
from pipeline.gate.power import power

pytestmark = pytest.mark.integration

SIGMA = 0.01
LEVELS = {"default": 0.61, "churn": 0.62, "fraud": 0.59}  # logloss levels of the command lab's tasks


def _pattern(k: int, shift: int) -> list[float]:
    """k residuals with mean 0 and sd 1, rotated: each task's Δ is exactly its planted effect."""
    base = np.linspace(-1.0, 1.0, k)
    return list(np.roll(base / base.std(ddof=1), shift))


def logloss_input(effects: dict[str, float], m: int, n: int = 5, higher_is_better: bool = False,
                  failed: dict[str, list[int]] | None = None, **gate) -> dict:
    """Raw metric values: challenger = baseline level + effect·σ (effect in raw units of σ, so a
    negative effect is a *decrease* of the metric). On unrelated seeds: `sequential` unless `protocol` says."""
    gate.setdefault("protocol", "sequential")
    tasks = []
    for j, (task, eff) in enumerate(effects.items()):
        level = LEVELS[task]
        b = [level + SIGMA * r for r in _pattern(n, j)]
        c: list[float | None] = [level + eff * SIGMA + SIGMA * r for r in _pattern(m, 3 * j + 1)]
        for k in (failed or {}).get(task, []):
            c[k] = None
        tasks.append({"task": task, "baseline": b, "challenger": c, "history": list(b)})
    return {"config": {"higher_is_better": higher_is_better, **gate}, "tasks": tasks}


# ----------------------------------------------------------------------------- the gate


@pytest.mark.parametrize("protocol", ["sequential", "fixed"])
def test_a_lower_logloss_is_an_improvement(protocol):
    r = evaluate(logloss_input({"default": -4.0, "churn": -4.0, "fraud": -4.0}, m=5, protocol=protocol))
    assert r.verdict is Verdict.improvement and r.higher_is_better is False
    for t in r.tasks:
        assert t.delta == pytest.approx(-4 * SIGMA)  # raw Δ: challenger − baseline, a decrease
        assert t.ci_high < 0 and t.t > 0 and "win" in t.flags and "harm" not in t.flags
        assert t.challenger_mean < t.baseline_mean
    assert r.horizontal.delta > 0 and r.horizontal.t >= r.horizontal.boundary  # oriented: + is better


def test_a_higher_logloss_is_a_harm():
    r = evaluate(logloss_input({"default": 4.0, "churn": 4.0, "fraud": 4.0}, m=5))
    assert r.verdict is Verdict.harm
    assert all(t.delta == pytest.approx(4 * SIGMA) and "harm" in t.flags and t.t < 0 for t in r.tasks)
    assert r.horizontal.delta < 0
    assert "the tasks got worse together" in " ".join(r.reasons)


def test_one_task_rising_is_a_harm_on_that_task():
    r = evaluate(logloss_input({"default": -1.0, "churn": 8.0, "fraud": -1.0}, m=5))
    assert r.verdict is Verdict.harm
    assert [t.task for t in r.tasks if "harm" in t.flags] == ["churn"]
    assert any("harm on churn" in reason for reason in r.reasons)


@pytest.mark.parametrize("protocol", ["sequential", "paired"])
def test_lower_is_better_mirrors_higher_is_better_exactly(protocol):
    """The same data negated and judged the other way round: the same t, p, q, MDE and verdict."""
    low = logloss_input({"default": -1.0, "churn": -1.5, "fraud": -0.5}, m=2, protocol=protocol)
    high = {"config": {"higher_is_better": True, "protocol": protocol},
            "tasks": [{k: ([-v for v in t[k]] if isinstance(t[k], list) else t[k]) for k in t} for t in low["tasks"]]}
    a, b = evaluate(low), evaluate(high)
    assert a.verdict is b.verdict is Verdict.escalate
    for x, y in zip(a.tasks, b.tasks):
        assert x.delta == pytest.approx(-y.delta)
        assert (x.t, x.p, x.q) == pytest.approx((y.t, y.p, y.q))
        assert x.mde_next == pytest.approx(y.mde_next) and x.mde_next > 0  # an MDE is a size either way
    assert a.horizontal.delta == pytest.approx(b.horizontal.delta) and a.horizontal.delta > 0
    assert a.horizontal.mde_next == pytest.approx(b.horizontal.mde_next)


def test_worst_case_of_failed_runs_is_the_highest_logloss():
    """A failed run's worst case is its task's *highest* value for a lower-is-better metric."""
    data = logloss_input({"default": -4.0, "churn": -4.0, "fraud": -4.0}, m=5, failed={"default": [0, 1]})
    r = evaluate(data)
    assert r.failures.failed_runs == 2 and r.failures.sensitivity
    worst = max(v for v in data["tasks"][0]["baseline"] + data["tasks"][0]["challenger"] if v is not None)
    filled = dict(data, tasks=[dict(data["tasks"][0], challenger=[worst if v is None else v
                                                                     for v in data["tasks"][0]["challenger"]]),
                               *data["tasks"][1:]])
    # the sensitivity line's verdict is the verdict with the failures scored as that (bad) value
    assert r.failures.sensitivity_verdict is evaluate(filled).verdict
    assert evaluate(filled).tasks[0].delta > r.tasks[0].delta  # filling with the max pulls logloss up


def test_power_takes_a_decrease_as_an_improvement_of_that_size():
    assert power(-0.01, 0.01, 5, 5) == pytest.approx(power(0.01, 0.01, 5, 5))
    assert power(-0.05, 0.01, 5, 5) > 0.99


def test_the_gates_evidence_says_lower_is_better():
    r = evaluate(logloss_input({"default": -4.0, "churn": -4.0, "fraud": -4.0}, m=5))
    md = render_markdown(r)
    assert "lower is better: a negative task Δ (challenger − baseline) is a gain" in md
    assert "the horizontal Δ is oriented so that + is better" in md
    hi = evaluate(logloss_input({"default": 4.0, "churn": 4.0, "fraud": 4.0}, m=5, higher_is_better=True))
    assert "higher is better: a positive task Δ (challenger − baseline) is a gain" in render_markdown(hi)


# ----------------------------------------------------------------------------- pictures


def test_forest_plot_and_progress_chart_label_the_better_side(tmp_path, monkeypatch):
    from agent import pictures

    figs = []
    monkeypatch.setattr(pictures, "_save", lambda fig, path: figs.append(fig) or path)
    r = evaluate(logloss_input({"default": -4.0, "churn": -4.0, "fraud": -4.0}, m=5))
    pictures.draw_forest(r, tmp_path / "f.png", "#1 squares", "logloss")
    tasks_ax, horizontal_ax = figs[0].axes
    assert "Δ logloss (challenger − baseline)" in tasks_ax.get_xlabel()
    assert "lower is better (← better)" in tasks_ax.get_xlabel()
    assert "+ is better" in horizontal_ax.get_xlabel()
    # the improvements lie left of 0 on the task panel, right of 0 on the horizontal one
    assert all(t.delta < 0 for t in r.tasks) and r.horizontal.delta > 0

    hi = evaluate(logloss_input({"default": 4.0, "churn": 4.0, "fraud": 4.0}, m=5, higher_is_better=True))
    pictures.draw_forest(hi, tmp_path / "g.png", "#2", "auc")
    assert "higher is better (better →)" in figs[1].axes[0].get_xlabel()

    point = pictures.Point(1, "squares", "promote", "improvement", 0.61, 0.57, 4.0, (3.0, 5.0), "baseline/v1", None)
    pictures.draw_progress([point], tmp_path / "p.png", "mylab", "logloss", False)
    assert figs[2].axes[0].get_ylabel() == "mean logloss over tasks (lower is better)"


# ----------------------------------------------------------------------------- the agent on a logloss lab


@pytest.fixture()
def svc(tmp_path):
    from support.summary import services

    from agent.labinit import init_lab

    root = init_lab(tmp_path / "lab", harness="command")
    s = services(root)
    yield s
    s.store.engine.dispose()


def _measure(svc, effects: dict[str, float], look: int = 5):
    from support.summary import implemented

    h = implemented(svc)
    cfg = svc.lab.config.gate
    data = logloss_input(effects, m=look)
    data["config"] = cfg.model_dump()
    result = evaluate(data)
    svc.store.put_gate_record(str(h.id), look, result)
    return svc.records.update(h.id, look=look, verdict=result.verdict.value, status="deciding"), result


def test_summary_digest_status_and_history_of_a_logloss_lab(svc, capsys):
    from support.summary import decided

    from agent.commands import digest, status
    from agent.graph import build_context
    from agent.policy_llm import history_table
    from agent.views import digest_markdown, print_status

    assert svc.lab.config.benchmark.metric == "logloss" and svc.lab.config.benchmark.higher_is_better is False
    h, result = _measure(svc, {"default": -8.0, "churn": -8.0, "fraud": -8.0})
    assert result.verdict is Verdict.improvement
    h = decided(svc, h)
    assert h.decision == "promote"

    text = (svc.lab.state / "summaries" / f"{h.id}.md").read_text()
    assert "lower is better" in text
    assert "3 of 3 tasks point toward an improvement (lower logloss)" in text
    assert "a negative task Δ (challenger − baseline) is a gain" in text
    assert "Tasks the gate flags as wins: default, churn, fraud; as harms: none" in text

    # the history the policy (and the LLM) reads: a decrease on every task is 3/3 improved
    svc.records.update(h.id, status="done")
    ctx = build_context(svc)
    assert ctx.metric == "logloss, lower is better"
    (row,) = ctx.history
    assert row["improved"] == "3/3" and float(row["mean_delta"]) == pytest.approx(-0.08)
    assert "| -0.0800 | 3/3 |" in history_table(ctx.history)

    d = digest(svc.lab.root, None, "24h")
    assert d["baseline"]["higher_is_better"] is False
    md = digest_markdown(d)
    assert "mean logloss over tasks" in md and "lower is better" in md

    st = status(svc.lab.root, None)
    assert st["metric"] == {"name": "logloss", "higher_is_better": False}
    print_status(st)
    assert "metric logloss (lower is better)" in capsys.readouterr().out


def test_a_rising_logloss_is_summarised_as_a_harm(svc):
    from support.summary import decided

    h, result = _measure(svc, {"default": 8.0, "churn": 8.0, "fraud": 8.0})
    assert result.verdict is Verdict.harm
    h = decided(svc, h)
    assert h.decision in ("abandon", "refine")
    text = (svc.lab.state / "summaries" / f"{h.id}.md").read_text()
    assert "0 of 3 tasks point toward an improvement (lower logloss)" in text
    assert "as harms: default, churn, fraud" in text


def test_re_verification_of_a_logloss_champion_calls_a_rise_worse(svc, monkeypatch):
    """The champion's fresh seeds come in with a *higher* logloss than the runs it was selected on:
    that is worse on every task (the old line said "3/3 tasks lower", which read as better)."""
    from agent import graph
    from agent.graph import reverification_message
    from pipeline import experiment

    h, _ = _measure(svc, {"default": -8.0, "churn": -8.0, "fraud": -8.0})
    h = svc.records.update(h.id, promoted_tag="baseline/v1")
    tasks = svc.lab.tasks()
    fresh_seeds = list(svc.experiment.baseline_seeds(h.base_commit, gen=svc.experiment.generation(h.base_commit) + 1))
    picked = list(svc.experiment.challenger_seeds(h.base_commit, h.look))

    def plant(fresh_shift: float):
        table = {"NEW": {t: {s: LEVELS[t] + fresh_shift for s in fresh_seeds} for t in tasks},
                 h.commit: {t: {s: LEVELS[t] for s in picked} for t in tasks}}
        monkeypatch.setattr(experiment, "resolve_commit", lambda lab, ref: "NEW")
        monkeypatch.setattr(experiment, "results", lambda store, lab, commit, tasks: table[commit])
        return graph.reverification(svc, h)

    worse = plant(+0.02)
    assert worse["tasks_worse"] == 3 and worse["shrinkage"] == pytest.approx(0.02)
    msg = reverification_message(worse, "logloss", False)
    assert "(+0.0200, worse: lower is better; 3/3 tasks worse)" in msg

    better = plant(-0.02)
    assert better["tasks_worse"] == 0
    assert "(-0.0200, better: lower is better; 0/3 tasks worse)" in reverification_message(better, "logloss", False)
    # the same numbers on a higher-is-better metric read the other way round
    assert "(-0.0200, worse: higher is better" in reverification_message(better, "auc", True)
    assert math.isfinite(better["fresh_mean"])


def test_a_too_good_logloss_is_held_and_a_rise_is_not(svc):
    from pipeline.gate.plausibility import implausible

    cfg = svc.lab.config
    _, leak = _measure(svc, {"default": -55.0, "churn": -55.0, "fraud": -55.0})  # 0.61 → 0.06: near perfect 0
    assert leak.verdict is Verdict.improvement and "distance to the perfect 0" in implausible(leak, cfg)
    _, rise = _measure(svc, {"default": 30.0, "churn": 30.0, "fraud": 30.0})
    assert implausible(rise, cfg) is None
