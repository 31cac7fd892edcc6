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
from typing import Any

import pytest

from support.lab import set_research
from test_in_flight import effect_branches, sim_lab

pytestmark = pytest.mark.integration


@pytest.mark.unit
def test_the_test_holds_its_level_when_every_tasks_delta_moves_together_where_a_pooled_t_does_not() -> None:
    """benchmarks/replication.py, small: 2 fresh pairs on 8 tasks whose Δ share a seed-level shock
    (ρ_task 0.8, a challenger that changes pretraining): the product's test (per-seed horizontal
    values on the hypothesis's own spread) passes nulls near its nominal 0.10, a t that pools the
    spread within each task as if tasks were independent (the simulator's first rule) about three
    times as often; a 2σ gain passes most of the time."""
    import importlib.util

    import numpy as np

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "replication.py"
    spec = importlib.util.spec_from_file_location("replication_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rng = np.random.default_rng(7)

    def case(rho_task: float, rho_pair: float, effect: float):
        own, base, chal = bench.draw(rng, 8, 2, rho_task, rho_pair, effect)
        _, lb, lc = bench.draw(rng, 8, 5, rho_task, rho_pair, effect)
        return own, base, chal, lc - lb

    nulls = [case(0.8, 0.0, 0.0) for _ in range(400)]
    own = sum(bench.own_test(*x) for x in nulls) / len(nulls)
    pooled = sum(bench.pooled_test(*x[:3]) for x in nulls) / len(nulls)
    assert own <= 0.15 and pooled >= 0.2 and pooled > 2 * own, (own, pooled)
    gains = [case(0.0, 0.5, 2.0) for _ in range(50)]
    assert sum(bench.own_test(*x) for x in gains) >= 45


@pytest.mark.unit
def test_the_record_passes_only_where_the_fresh_values_clear_the_hypothesis_own_spread() -> None:
    import numpy as np

    from pipeline.gate.replication import own_spread_test, record, untested

    look = np.array([1.0, 1.2, 0.8, 1.1, 0.9])  # the decisive look's per-seed horizontal values (σ units)
    gain = own_spread_test(look, np.array([1.05, 0.95]), 0.10)
    assert gain[4] and gain[2] == 5 and gain[0] == pytest.approx(1.0), gain  # (5 - 1) + (2 - 1) df
    null = own_spread_test(look, np.array([0.1, -0.1]), 0.10)
    assert not null[4] and null[0] == pytest.approx(0.0), null
    assert not own_spread_test(np.array([]), np.array([3.0]), 0.10)[4]  # one value, no spread: never a pass
    assert not own_spread_test(look, np.array([3.0, np.nan]), 0.10)[4]  # one fresh seed is no replication
    assert not own_spread_test(np.array([0.5, 0.5]), np.array([0.5, 0.5]), 0.10)[4]  # seeds that do not vary
    # fresh values alone (1 df: t 3.08 needed) do not clear their spread; with the look's 4 df more they do
    alone = own_spread_test(np.array([]), np.array([0.3, 1.5]), 0.10)
    pooled = own_spread_test(look, np.array([0.3, 1.5]), 0.10)
    assert not alone[4] and alone[2] == 1 and pooled[4] and pooled[2] == 5, (alone, pooled)
    raw = np.array([[0.01, 0.012], [np.nan, 0.02]])
    rec = record([1000, 1001], ["t1", "t2"], raw, np.array([0.01, 0.02]), gain, 0.10, "auc")
    assert rec["passed"] and rec["reason"].startswith("replicated on 2 fresh seeds: horizontal Δ +1.000σ, t ")
    assert [r["pairs"] for r in rec["tasks"]] == [2, 1] and rec["tasks"][0]["delta_sigma"] == pytest.approx(1.1)
    never = untested([1000, 1001], ["t1"], "the baseline's fresh runs failed on t1", 0.10, "auc")
    assert not never["passed"] and never["reason"] == "not replicated: the baseline's fresh runs failed on t1"


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
        set_research(root, "[gate]\n", "[gate]\n" + extra)
    return effect_branches(root, {"a": 1.0, "b": 1.0})


def _finish(store, lab, commit: str, lift: Callable[[int], float] = lambda seed: 0.0, same: int = 0) -> None:
    """Every queued run of `commit` finished with 0.5 + task offset + lift(seed) + noise of sd 0.01
    drawn per (arm, task, seed): the arms do not pair; from seed `same` on (if given) a challenger's
    noise is the baseline's (Δ = lift exactly)."""
    import numpy as np

    from pipeline import labrepo
    from pipeline.store import Owner, Result

    sha = labrepo.resolve_commit(lab, commit)
    for claim in store.claim(Owner.current(), 100, commits=[sha]):
        r = claim.run
        arm = int(commit != "autoresearch/baseline" and not (same and r.seed >= same))
        noise = np.random.default_rng([arm, int(r.task[1:]), r.seed]).normal(0, 0.01)
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
    _finish(store, lab, "a", lambda seed: 0.1 if seed < 1000 else 0.0, same=1000)  # Δ = 0 on the fresh seeds
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


def test_with_lond_a_discovery_of_the_stream_is_a_replicated_improvement(tmp_path: Path) -> None:
    """`online_fdr = "lond"` beside `replicate_runs = 2`: the gate's `improvement` of a challenger whose
    gain does not replicate is no discovery of the stream (it was not promoted, and must not raise the
    next comparison's α); one that replicates is, once."""
    from pipeline import experiment
    from pipeline.experiment import Experiment
    from pipeline.gate.online_fdr import lond_alpha
    from pipeline.lab import load_lab

    lab = load_lab(_lab(tmp_path, extra='replicate_runs = 2\nonline_fdr = "lond"\nalpha = 0.025\n'))
    store = experiment.open_store(lab)
    exp = Experiment(lab, store)
    base = "autoresearch/baseline"
    exp.noise_study(base)
    _finish(store, lab, base)
    for name in ("a", "b"):
        exp.queue_look(base, name, 5)
    _finish(store, lab, base)
    _finish(store, lab, "a", lambda seed: 0.1 if seed < 1000 else 0.0)
    _finish(store, lab, "b", lambda seed: 0.1)
    for name in ("a", "b"):
        assert exp.judge_look(base, name, 5).verdict.value == "improvement"
    assert exp.stream()["tests"] == 2 and exp.stream()["discoveries"] == 0  # granted, not yet replicated
    for name in ("a", "b"):
        exp.queue_replication(base, name)
    _finish(store, lab, base)
    _finish(store, lab, "a", lambda seed: 0.1 if seed < 1000 else 0.0, same=1000)
    _finish(store, lab, "b", lambda seed: 0.1)
    assert not exp.replication(base, "a")["passed"]
    assert exp.stream()["discoveries"] == 0
    assert exp.replication(base, "b")["passed"] and exp.replication(base, "b")["passed"]  # judged twice: once
    assert exp.stream() == {"procedure": "lond", "fdr": 0.05, "tests": 2, "discoveries": 1,
                            "next_alpha": lond_alpha(3, 1, 0.05, 0.025)}
    store.dispose()


def test_a_challenger_run_lost_to_the_machine_fails_the_replication_never_skips_it(tmp_path: Path) -> None:
    """One of the challenger's replication runs ends as an infrastructure failure past its retries (run
    `failed`, no metric): the replication is judged once every run is finished, and that run counts
    as failed, as at a look; before, the missing metric read as "not in yet" and the promote node went
    on to promote without a replication."""
    from pipeline import experiment, labrepo
    from pipeline.experiment import Experiment
    from pipeline.lab import load_lab
    from pipeline.outcomes import RunStatus
    from pipeline.store import Owner, Result

    lab = load_lab(_lab(tmp_path))
    store = experiment.open_store(lab)
    exp = Experiment(lab, store)
    base = "autoresearch/baseline"
    exp.noise_study(base)
    _finish(store, lab, base)
    exp.queue_replication(base, "b")
    _finish(store, lab, base)
    sha = labrepo.resolve_commit(lab, "b")
    for claim in store.claim(Owner.current(), 100, commits=[sha]):
        r = claim.run
        if (r.task, r.seed) == ("t2", 1001):
            assert store.finish(claim, Result(run_id=r.id, commit=sha, task=r.task, seed=r.seed, value=None,
                                              outcome="infra_failure", detail="node lost"), RunStatus.FAILED)
        else:
            assert store.finish(claim, Result(run_id=r.id, commit=sha, task=r.task, seed=r.seed,
                                              value=0.6 + 0.01 * int(r.task[1:]), dataset_id="sim-s0"))
    out = exp.replication(base, "b")
    store.dispose()
    assert out is not None and not out["passed"], out
    assert "a challenger run failed on a fresh seed (t2 seed 1001)" in out["reason"]


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
    selected on (0-4) and loses 1σ elsewhere, h2 gains +12σ everywhere (h1's arm, seeds that differ by 7σ,
    widens the lab's σ_task that h2 is measured in, if h2's first look comes after h1's runs). The gate grants both; h1's replication
    on seeds 1000-1001 finds nothing and it is abandoned with the reason, h2's holds and it is
    promoted; the summaries carry the replication, and the champion's re-verification runs are seeds
    1002-1003 (the loop stops before they are in)."""
    import json

    from support import cli
    from support.lab import records

    from pipeline import experiment
    from pipeline.lab import load_lab

    root = sim_lab(tmp_path / "lab", tasks=3, sleep=0.05)
    set_research(root, "[gate]\n", "[gate]\nreplicate_runs = 2\n")
    lucky = "\n".join(["effect = -1.0", "[seed]", *(f'"{s}" = 7.0' for s in range(5))]) + "\n"
    ids = []
    for i, (title, content) in enumerate((("lucky", lucky), ("real", "effect = 12.0\n")), start=1):
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
    assert h2.decision == "promote" and h2.promoted_tag, (h2.verdict, h2.look, h2.rationale_decision, out.stderr[-3000:])
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


BASE5 = [0.600, 0.604, 0.598, 0.602, 0.601]
GAIN5 = [v + 0.02 + j for v, j in zip(BASE5, (0.001, -0.001, 0.0005, 0.0, -0.0005))]
GAIN5_2 = [v + 0.02 + j for v, j in zip(GAIN5, (-0.0005, 0.001, 0.0, -0.001, 0.0005))]  # +0.02 over GAIN5


def _seed(lab: Path, name: str, search: str, replace: str) -> None:
    import json

    from agent.commands import seed as seed_cmd

    spec = lab.parent / f"{name}.json"
    spec.write_text(json.dumps({"title": name, "rationale": "planted",
                                "edits": [{"path": "config.toml", "search": search, "replace": replace}]}))
    seed_cmd(lab, None, None, None, 10, None, spec)


def _to_promotion(loop, base: list[float] = BASE5, chal: list[float] = GAIN5):
    """The next hypothesis through the real graph, its looks' runs planted (+0.02 on every seed) until
    the gate grants it and the graph waits for its replication in the promote node."""
    from test_agent_decide import plant

    from support.lab import one_pass

    h = one_pass(loop)
    for _ in range(4):
        assert h.status == "measuring", (h.status, h.reject_reason)
        plant(loop.store, h.base_commit, base)
        plant(loop.store, h.commit, chal)
        h = loop.advance(h)
        if h.status != "measuring":
            break
    assert (h.status, h.verdict, h.decision) == ("promoting", "improvement", "promote"), h
    assert loop.waits_for(h)["replication"] is True
    return h


@pytest.mark.system
def test_in_the_graph_a_lucky_gain_waits_and_is_abandoned_a_real_one_is_promoted_and_turning_it_off_lets_one_go(
        lab: Path, tmp_path: Path) -> None:
    """The tiny lab made paired (baseline_runs 5, looks 1/2/5, replicate_runs 2), runs planted through
    the store: #1's replication finds the baseline's values again (a lucky selection) and it is
    abandoned with the reason; #2's finds its +0.02 and it is promoted, its summary, report and MLflow
    run carry the replication; #3 waits for its replication when the user sets `replicate_runs = 0`:
    the next loop promotes it without the runs it waited for."""
    from mlflow.tracking import MlflowClient
    from test_agent_decide import plant

    from agent.mlflow_export import HYP_TAG
    from support.lab import make_loop

    set_research(lab, 'protocol = "sequential"', 'protocol = "paired"\nnoise_runs = 0\nreplicate_runs = 2')
    set_research(lab, "baseline_runs = 3", "baseline_runs = 5")
    set_research(lab, "looks = [2, 3]", "looks = [1, 2, 5]")
    _seed(lab, "lr", "lr = 3e-4", "lr = 3e-3")
    _seed(lab, "rank", "lora_rank = 4 ", "lora_rank = 16 ")
    _seed(lab, "tabular", 'tabular = "basic"', 'tabular = "all"')
    loop = make_loop(lab, offline=True)
    try:
        h1 = _to_promotion(loop)
        assert any("its promotion waits for its replication, 2 fresh seeds per task" in s for s in loop.said)
        assert {r.seed for r in loop.store.runs(loop.pending_runs(h1))} == {1000, 1001}
        plant(loop.store, h1.base_commit, BASE5)
        plant(loop.store, h1.commit, BASE5)  # no gain on fresh seeds
        h1 = loop.advance(h1)
        assert (h1.status, h1.decision, h1.promoted_tag) == ("done", "abandon", None), h1
        assert h1.rationale_decision.startswith("Not promoted: the gate's improvement was not replicated")
        h2 = _to_promotion(loop)
        waiting = [r for r in loop.store.runs(loop.pending_runs(h2)) if r.status == "queued"]
        assert waiting and {r.commit for r in waiting} == {h2.commit}  # the old baseline's are #1's, done
        plant(loop.store, h2.commit, GAIN5)
        h2 = loop.advance(h2)
        assert (h2.status, h2.decision, h2.promoted_tag) == ("done", "promote", "baseline/v1"), h2
        assert "**Replication** (1000, 1001): replicated on 2 fresh seeds" in h2.summary_md
        assert "its replication 8 runs of both arms on 2 fresh seeds" in h2.summary_md  # 2 tasks × 2 seeds × 2
        # its spread pools the decisive look's pairs with the fresh ones: (look − 1) + (2 − 1) df
        (rec,) = loop.store.gate_records(str(h2.id), kind="replicate")
        assert rec.look == h2.look == 5 and rec.payload["df"] == h2.look, rec.payload
        h3 = _to_promotion(loop, GAIN5, GAIN5_2)  # against #2's champion, whose first runs are its replication's
        assert {r.seed for r in loop.store.runs(loop.pending_runs(h3))} == {2000, 2001}
    finally:
        loop.close()
    research = lab / "research.toml"  # the user turns the step off (the loop reads the lab's checkout)
    research.write_text(research.read_text().replace("replicate_runs = 2", "replicate_runs = 0"))
    loop = make_loop(lab, offline=True)
    try:
        h3 = loop.advance(loop.records.get(h3.id))
    finally:
        loop.close()
    assert (h3.status, h3.decision, h3.promoted_tag) == ("done", "promote", "baseline/v2"), h3
    assert loop.store.gate_records(str(h3.id), kind="replicate") == []
    from agent.mlflow_export import export

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    export(loop.lab, loop.store, uri)
    client = MlflowClient(tracking_uri=uri)
    runs = {r.data.tags[HYP_TAG]: r.data.metrics for r in client.search_runs(
        [e.experiment_id for e in client.search_experiments()], max_results=100) if HYP_TAG in r.data.tags}
    assert runs[str(h1.id)]["replication.passed"] == 0.0 and runs[str(h2.id)]["replication.passed"] == 1.0
    assert runs[str(h2.id)]["replication.t"] > 1.6 and "replication.t" not in runs[str(h3.id)]


def real_gain_lab(tmp_path: Path) -> tuple[Path, int, Any]:
    """A 3-task sim lab (0.4 s a run) asking for 2 replication seeds, with one hypothesis seeded whose
    gain is real (+12σ): (the lab's root, the hypothesis's id, the lab's store)."""
    import json

    from support import cli

    from pipeline import experiment
    from pipeline.lab import load_lab

    root = sim_lab(tmp_path / "lab", tasks=3, sleep=0.4)
    set_research(root, "[gate]\n", "[gate]\nreplicate_runs = 2\n")
    spec = tmp_path / "h.json"
    spec.write_text(json.dumps({"title": "real", "edits": [{"path": "effect_h.toml", "content": "effect = 12.0\n"}]}))
    out = cli(root, "seed", "--file", str(spec))
    assert out.returncode == 0, out.stderr
    return root, int(out.stdout.strip()), experiment.open_store(load_lab(root))


def judged_events(root: Path, hid: int) -> list[str]:
    """The loop events of the hypothesis's replication judgements (one per judgement)."""
    from support.lab import records

    return [e.message for e in records(root).events(limit=1000)
            if e.kind == "replication" and e.message.startswith(f"#{hid}: ") and "withdrawn" not in e.message]


@pytest.mark.system
def test_kill_9_while_a_promotion_waits_for_its_replication_then_restart_promotes_once(tmp_path: Path) -> None:
    """`autoresearch run` SIGKILLed while a granted promotion waits for its replication runs (the
    hypothesis `promoting`, runs on the fresh seeds 1000-1001 queued or running): the restart resumes
    the thread, re-queues the orphaned runs, judges the replication once and promotes once; every run
    of both arms on the fresh seeds exists once, with one result."""
    from support.lab import RunProcess, assert_runs_exactly_once, git, records

    root, hid, store = real_gain_lab(tmp_path)
    args = ("--offline", "--max-hypotheses", "1", "--workers", "2")
    rec = records(root)

    def waiting() -> bool:  # the decision queues the runs, then records `promoting`: both, before the kill
        fresh = [r for r in store.runs() if r.seed >= 1000]
        return (bool(fresh) and any(r.status in ("queued", "running") for r in fresh)
                and rec.get(hid).status == "promoting")

    run = RunProcess(root, *args, tag="rep1")
    try:
        run.wait_until("the replication's runs", waiting, timeout=600, poll=0.02)
        run.kill9()
        h = records(root).get(hid)
        assert h.status == "promoting" and h.verdict == "improvement" and not h.promoted_tag, (h.status, h.verdict)
        assert not store.gate_records(str(hid), kind="replicate")
        run = RunProcess(root, *args, tag="rep2")
        assert run.wait(600) == 0, run.stderr()[-4000:]
        assert f"#{hid} 'real': resuming (promoting)" in run.stderr(), run.stderr()[-3000:]
    finally:
        run.cleanup()
    h = records(root).get(hid)
    assert (h.status, h.decision, h.promoted_tag) == ("done", "promote", "baseline/v1"), h
    assert len(store.gate_records(str(hid), kind="replicate")) == 1
    assert len(judged_events(root, hid)) == 1  # judged once (a record is replaced by key: the event counts)
    assert store.gate_records(str(hid), kind="replicate")[0].payload["passed"]
    assert git(root, "tag", "--list", "baseline/v*").split() == ["baseline/v1"]
    counts = assert_runs_exactly_once(root)
    fresh = sorted((r.commit, r.task, r.seed) for r in store.runs() if r.seed in (1000, 1001))
    assert len(fresh) == 2 * 3 * 2 and len(set(fresh)) == len(fresh)
    assert counts["running"] == 0
    store.dispose()


@pytest.mark.system
def test_supervised_a_held_promotion_reaches_the_reviewer_only_once_it_replicates(tmp_path: Path) -> None:
    """`run --supervised` with `replicate_runs = 2`: every promotion is held for a human, and the hold
    waits for the replication first. h1's gain was on its selection seeds only: abandoned with the
    reason, no reviewer asked; h2's replicates: held, its summary carrying the replication; approved,
    the next run promotes it without judging the replication again."""
    import json

    from support import cli
    from support.lab import RunProcess, records

    from pipeline import experiment
    from pipeline.lab import load_lab

    root = sim_lab(tmp_path / "lab", tasks=3, sleep=0.05)
    set_research(root, "[gate]\n", "[gate]\nreplicate_runs = 2\n")
    lucky = "\n".join(["effect = -1.0", "[seed]", *(f'"{s}" = 7.0' for s in range(5))]) + "\n"
    ids = []
    for i, (title, content) in enumerate((("lucky", lucky), ("real", "effect = 12.0\n")), start=1):
        spec = tmp_path / f"h{i}.json"
        spec.write_text(json.dumps({"title": title, "edits": [{"path": f"effect_h{i}.toml", "content": content}]}))
        out = cli(root, "seed", "--file", str(spec))
        assert out.returncode == 0, out.stderr
        ids.append(int(out.stdout.strip()))
    first = RunProcess(root, "--offline", "--supervised", "--max-hypotheses", "2", "--workers", "2", tag="sup1")
    try:
        assert first.wait(900) == 0, first.stderr()[-4000:]
    finally:
        first.cleanup()
    rec = records(root)
    h1, h2 = rec.get(ids[0]), rec.get(ids[1])
    assert h1.status == "done" and h1.decision == "abandon" and not h1.promoted_tag, (h1.status, h1.decision)
    assert h1.rationale_decision.startswith("Not promoted: the gate's improvement was not replicated"), h1.rationale_decision
    assert (h2.status, h2.decision, h2.review) == ("held", "hold", "pending"), (h2.status, h2.decision, h2.review)
    store = experiment.open_store(load_lab(root))
    (r2,) = store.gate_records(str(ids[1]), kind="replicate")
    assert r2.payload["passed"]
    assert "replicated on 2 fresh seeds" in (root / "runs" / "summaries" / f"{ids[1]}.md").read_text()
    said = first.stderr()
    assert f"#{ids[1]} 'real'" in said and "held for review: the reviewer is asked once it replicates" in said, said[-3000:]
    assert "replicated on 2 fresh seeds" in said and f"awaits review (autoresearch review {ids[1]}" in said, said[-3000:]
    out = cli(root, "review", str(ids[1]), "--approve", "--comment", "replicated, go")
    assert out.returncode == 0, out.stderr
    second = RunProcess(root, "--offline", "--supervised", "--max-hypotheses", "1", "--workers", "2", tag="sup2")
    try:
        assert second.wait(600) == 0, second.stderr()[-4000:]
    finally:
        second.cleanup()
    h2 = records(root).get(ids[1])
    assert (h2.status, h2.decision, h2.promoted_tag) == ("done", "promote", "baseline/v1"), (h2.status, h2.decision)
    assert [g.payload for g in store.gate_records(str(ids[1]), kind="replicate")] == [r2.payload]
    assert len(judged_events(root, ids[1])) == 1  # not judged again by the run that promoted it
    store.dispose()


@pytest.mark.system
def test_a_reviewer_who_rejects_a_held_promotion_before_it_replicates_ends_it_without_the_replication(
        tmp_path: Path) -> None:
    """`--supervised`: the loop killed while a held promotion waits for its replication runs (its
    review not pending yet: nobody was asked); the reviewer rejects it meanwhile, by its ID; the
    restart abandons it at its hold without judging the replication (no record), withdraws the
    challenger's replication runs that had not started, and promotes nothing."""
    from support import cli
    from support.lab import RunProcess, git, records

    root, hid, store = real_gain_lab(tmp_path)
    args = ("--offline", "--supervised", "--max-hypotheses", "1", "--workers", "2")

    def held_waiting() -> bool:  # 2 fresh runs still queued: the replication cannot end before the kill
        queued = [r for r in store.runs() if r.seed >= 1000 and r.status == "queued"]
        return len(queued) >= 2 and records(root).get(hid).status == "held"

    run = RunProcess(root, *args, tag="rej1")
    try:
        run.wait_until("the held promotion's replication runs", held_waiting, timeout=600, poll=0.02)
        run.kill9()
        assert records(root).get(hid).review == "none"  # not asked yet: it waits for its replication
        out = cli(root, "review", str(hid), "--reject", "--comment", "not worth a replication")
        assert out.returncode == 0, out.stderr
        run = RunProcess(root, *args, tag="rej2")
        assert run.wait(600) == 0, run.stderr()[-4000:]
    finally:
        run.cleanup()
    h = records(root).get(hid)
    assert (h.status, h.decision, h.promoted_tag) == ("done", "abandon", None), (h.status, h.decision)
    assert not store.gate_records(str(hid), kind="replicate")
    assert git(root, "tag", "--list", "baseline/v*") == ""
    # the challenger's 6 replication runs (3 tasks x 2 fresh seeds): those not started were withdrawn
    mine = [r for r in store.runs() if r.commit == h.commit and r.seed >= 1000]
    assert all(r.priority == -1 for r in mine if r.status == "queued")  # given back by a stop: at the back
    said = [e.message for e in records(root).events(limit=1000) if "replication runs withdrawn" in e.message]
    withdrawn = int(said[0].split(": ", 1)[1].split()[0]) if said else 0
    assert len(said) <= 1 and len(mine) + withdrawn == 6, (len(mine), said)
    store.dispose()


@pytest.mark.system
def test_a_held_promotion_whose_replication_wait_ends_unjudged_still_reaches_the_reviewer(tmp_path: Path) -> None:
    """`--supervised`: the loop killed while a held promotion waits for its replication runs; the team
    then commits `replicate_runs = 0` on the baseline (no replication asked, and the base moved). The
    restart ends the runs' wait with no judgement; the hold's own question must not take that wait's
    answer for the reviewer's: the hypothesis is still held for a human, not abandoned."""
    from support.lab import RunProcess, git, records

    root, hid, store = real_gain_lab(tmp_path)
    args = ("--offline", "--supervised", "--max-hypotheses", "1", "--workers", "2")
    rec = records(root)

    run = RunProcess(root, *args, tag="unj1")

    def held_waiting() -> bool:  # its thread paused on the replication runs' wait (the loop says so), runs to come
        queued = [r for r in store.runs() if r.seed >= 1000 and r.status == "queued"]
        return len(queued) >= 2 and "the reviewer is asked once it replicates" in run.stderr()

    try:
        run.wait_until("the held promotion's replication runs", held_waiting, timeout=600, poll=0.02)
        run.kill9()
        set_research(root, "replicate_runs = 2\n", "replicate_runs = 0\n")
        run = RunProcess(root, *args, tag="unj2")
        assert run.wait(600) == 0, run.stderr()[-4000:]
    finally:
        run.cleanup()
    h = rec.get(hid)
    assert (h.status, h.decision, h.review, h.promoted_tag) == ("held", "hold", "pending", None), (h.status, h.decision)
    assert not store.gate_records(str(hid), kind="replicate")
    assert h.summary_md
    assert git(root, "tag", "--list", "baseline/v*") == ""
    # its replication is moot (it would be re-based after an approval): neither arm's fresh runs stay queued
    # ahead of anything (those the kill had started, or the restart's driver took before the hold withdrew
    # them, are given back at the back of the queue)
    stale = [r for r in store.runs() if r.commit in (h.commit, h.base_commit) and r.seed >= 1000]
    assert stale and all(r.priority == -1 for r in stale if r.status == "queued"), [
        (r.commit[:7], r.status, r.priority) for r in stale]
    assert [e for e in rec.events(limit=1000) if "queued replication runs withdrawn" in e.message]
    store.dispose()
