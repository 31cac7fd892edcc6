"""The noise study (issue 34, item 3): a lab's first comparison waits for `[gate] noise_runs`
baseline runs per task, so its first looks stand on a measured noise instead of one pair's 1 df.

Real parts: git, SQLite, the simulated lab's research.toml, the store's queue, the real gate
(`Experiment.judge_look`); the values are planted through the real queue, as in test_online_fdr.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from support.lab import set_research
from test_in_flight import effect_branches, sim_lab

pytestmark = pytest.mark.integration


@pytest.mark.unit
def test_noise_runs_default_to_five_within_the_baseline_and_a_bad_value_is_one_clear_error() -> None:
    from pipeline.gate.inputs import GateConfig

    assert GateConfig().noise_runs == 5
    assert GateConfig(baseline_runs=4, looks=(1, 2, 4)).noise_runs == 4
    assert GateConfig(baseline_runs=3, looks=(1, 3)).noise_runs == 0  # too few to add anything: no wait
    assert GateConfig(noise_runs=0).noise_runs == 0
    for bad in ({"noise_runs": 3}, {"noise_runs": 6, "baseline_runs": 5, "looks": (1, 2, 5)}):
        with pytest.raises(ValueError, match="noise_runs"):
            GateConfig(**bad)
    # TOML's 10.0 is 10 runs, and its default study 5 (not a complaint about a key the user never set)
    assert GateConfig(baseline_runs=10.0).noise_runs == 5
    assert GateConfig(baseline_runs=3.0, looks=(1, 3)).noise_runs == 0
    # a study asked of a baseline too small for one says so, not "4 to 3"
    with pytest.raises(ValueError, match=r"baseline_runs 3 is under 4, too few for a noise study\), got 4"):
        GateConfig(baseline_runs=3, looks=(1, 3), noise_runs=4)
    # the two-sample protocols run every baseline seed up front: no study, and a set key is not checked
    assert GateConfig(protocol="sequential", looks=(2, 5), baseline_runs=5).noise_runs == 0
    assert GateConfig(protocol="sequential", looks=(2, 3), baseline_runs=3, noise_runs=4).noise_runs == 4


def _lab(tmp_path: Path, old: str = "", new: str = "") -> Path:
    root = sim_lab(tmp_path / "lab", tasks=3)
    if old:
        set_research(root, old, new)
    return effect_branches(root, {"a": 1.0, "b": 0.0})


def _finish(store, lab, commit: str, lift: float = 0.0, fail: tuple[tuple[str, int], ...] = (),
            dataset: Callable[[int], str] = lambda seed: "sim-s0") -> None:
    """Every queued run of `commit` finished with 0.5 + task offset + lift + seed noise of sd 0.01,
    drawn per (arm, task, seed) from a fixed generator: the arms do not pair (correlation 0). The
    (task, seed)s in `fail` end in a method failure instead; `dataset(seed)` is what each was measured on."""
    import numpy as np

    from pipeline import labrepo
    from pipeline.store import Owner, Result

    sha = labrepo.resolve_commit(lab, commit)
    for claim in store.claim(Owner.current(), 100, commits=[sha]):
        r = claim.run
        noise = np.random.default_rng([int(lift > 0), int(r.task[1:]), r.seed]).normal(0.0, 0.01)
        value = 0.5 + 0.01 * int(r.task[1:]) + lift + float(noise)
        failed = dict(value=None, outcome="method_failure", detail="diverged") if (r.task, r.seed) in fail else {}
        assert store.finish(claim, Result(run_id=r.id, commit=sha, task=r.task, seed=r.seed,
                                          **{"value": value, **failed}, dataset_id=dataset(r.seed)))
    time.sleep(0.01)


def test_the_first_comparison_waits_for_the_noise_study_and_no_later_one_does(tmp_path: Path) -> None:
    from pipeline import experiment, labrepo
    from pipeline.experiment import Experiment
    from pipeline.lab import load_lab

    lab = load_lab(_lab(tmp_path))
    assert lab.config.gate.noise_runs == 5  # the sim lab's baseline_runs = 5
    store = experiment.open_store(lab)
    exp = Experiment(lab, store)
    base = "autoresearch/baseline"
    base_sha = labrepo.resolve_commit(lab, base)
    study = exp.noise_study(base)
    runs = store.runs(study)
    assert len(runs) == 5 * 3 and {r.commit for r in runs} == {base_sha}
    assert sorted({r.seed for r in runs}) == list(exp.baseline_seeds(base, 5))  # the baseline's own seeds
    assert {r.priority for r in runs} == {exp.run_priority(lab.config.gate.looks[0])}  # what a look waits for
    assert exp.noise_study(base) == study  # idempotent
    assert not exp.finished(study)
    _finish(store, lab, base)
    assert exp.finished(study)
    first = exp.queue_look(base, "a", 1)
    assert set(study) & set(first)  # the first look's baseline seeds are the study's own runs
    assert exp.noise_study(base) == []  # a comparison is recorded: nobody waits again
    store.dispose()


def test_the_study_lets_a_steady_gain_be_promoted_at_two_pairs_where_one_pairs_variance_could_not(tmp_path):
    """The same planted runs judged at look 2 in two labs: without the study the paired test has 1 df
    (a boundary of ~60 with 3 tasks at α 0.01) and a 5σ gain escalates; with it, the baseline's 3 runs
    per task off the pairs measure the noise and the same gain is promoted."""
    from pipeline import experiment
    from pipeline.experiment import Experiment
    from pipeline.lab import load_lab

    verdicts = {}
    for label, extra in (("study", ""), ("none", "noise_runs = 0\n")):
        lab = load_lab(_lab(tmp_path / label, "[gate]\n" if extra else "", "[gate]\n" + extra))
        store = experiment.open_store(lab)
        exp = Experiment(lab, store)
        base = "autoresearch/baseline"
        study = exp.noise_study(base)
        assert (len(study) == 15) if label == "study" else study == []
        _finish(store, lab, base)  # the study's runs in before the comparison begins (none: nothing queued)
        exp.queue_look(base, "a", 2)
        _finish(store, lab, base)
        _finish(store, lab, "a", lift=0.05)  # 5σ of a run's noise, on every task
        result = exp.judge_look(base, "a", 2)
        verdicts[label] = result.verdict.value if result.verdict else None, result.horizontal.boundary
        store.dispose()
    assert verdicts["study"][0] == "improvement" and verdicts["study"][1] < 10, verdicts
    assert verdicts["none"][0] == "escalate" and verdicts["none"][1] > 50, verdicts  # 1 df


def test_a_failed_study_run_costs_its_seed_not_the_whole_study(tmp_path: Path) -> None:
    """One study run fails (a method failure on one task): that seed leaves the history on every
    task (a horizontal value lines the tasks up by seed), the other two off-pair seeds stay, and a
    steady 10σ gain is promoted at two pairs on a measured noise (boundary 9.7). Before, the unequal
    counts dropped the whole study: the bound stood on one pair's 1 df (60.1) and the gain escalated."""
    from pipeline import experiment
    from pipeline.experiment import Experiment
    from pipeline.lab import load_lab

    lab = load_lab(_lab(tmp_path))
    store = experiment.open_store(lab)
    exp = Experiment(lab, store)
    base = "autoresearch/baseline"
    study = exp.noise_study(base)
    off_pair = sorted({r.seed for r in store.runs(study)})[-1]  # looks 1-2 pair on the first two seeds
    _finish(store, lab, base, fail=(("t2", off_pair),))
    exp.queue_look(base, "a", 2)
    _finish(store, lab, base)
    _finish(store, lab, "a", lift=0.1)
    result = exp.judge_look(base, "a", 2)
    store.dispose()
    assert result.verdict is not None and result.verdict.value == "improvement", result
    assert result.horizontal.boundary < 15, result.horizontal  # 2 seeds off the pairs, not 1 df


def test_study_runs_measured_on_another_dataset_stay_out(tmp_path: Path) -> None:
    """The study's runs were measured on data the comparison's own runs were not (the data changed
    under the store): they are not this comparison's noise, and its bound stands on its own pairs."""
    from pipeline import experiment
    from pipeline.experiment import Experiment
    from pipeline.lab import load_lab

    lab = load_lab(_lab(tmp_path))
    store = experiment.open_store(lab)
    exp = Experiment(lab, store)
    base = "autoresearch/baseline"
    study = exp.noise_study(base)
    pairs = set(exp.look_baseline_seeds(base, 2))
    _finish(store, lab, base, dataset=lambda seed: "sim-s0" if seed in pairs else "sim-OLD")  # off-pair: other data
    assert exp.finished(study)
    exp.queue_look(base, "a", 2)
    _finish(store, lab, base)
    _finish(store, lab, "a", lift=0.1)
    result = exp.judge_look(base, "a", 2)
    store.dispose()
    assert result.horizontal.boundary > 50, result.horizontal  # one pair's 1 df: no study on this data


def test_the_two_sample_protocols_run_no_study(tmp_path: Path) -> None:
    from pipeline import experiment
    from pipeline.experiment import Experiment
    from pipeline.lab import load_lab

    lab = load_lab(_lab(tmp_path, 'protocol = "paired"\nbaseline_runs = 5\nlooks = [1, 2, 5]',
                         'protocol = "sequential"\nbaseline_runs = 5\nlooks = [2, 5]'))
    store = experiment.open_store(lab)
    assert Experiment(lab, store).noise_study("autoresearch/baseline") == []
    store.dispose()


@pytest.mark.slow  # the real loop, 12 s: the full suite runs it, `make test-fast` does not
def test_through_the_loop_the_first_hypothesis_waits_for_the_study_and_decides_earlier(tmp_path: Path) -> None:
    """The real loop (CLI, sandboxed local executor, the simulated lab): a +4σ hypothesis, the lab's
    first, waits for the 5 baseline runs per task of the study, which all finish before its comparison
    is recorded, and is promoted at look 2 (with `noise_runs = 0` the same lab and seed: look 5)."""
    from support import cli
    from support.lab import records
    from test_in_flight import seed_effects

    from pipeline import experiment
    from pipeline.lab import load_lab

    root = sim_lab(tmp_path / "lab", tasks=4, sleep=0.05)
    (hid,) = seed_effects(root, [4.0])
    out = cli(root, "run", "--offline", "--max-hypotheses", "1", "--workers", "2", timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    h = records(root).get(hid)
    assert h.decision == "promote" and h.look <= 2, (h.decision, h.look)
    assert f"#{hid}: the lab's first comparison waits for its noise study, 5 baseline runs per task" in out.stderr
    store = experiment.open_store(load_lab(root))
    (when,) = [t for c, b, t in store.comparisons_timed() if (c, b) == (h.commit, h.base_commit)]
    study = [r for r in store.runs(commit=h.base_commit) if r.seed in range(5)]
    store.dispose()
    assert len(study) == 5 * 4 and all(r.finished_at < when for r in study), (when, study)


def test_the_benchmark_shows_the_study_halving_a_large_first_gains_runs_without_more_false_promotions() -> None:
    """benchmarks/noise_study.py's gate grid, small: at +5σ the study about halves the challenger runs
    (4.9 → 2.4 at 2000 trials), power stays 1, and the nulls stay far under α in both arms."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "noise_study.py"
    spec = importlib.util.spec_from_file_location("noise_study_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.gate_grid(300, 1000)
    big = [r for r in rows if r["effect"] == 5.0]
    assert len(big) == 3 and all(r["study"]["challenger_runs"] < 0.6 * r["none"]["challenger_runs"] for r in big), big
    assert all(r["study"]["improvement"] == 1.0 for r in big)
    assert all(r[k]["improvement"] <= 0.02 for r in rows if r["effect"] == 0 for k in ("none", "study")), rows


@pytest.mark.system
def test_a_thread_waiting_on_a_study_the_lab_no_longer_asks_for_goes_on_after_a_restart(tmp_path: Path) -> None:
    """The loop stops (`--hours`) while the lab's first hypothesis waits in its checkpoint for the
    noise study; the user sets `noise_runs = 0` and runs again: the thread goes on to its looks at
    once instead of waiting for the study's runs it was checkpointed with."""
    from support import cli
    from support.lab import records
    from test_in_flight import seed_effects

    from pipeline import experiment
    from pipeline.lab import load_lab

    # one slot, 3 s a run: the study's 10 runs take 30 s, more than the first loop's 21.6 s
    root = sim_lab(tmp_path / "lab", tasks=2, sleep=3.0)
    (hid,) = seed_effects(root, [4.0])
    out = cli(root, "run", "--offline", "--max-hypotheses", "1", "--workers", "1", "--hours", "0.006", timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "waits for its noise study" in out.stderr, out.stderr[-3000:]
    store = experiment.open_store(load_lab(root))
    assert not store.comparisons_timed()  # stopped while it waited
    store.dispose()
    research = root / "research.toml"
    research.write_text(research.read_text().replace("[gate]\n", "[gate]\nnoise_runs = 0\n"))
    # stopped again after 14.4 s: the thread goes on at the loop's first pass, long before the study is done
    out = cli(root, "run", "--offline", "--max-hypotheses", "1", "--workers", "1", "--hours", "0.004", timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    h = records(root).get(hid)
    store = experiment.open_store(load_lab(root))
    (when,) = [t for c, b, t in store.comparisons_timed() if (c, b) == (h.commit, h.base_commit)]
    study = [r for r in store.runs(commit=h.base_commit) if r.seed in range(5)]
    store.dispose()
    # recorded before the study's runs were all done: the thread did not wait for them
    assert any(r.finished_at is None or r.finished_at > when for r in study), (when, study)


@pytest.mark.system
def test_the_study_is_queued_when_the_first_hypothesis_is_proposed_not_when_it_is_measured(tmp_path: Path) -> None:
    """The lab's first hypothesis breaks at smoke (its effect is not a number) and never reaches a
    look; the study's runs were queued all the same, when it was proposed, so they ran while it was
    implemented and smoke-run (queued at its first look, as before, there would be none)."""
    import json

    from support import cli
    from support.lab import records

    from pipeline import experiment, labrepo
    from pipeline.lab import load_lab

    root = sim_lab(tmp_path / "lab", tasks=2, sleep=0.05)
    spec = tmp_path / "broken.json"
    spec.write_text(json.dumps({"title": "broken", "edits": [{"path": "effect_h1.toml", "content": 'effect = "big"\n'}]}))
    seeded = cli(root, "seed", "--file", str(spec))
    assert seeded.returncode == 0, seeded.stderr
    out = cli(root, "run", "--offline", "--max-hypotheses", "1", "--workers", "1", timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    h = records(root).get(int(seeded.stdout.strip()))
    assert h.decision == "reject" and h.look is None, (h.decision, h.look)
    assert "stage sim exited" in (h.reject_reason or ""), h.reject_reason  # at smoke
    lab = load_lab(root)
    store = experiment.open_store(lab)
    base = labrepo.resolve_commit(lab, "autoresearch/baseline")
    study = store.runs(commit=base)
    store.dispose()
    assert len(study) == 5 * 2 and {r.seed for r in study} == set(range(5)), study
