"""The replication step (issue 34): `[gate] replicate_runs` repeats a granted promotion on fresh
seeds (the first of the block the challenger would own as champion), both arms paired, and carries
it out only if a one-sided t test of the horizontal mean Δ passes at `replicate_alpha`.

Real parts: git, SQLite, the simulated lab, the store's queue, the real gate and the real loop (CLI,
sandboxed local executor); the values of the Experiment-level tests are planted through the real
queue, as in test_noise_study.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from support.lab import git
from test_in_flight import sim_lab

pytestmark = pytest.mark.integration


@pytest.mark.unit
def test_the_t_test_passes_a_steady_gain_and_stops_a_null_a_failure_and_reads_the_metrics_direction() -> None:
    from pipeline.gate.replication import replicate

    seeds = [1000, 1001]
    sigma = {"t1": 0.01, "t2": 0.02, "t3": 0.01}
    base = {t: {1000: 0.50, 1001: 0.51} for t in sigma}

    def chal(lift: dict[str, float], jitter: float = 0.002) -> dict[str, dict[int, float | None]]:
        return {t: {1000: 0.50 + lift[t] + jitter, 1001: 0.51 + lift[t] - jitter} for t in sigma}

    gain = replicate(base, chal({t: 2 * s for t, s in sigma.items()}), sigma, seeds, 0.10, True)
    assert gain["passed"] and gain["df"] == 3 and gain["mean"] == pytest.approx(2.0), gain
    assert gain["t"] > gain["critical"] == pytest.approx(1.6377, abs=1e-3)  # t(3) at 0.90
    assert gain["reason"].startswith("replicated on 2 fresh seeds: horizontal Δ +2.000σ")
    null = replicate(base, chal({t: 0.0 for t in sigma}, jitter=0.004), sigma, seeds, 0.10, True)
    assert not null["passed"] and null["mean"] == pytest.approx(0.0, abs=1e-9), null
    assert null["reason"].startswith("not replicated")
    # lower is better: the same raise of the metric is a loss
    assert not replicate(base, chal({t: 2 * s for t, s in sigma.items()}), sigma, seeds, 0.10, False)["passed"]
    assert replicate(base, chal({t: -2 * s for t, s in sigma.items()}), sigma, seeds, 0.10, False)["passed"]
    # a challenger that fails on a fresh seed is not replicated, whatever the others say
    broken = chal({t: 5 * s for t, s in sigma.items()})
    broken["t2"][1001] = None
    out = replicate(base, broken, sigma, seeds, 0.10, True)
    assert not out["passed"] and "a challenger run failed on a fresh seed (t2 seed 1001)" in out["reason"]
    # a baseline run that failed leaves its pair out (the task still counts on its other pair)
    holes = {t: dict(v) for t, v in base.items()}
    holes["t1"][1000] = None
    out = replicate(holes, chal({t: 2 * s for t, s in sigma.items()}), sigma, seeds, 0.10, True)
    assert out["tasks"][0]["pairs"] == 1 and out["df"] == 2 and out["passed"], out
    # no task's noise measured (a deterministic baseline): nothing to replicate against, said so
    flat = replicate(base, chal({t: 0.0 for t in sigma}), {t: 0.0 for t in sigma}, seeds, 0.10, True)
    assert flat["passed"] and "no task has a measured noise" in flat["reason"]


@pytest.mark.unit
def test_replicate_runs_is_off_by_default_paired_only_and_a_bad_value_is_one_clear_error() -> None:
    from pipeline.gate.inputs import GateConfig

    assert GateConfig().replicate_runs == 0 and GateConfig().replicate_alpha == 0.10
    assert GateConfig(replicate_runs=2).replicate_runs == 2
    for bad, said in (({"replicate_runs": 1}, "expected replicate_runs 0 \\(no replication\\) or 2 to baseline_runs"),
                      ({"replicate_runs": 11}, "or 2 to baseline_runs \\(10\\), got 11"),
                      ({"protocol": "sequential", "looks": (2, 5), "replicate_runs": 2}, "does not pair the arms"),
                      ({"replicate_alpha": 0.7}, "replicate_alpha")):
        with pytest.raises(ValueError, match=said):
            GateConfig(**bad)
    assert GateConfig(protocol="sequential", looks=(2, 5)).replicate_runs == 0


def _lab(tmp_path: Path, extra: str = "replicate_runs = 2\n") -> Path:
    root = sim_lab(tmp_path / "lab", tasks=3)
    if extra:
        research = root / "research.toml"
        research.write_text(research.read_text().replace("[gate]\n", "[gate]\n" + extra))
        git(root, "commit", "-qam", "gate settings")
        git(root, "branch", "-f", "autoresearch/baseline", "HEAD")
    for name in ("a", "b"):
        git(root, "checkout", "-qb", name, "autoresearch/baseline")
        (root / f"effect_{name}.toml").write_text("effect = 1.0\n")
        git(root, "add", "-A")
        git(root, "commit", "-qm", name)
    git(root, "checkout", "-q", "main")
    return root


def _finish(store, lab, commit: str, lift: Callable[[int], float] = lambda seed: 0.0) -> None:
    """Every queued run of `commit` finished with 0.5 + task offset + lift(seed) + noise of sd 0.01
    drawn per (arm, task, seed): the arms do not pair."""
    import numpy as np

    from pipeline import labrepo
    from pipeline.store import Owner, Result

    sha = labrepo.resolve_commit(lab, commit)
    for claim in store.claim(Owner.current(), 100, commits=[sha]):
        r = claim.run
        noise = np.random.default_rng([int(commit != "autoresearch/baseline"), int(r.task[1:]), r.seed]).normal(0, 0.01)
        value = 0.5 + 0.01 * int(r.task[1:]) + lift(r.seed) + float(noise)
        assert store.finish(claim, Result(run_id=r.id, commit=sha, task=r.task, seed=r.seed, value=value,
                                          dataset_id="sim-s0"))
    time.sleep(0.01)


def test_a_gain_on_the_selected_seeds_only_is_not_replicated_and_a_steady_one_is(tmp_path: Path) -> None:
    """Two challengers of one baseline, both promoted by the gate at look 2 on a 10σ gain: `a`'s gain
    is on the seeds it was selected on only (a lucky draw), `b`'s on every seed. Their replications
    run on the first 2 seeds of the next block, the old baseline's runs there once for both, at a
    priority above every look; `a` is not replicated, `b` is. The new champion re-verifies on the
    block's next 2 seeds, and its first baseline runs are `b`'s replication runs."""
    from pipeline import experiment, labrepo
    from pipeline.experiment import Experiment
    from pipeline.lab import load_lab

    lab = load_lab(_lab(tmp_path))
    store = experiment.open_store(lab)
    exp = Experiment(lab, store)
    base = "autoresearch/baseline"
    base_sha = labrepo.resolve_commit(lab, base)
    assert exp.wants_replication() and list(exp.replication_seeds(base)) == [1000, 1001]
    exp.noise_study(base)  # the lab's first looks stand on a measured noise
    _finish(store, lab, base)
    for name in ("a", "b"):
        exp.queue_look(base, name, 2)
    _finish(store, lab, base)
    _finish(store, lab, "a", lambda seed: 0.1 if seed < 1000 else 0.0)
    _finish(store, lab, "b", lambda seed: 0.1)
    for name in ("a", "b"):
        assert exp.judge_look(base, name, 2).verdict.value == "improvement"
        assert exp.replication(base, name) is None  # nothing queued yet
    ra, rb = exp.queue_replication(base, "a"), exp.queue_replication(base, "b")
    assert exp.queue_replication(base, "a") == ra  # idempotent
    runs = {r.id: r for r in store.runs(ra + rb)}
    assert len(runs) == 3 * 2 * 3  # the old baseline's 6 runs serve both replications
    assert {r.seed for r in runs.values()} == {1000, 1001}
    assert min(r.priority for r in runs.values()) > exp.run_priority(lab.config.gate.looks[-1], rank=99)
    _finish(store, lab, base)
    assert exp.replication(base, "a") is None  # the challengers' runs are not in
    _finish(store, lab, "a", lambda seed: 0.1 if seed < 1000 else 0.0)
    _finish(store, lab, "b", lambda seed: 0.1)
    a = exp.replication(base, "a", record_as="7", look=2)
    b = exp.replication(base, "b")
    assert not a["passed"] and a["reason"].startswith("not replicated"), a
    assert b["passed"] and b["mean"] > 3, b
    (rec,) = store.gate_records("7", kind="replicate")
    assert rec.look == 2 and rec.payload == a
    # `b` promoted (a fast-forward): its replication runs are its first baseline runs, its fresh ones next
    b_sha = labrepo.resolve_commit(lab, "b")
    assert labrepo.LabRepo(lab.root).promote(b_sha, "promote b", base=base_sha) == (b_sha, "baseline/v1")
    assert list(exp.fresh_seeds(exp.generation(b_sha))) == [1002, 1003]
    champion = exp.queue_champion(b_sha, "baseline/v1")
    assert {(r.seed, r.status) for r in store.runs(champion)} == {
        (1000, "done"), (1001, "done"), (1002, "queued"), (1003, "queued")}
    _finish(store, lab, "b", lambda seed: 0.1)
    rv = exp.reverification("b", b_sha, base_sha, 2)
    assert rv is not None and rv["fresh_seeds"] == [1002, 1003], rv
    store.dispose()


def test_a_lab_without_the_step_queues_nothing_and_its_champion_re_verifies_on_its_first_seeds(tmp_path: Path):
    from pipeline import experiment
    from pipeline.experiment import Experiment
    from pipeline.lab import load_lab

    lab = load_lab(_lab(tmp_path, extra=""))
    store = experiment.open_store(lab)
    exp = Experiment(lab, store)
    assert not exp.wants_replication() and exp.queue_replication("autoresearch/baseline", "a") == []
    assert exp.replication("autoresearch/baseline", "a") is None
    assert list(exp.fresh_seeds(1)) == [1000, 1001]
    store.dispose()


@pytest.mark.system
def test_through_the_loop_a_lucky_gain_is_not_promoted_and_a_real_one_is(tmp_path: Path) -> None:
    """The real loop on the simulated lab with `replicate_runs = 2`: h1 gains +6σ on the seeds it is
    selected on (0-4) and nothing elsewhere, h2 +6σ everywhere. The gate grants both; h1's replication
    on seeds 1000-1001 finds nothing and it is abandoned with the reason, h2's holds and it is
    promoted; the summaries carry the replication, and the champion's re-verification runs are seeds
    1002-1003 (the loop stops before they are in)."""
    import json

    from support import cli
    from support.lab import records

    from pipeline import experiment
    from pipeline.lab import load_lab

    root = sim_lab(tmp_path / "lab", tasks=3, sleep=0.05)
    research = root / "research.toml"
    research.write_text(research.read_text().replace("[gate]\n", "[gate]\nreplicate_runs = 2\n"))
    git(root, "commit", "-qam", "replicate")
    git(root, "branch", "-f", "autoresearch/baseline", "HEAD")
    lucky = "\n".join(["effect = 0.0", "[seed]", *(f'"{s}" = 6.0' for s in range(5))]) + "\n"
    ids = []
    for i, (title, content) in enumerate((("lucky", lucky), ("real", "effect = 6.0\n")), start=1):
        spec = tmp_path / f"h{i}.json"
        spec.write_text(json.dumps({"title": title, "edits": [{"path": f"effect_h{i}.toml", "content": content}]}))
        out = cli(root, "seed", "--file", str(spec))
        assert out.returncode == 0, out.stderr
        ids.append(int(out.stdout.strip()))
    out = cli(root, "run", "--offline", "--max-hypotheses", "2", "--workers", "2", timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rec = records(root)
    h1, h2 = rec.get(ids[0]), rec.get(ids[1])
    assert h1.verdict == "improvement" and h1.decision == "abandon" and not h1.promoted_tag, h1
    assert h1.rationale_decision.startswith("Not promoted: the gate's improvement was not replicated on 2 fresh seeds")
    assert h2.decision == "promote" and h2.promoted_tag, h2
    said = out.stderr
    assert f"#{ids[0]} 'lucky': verdict improvement" in said and "decision abandon; not replicated on 2 fresh" in said
    assert "decision promote → baseline/v1; replicated on 2 fresh seeds" in said, said[-3000:]
    assert said.count("its promotion waits for its replication, 2 fresh seeds per task") == 2, said[-3000:]
    for h in (h1, h2):
        assert "**Replication** (1000, 1001)" in (h.summary_md or ""), h.summary_md
    rep = json.loads(cli(root, "report", str(h1.id), "--json").stdout)["replication"]
    assert rep["seeds"] == [1000, 1001] and not rep["passed"] and len(rep["tasks"]) == 3, rep
    md = cli(root, "report", str(h2.id), "--md").stdout
    assert "**Replication** (1000, 1001): replicated on 2 fresh seeds" in md and "| t1 | 2 |" in md, md[-2000:]
    table = cli(root, "report", str(h2.id)).stdout
    assert "replication: replicated on 2 fresh seeds" in table
    lab = load_lab(root)
    store = experiment.open_store(lab)
    champion = {r.seed for r in store.runs(commit=h2.commit) if r.seed >= 1000}
    old = {(r.task, r.seed) for r in store.runs(commit=h1.base_commit) if r.seed >= 1000}
    store.dispose()
    assert old == {(t, s) for t in ("t1", "t2", "t3") for s in (1000, 1001)}  # the step's cost, once for both
    assert champion == {1000, 1001, 1002, 1003}  # replicated on the first two, re-verified on the next two
