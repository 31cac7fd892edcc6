"""The measurement environment: what it counts, the cache key, each result's record, the gate's hold
on a gain measured across a change, and the loop's re-measuring of its baseline after one. Real
installed distributions, a real lab repo and driver, SQLite and PostgreSQL."""

from __future__ import annotations

import copy
import json
from importlib import metadata
from pathlib import Path

import pytest

from support.tiny import TASKS, TinyHarness, commit_change, make_lab
from pipeline import environment, experiment, runner
from pipeline.dag import cache_key
from pipeline.environment import Environment, change, gpu_models, held_for, imbalance, node_facts
from pipeline.executors.local import LocalExecutor
from pipeline.lab import RunSection, StageSpec
from pipeline.labrepo import LabRepo
from pipeline.store import CacheEntry, Result, Store
from test_exec_store import db  # noqa: F401  (SQLite and PostgreSQL, a private schema each)

BASE = "autoresearch/baseline"


def facts_with(**versions: str) -> dict:
    """This machine's facts with some distributions at other versions (an upgrade, as the driver sees it)."""
    facts = copy.deepcopy(node_facts())
    facts["packages"].update(versions)
    return facts


@pytest.mark.unit
def test_the_facts_are_this_interpreters_installed_distributions() -> None:
    facts = node_facts()
    assert facts["packages"]["numpy"] == metadata.version("numpy")
    assert facts["packages"]["gitpython"] == metadata.version("GitPython")  # names normalised as PEP 503 does
    assert facts["python"].split()[1].startswith("3.") and facts["machine"]


@pytest.mark.unit
def test_names_and_versions_are_read_from_the_metadata_headers_as_the_full_parse_reads_them(tmp_path: Path) -> None:
    """`installed` reads each distribution's Name and Version from its header lines (the full email
    parse of every METADATA was half a second of every `status`): the same answers for every
    distribution of this interpreter, and the full parse where the headers do not say."""
    from pipeline.environment import _name_version, installed

    full = {}
    for dist in metadata.distributions():
        if dist.metadata and dist.metadata["Name"]:
            full.setdefault(environment.normalise(dist.metadata["Name"]), dist.version)
    assert installed() == dict(sorted(full.items())) and len(full) > 20
    odd = tmp_path / "odd-1.0.dist-info"
    odd.mkdir()
    # folded headers before Name, a body line that looks like a header: only the header block counts
    (odd / "METADATA").write_text("Metadata-Version: 2.1\nSummary: a\n  folded line\nName: Odd.Pkg\n"
                                  "Version: 1.0rc1\n\nName: not-this\nVersion: 9\n")
    assert _name_version(metadata.PathDistribution(odd)) == ("Odd.Pkg", "1.0rc1")
    (odd / "METADATA").write_text("Metadata-Version: 2.1\nName: nover\n")
    assert _name_version(metadata.PathDistribution(odd)) == ("nover", None)  # no version: not counted
    (odd / "METADATA").unlink()
    assert _name_version(metadata.PathDistribution(odd)) == (None, None)


@pytest.mark.unit
def test_the_numerical_stack_counts_by_default_every_distribution_with_a_star() -> None:
    facts = node_facts()
    default = RunSection().environment_of(facts)
    names = dict(default.packages)
    assert names["numpy"] == metadata.version("numpy") and "gitpython" not in names and "typer" not in names
    every = RunSection(environment=["*"]).environment_of(facts)
    assert dict(every.packages) == facts["packages"]
    own = RunSection(environment=["numpy", "GitPython"]).environment_of(facts)  # a lab's own list, any spelling
    assert sorted(dict(own.packages)) == ["gitpython", "numpy"]
    assert len({default.id, every.id, own.id}) == 3


@pytest.mark.unit
def test_ids_are_stable_and_the_record_reads_back_as_the_same_environment() -> None:
    env = RunSection().environment_of(node_facts())
    again = Environment.from_doc(json.loads(json.dumps(env.doc())))
    assert again == env and again.id == env.id and again.software_id == env.software_id
    upgraded = RunSection().environment_of(facts_with(numpy="9.9.9"))
    assert upgraded.software_id != env.software_id
    # a distribution outside the lab's list changes nothing
    assert RunSection().environment_of(facts_with(typer="0.0.1")).id == env.id


def fake_gpus(root: Path, models: list[str]) -> str:
    for i, model in enumerate(models):
        d = root / f"0000:{i:02x}:00.0"
        d.mkdir(parents=True)
        (d / "information").write_text(f"Model: \t\t {model}\nIRQ:   \t\t 42\nGPU UUID: \t GPU-{i}\n"
                                       f"Device Minor: \t {i}\n")
    return str(root)


@pytest.mark.unit
def test_a_gpu_lab_counts_the_gpu_models_a_cpu_lab_does_not(tmp_path: Path) -> None:
    proc = fake_gpus(tmp_path / "gpus", ["NVIDIA H200", "NVIDIA H200", "NVIDIA A100-SXM4-80GB"])
    assert gpu_models(proc) == ["NVIDIA A100-SXM4-80GB", "NVIDIA H200"]
    assert gpu_models(str(tmp_path / "none")) == []
    facts = node_facts(proc)
    gpu_lab = RunSection(gpus=0.25).environment_of(facts)
    assert gpu_lab.gpus == ("NVIDIA A100-SXM4-80GB", "NVIDIA H200")
    assert RunSection(score_gpus=1).environment_of(facts).gpus == gpu_lab.gpus  # a GPU scorer counts too
    assert RunSection().environment_of(facts).gpus == ()
    other = RunSection(gpus=0.25).environment_of({**facts, "gpus": ["NVIDIA H100 80GB HBM3"]})
    assert other.software_id == gpu_lab.software_id and other.id != gpu_lab.id
    assert "GPU NVIDIA A100-SXM4-80GB, NVIDIA H200 → NVIDIA H100 80GB HBM3" in change(gpu_lab, other)


@pytest.mark.unit
def test_the_change_says_what_moved() -> None:
    old = Environment("CPython 3.11.7", "x86_64", (("numpy", "2.0.0"), ("scipy", "1.13.0"), ("torch", "2.11.0")))
    new = Environment("CPython 3.12.1", "x86_64", (("numpy", "2.0.0"), ("torch", "2.12.0"), ("triton", "3.1.0")))
    assert change(old, new) == "CPython 3.11.7 → CPython 3.12.1, scipy removed, torch 2.11.0 → 2.12.0, triton added (3.1.0)"
    assert change(old, old) == ""
    assert change(old, Environment(old.python, old.machine, old.packages, stage_env="stage-env-2")) == "sandbox ? → stage-env-2"
    many = Environment(old.python, old.machine, tuple((f"p{i}", "2") for i in range(10)))
    assert change(Environment(old.python, old.machine, tuple((f"p{i}", "1") for i in range(10))), many).endswith("4 more")


@pytest.mark.unit
def test_imbalance_is_the_net_one_way_move_between_the_arms() -> None:
    keys = [(t, s) for t in "abc" for s in range(10)]
    assert imbalance({k: "A" for k in keys}, {k: "A" for k in keys}) is None
    share, b, c, n, pairs = imbalance({k: "A" for k in keys}, {k: "B" for k in keys})  # an upgrade between the arms
    assert (share, b, c, n, pairs) == (1.0, "A", "B", 30, 30)
    # a mixed cluster: as many pairs one way as the other, whatever the arm
    mixed_b = {k: "AB"[i % 2] for i, k in enumerate(keys)}
    mixed_c = {k: "AB"[(i // 2) % 2] for i, k in enumerate(keys)}
    got = imbalance(mixed_b, mixed_c)
    assert got is not None and got[0] <= environment.IMBALANCE_HOLD
    # unknown environments (results made before they were recorded) are left out
    assert imbalance({k: None for k in keys}, {k: "B" for k in keys}) is None


@pytest.mark.unit
def test_a_gain_is_held_for_an_upgrade_between_the_arms_not_for_a_mixed_clusters_chance() -> None:
    three = [("a", 0), ("b", 0), ("c", 0)]
    # a first look of three pairs, the arms in two environments: held however few the pairs
    assert held_for({k: "A" for k in three}, {k: "B" for k in three}) is not None
    # two environments on both arms, the pairs split as a coin would: not held ...
    keys = [(t, s) for t in "abc" for s in range(10)]
    base = {k: "AB"[i % 2] for i, k in enumerate(keys)}
    chal = {k: "AB"[(i * 7 // 3) % 2] for i, k in enumerate(keys)}
    got = imbalance(base, chal)
    assert got is not None and held_for(base, chal) is None
    # ... nor a lopsided split of few moved pairs (5 one way, 1 the other of 12: p = 0.22) ...
    def arms(moves: list[tuple[str, str]]) -> tuple[dict, dict]:
        return ({("a", i): b for i, (b, _) in enumerate(moves)}, {("a", i): c for i, (_, c) in enumerate(moves)})

    few = [("A", "B")] * 5 + [("B", "A")] + [("A", "A")] * 3 + [("B", "B")] * 3
    assert imbalance(*arms(few))[0] > environment.IMBALANCE_HOLD and held_for(*arms(few)) is None
    # ... nor 9 one way and 1 the other (p = 0.021) ...
    nine = [("A", "B")] * 9 + [("B", "A")] + [("A", "A")] * 10 + [("B", "B")] * 10
    assert held_for(*arms(nine)) is None
    # ... while a lopsided move on a mixed cluster is (11 one way, 1 the other: p = 0.0063)
    lopsided = [("A", "B")] * 11 + [("B", "A")] + [("A", "A")] * 9 + [("B", "B")] * 9
    assert held_for(*arms(lopsided)) == (10 / 30, "A", "B", 10, 30)
    assert environment.sign_p(11, 12) < environment.HOLD_P < environment.sign_p(9, 10)
    # a lazy baseline: its first 2 seeds measured before the change, the rest with the challenger
    # after it; 16 of 80 pairs moved, all one way (a bias of a fifth of the shift): held
    lazy_b = {(t, s): ("A" if s < 2 else "B") for t in range(8) for s in range(10)}
    assert held_for(lazy_b, {k: "B" for k in lazy_b}) == (0.2, "A", "B", 16, 80)


@pytest.mark.unit
def test_the_environment_is_part_of_every_stage_key_gpu_models_included(tmp_path: Path) -> None:
    spec = StageSpec(name="train", run="python train.py --out {out}", inputs=["train.py"])
    facts = node_facts(fake_gpus(tmp_path / "gpus", ["NVIDIA A100-SXM4-80GB"]))
    a100 = RunSection(gpus=1).environment_of(facts)
    h100 = RunSection(gpus=1).environment_of({**facts, "gpus": ["NVIDIA H100 80GB HBM3"]})
    k = [cache_key(spec, {"train.py": "blob"}, {"seed": 0}, {}, "ds", "sandbox", env.id) for env in (a100, h100, a100)]
    assert k[0] == k[2] != k[1]  # a model trained on one GPU never serves a run on another


# --------------------------------------------------------------- a real driver, SQLite and PostgreSQL

def drive(lab, store, commit: str, seeds: list[int], facts: dict | None, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Run the tiny lab's runs of `commit` on `seeds` with a driver that sees `facts` (None: this machine's)."""
    monkeypatch.setattr(environment, "_FACTS", {environment.NVIDIA_PROC: facts} if facts is not None else {})
    harness = TinyHarness()
    ids = experiment.ensure_runs(store, lab, commit, TASKS, seeds, harness=harness)
    with runner.Driver(lab, store, LocalExecutor(preload=("numpy",), slots=2), harness=harness) as d:
        d.drive(until=ids, timeout_s=120)
    return ids


@pytest.mark.integration
def test_results_record_where_they_were_measured_and_an_upgrade_runs_every_stage_again(
        tmp_path: Path, db, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    lab = make_lab(tmp_path / "lab")
    store = Store(db[0], schema=db[1])
    drive(lab, store, BASE, [0, 1], None, monkeypatch)
    here = RunSection().environment_of(node_facts())
    with store.session() as s:
        results = list(s.exec(Result.__table__.select()))  # type: ignore[attr-defined]
        entries = list(s.exec(CacheEntry.__table__.select()))  # type: ignore[attr-defined]
    assert len(results) == 6 and {r.env_id for r in results} == {here.id}
    assert entries and {e.env_id for e in entries} == {here.id}
    assert store.envs([here.id]) == {here.id: here}
    # a fine-tuning change in the same environment reuses the pretrained models ...
    same = commit_change(lab.root, "h1", "config.toml", "shrink = 0.1", "shrink = 0.2")
    served = drive(lab, store, same, [0], None, monkeypatch)
    assert {e.outcome for e in store.stage_execs(served) if e.stage == "pretrain"} <= {"cache_hit", "shared"}
    # ... after numpy was "upgraded", nothing made before serves a run: pretraining runs again
    upgraded = facts_with(numpy="9.9.9")
    new_env = lab.config.run.environment_of(upgraded)
    other = commit_change(lab.root, "h2", "config.toml", "shrink = 0.1", "shrink = 0.3")
    ran = drive(lab, store, other, [0], upgraded, monkeypatch)
    assert {e.outcome for e in store.stage_execs(ran) if e.stage == "pretrain"} <= {"ok", "shared"}
    assert any(e.outcome == "ok" for e in store.stage_execs(ran) if e.stage == "pretrain")
    rows = store.result_rows([experiment.resolve_commit(lab, c) for c in (BASE, same, other)], TASKS)
    assert {r.env_id for r in rows if r.commit == other} == {new_env.id}
    assert {r.env_id for r in rows if r.commit != other} == {here.id}
    with store.session() as s:
        made = {e.env_id for e in s.exec(CacheEntry.__table__.select())}  # type: ignore[attr-defined]
    assert made == {here.id, new_env.id}


@pytest.fixture
def tiny_registered():
    from pipeline.harness import HARNESSES

    HARNESSES.register("tiny", TinyHarness)  # what a plugin does (the lab names it): `Lab.tasks` reads it
    yield
    HARNESSES.unregister("tiny")


@pytest.mark.integration
def test_a_gain_measured_across_an_upgrade_is_held_and_the_loop_remeasures_its_baseline(
        tmp_path: Path, db, monkeypatch: pytest.MonkeyPatch, tiny_registered) -> None:  # noqa: F811
    lab = make_lab(tmp_path / "lab")
    store = Store(db[0], schema=db[1])
    exp = experiment.Experiment(lab, store)
    base = experiment.resolve_commit(lab, BASE)
    drive(lab, store, base, [0, 1], None, monkeypatch)
    here = lab.config.run.environment_of(node_facts())
    assert exp.environment_change(here) is None
    # a challenger measured within the same environment: no hold
    same = commit_change(lab.root, "h1", "model.py", "SCALE = 1.0", "SCALE = 1.01")
    drive(lab, store, same, [0, 1], None, monkeypatch)
    assert exp.mixed_environments(base, same, 2) is None
    # numpy "upgraded" between the arms: every pair moved one way
    upgraded = facts_with(numpy="9.9.9")
    after = commit_change(lab.root, "h2", "model.py", "SCALE = 1.0", "SCALE = 1.02")
    drive(lab, store, after, [0, 1], upgraded, monkeypatch)
    why = exp.mixed_environments(base, after, 2)
    assert why is not None and f"numpy {node_facts()['packages']['numpy']} → 9.9.9" in why and "6 more of its 6 pairs" in why
    # the loop, started in the upgraded environment, re-measures the baseline: the same tree on a new commit
    new_env = lab.config.run.environment_of(upgraded)
    head, what = exp.environment_change(new_env)
    assert head == base and "numpy" in what
    repo = LabRepo(lab.root)
    commit = repo.remeasure(head, f"Re-measure the baseline: {what}")
    assert repo.baseline_head() == commit and commit != base
    assert repo.repo.commit(commit).tree == repo.repo.commit(base).tree
    assert repo.repo.commit(commit).parents[0].hexsha == base
    assert exp.generation(commit) == exp.generation(base)  # the same seed block
    from pipeline.errors import PromotionConflict

    with pytest.raises(PromotionConflict):  # only from the head it read
        repo.remeasure(base, "again")
    drive(lab, store, commit, [0, 1], upgraded, monkeypatch)
    assert exp.mixed_environments(commit, after, 2) is None  # compared within one environment now
    assert exp.environment_change(new_env) is None


@pytest.mark.integration
def test_the_loop_started_after_an_upgrade_remeasures_its_baseline_once_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_registered) -> None:
    from agent.loop import Loop, LoopOptions
    from pipeline.api import ExecutorOptions

    lab = make_lab(tmp_path / "lab")
    store = experiment.open_store(lab)
    base = experiment.resolve_commit(lab, BASE)
    drive(lab, store, base, [0, 1], None, monkeypatch)
    said: list[str] = []

    def loop() -> Loop:
        return Loop(lab, LoopOptions(offline=True, smoke=False, executor=ExecutorOptions(workers=1)), progress=said.append)

    first = loop()
    try:  # the same environment: nothing to do
        assert first.remeasure_baseline(lab.config.run.environment_of(node_facts())) is None
    finally:
        first.close()
    upgraded = lab.config.run.environment_of(facts_with(numpy="9.9.9"))
    second = loop()
    try:
        commit = second.remeasure_baseline(upgraded)
        assert commit is not None and LabRepo(lab.root).baseline_head() == commit
        events = second.records.events()
        assert events[0].kind == "environment" and "numpy" in events[0].message and commit[:10] in events[0].message
        assert second.remeasure_baseline(upgraded) is None  # the new head has no runs yet: nothing to compare
    finally:
        second.close()
    # a lab that asks for no re-measuring: the branch stays, the loop says what gains will be held for
    off = lab.config.model_copy(update={"run": lab.config.run.model_copy(update={"remeasure_on_change": False})})
    monkeypatch.setattr(lab, "config", off)
    drive(lab, store, commit, [0], None, monkeypatch)  # the re-measured head, in this machine's environment
    third = loop()
    try:
        assert third.remeasure_baseline(upgraded) is None and LabRepo(lab.root).baseline_head() == commit
        assert "remeasure_on_change = false" in said[-1]
    finally:
        third.close()


# --------------------------------------------------------------- the real loop, a simulated lab

@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("remeasure", [False, True])
def test_through_the_loop_a_planted_gain_across_an_upgrade_is_held_or_measured_against_a_remeasured_baseline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, remeasure: bool) -> None:
    """The baseline's own runs measured under numpy X; the loop then runs under numpy 9.9.9 with a
    seeded 4σ hypothesis. Re-measuring off: the gain is held for a human, the hold naming the
    change. On: the loop first puts the baseline's tree on a new commit, measures it here, and
    promotes the gain against it, with no hold."""
    import pipeline.api
    from support.lab import git, make_loop, open_lab
    from test_in_flight import seed_effects, sim_lab

    root = sim_lab(tmp_path / "lab")
    if not remeasure:
        text = (root / "research.toml").read_text().replace("[run]\n", "[run]\nremeasure_on_change = false\n", 1)
        (root / "research.toml").write_text(text)
        git(root, "commit", "-qam", "no re-measuring")
        git(root, "branch", "-f", "autoresearch/baseline", "HEAD")
    lab = open_lab(root)
    base = experiment.resolve_commit(lab, BASE)
    store = experiment.open_store(lab)
    exp = experiment.Experiment(lab, store)
    own = list(exp.baseline_seeds(base))
    monkeypatch.setattr(environment, "_FACTS", {})
    with exp.driver() as d:  # the baseline's own block, in this machine's environment
        ids = experiment.ensure_runs(store, lab, base, lab.tasks(), own)
        d.drive(until=ids, timeout_s=300)
    old = lab.config.run.environment_of(node_facts())
    [hid] = seed_effects(root, [4.0])
    upgraded = facts_with(numpy="9.9.9")
    monkeypatch.setattr(environment, "_FACTS", {environment.NVIDIA_PROC: upgraded})
    monkeypatch.setattr(pipeline.api, "environment_facts", lambda: upgraded)  # the loop's own look: no change
    loop = make_loop(root, offline=True, max_hypotheses=1)
    try:
        loop.run()
    finally:
        loop.close()
    h = loop.records.get(hid)
    head = experiment.resolve_commit(open_lab(root), BASE)
    numpy_change = f"numpy {node_facts()['packages']['numpy']} → 9.9.9"
    if not remeasure:
        assert h.status == "held" and h.decision == "hold", (h.status, h.decision, h.rationale_decision)
        assert "measurement environment" in h.rationale_decision and numpy_change in h.rationale_decision
        assert head == base and any("remeasure_on_change = false" in m for m in loop.said)
    else:
        assert h.decision == "promote", (h.status, h.decision, h.rationale_decision)
        assert "environment" not in (h.rationale_decision or "")
        events = [e for e in loop.records.events(20) if e.kind == "environment"]
        assert len(events) == 1 and numpy_change in events[0].message
        assert h.base_commit != base  # measured against the re-measured baseline ...
        remeasured = LabRepo(root).repo.commit(h.base_commit)
        assert remeasured.parents[0].hexsha == base and remeasured.tree == LabRepo(root).repo.commit(base).tree
        rows = store.result_rows([h.base_commit], lab.tasks())  # ... whose runs were made here, afresh
        assert rows and {r.env_id for r in rows} == {lab.config.run.environment_of(upgraded).id} != {old.id}


@pytest.mark.integration
@pytest.mark.slow  # 12-30 s of simulation: the full suite runs it
def test_the_environment_shift_benchmark_runs_and_nothing_of_an_upgrade_is_promoted_unheld() -> None:
    """`benchmarks/environment_shift.py` on a few trials, so it cannot rot: under an upgrade between
    the arms the gate's false gains grow with the shift, and none is promoted without a human."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "environment_shift.py"), "--trials", "400"],
                         capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    start = lines.index(next(x for x in lines if x.startswith("upgrade between the arms"))) + 2
    upgrade = [[float(v) for v in x.split()] for x in lines[start:start + 4]]
    assert [row[0] for row in upgrade] == [0.0, 0.25, 0.5, 1.0]
    assert upgrade[-1][1] > 0.2  # a 1σ shift: the gate alone calls many null challengers improvements
    assert all(row[2] == 0.0 for row in upgrade)  # the hold: none of them promoted automatically


@pytest.mark.integration
@pytest.mark.slow
def test_an_upgrade_under_the_running_loop_stops_it_and_the_next_start_remeasures(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`pip install -U numpy` into the loop's venv while it runs: its warm workers hold the old
    modules, so it stops (`environment changed`, an event) instead of measuring in neither
    environment; started again, it re-measures the baseline in the new one and goes on."""
    import pipeline.api
    from agent.loop import ENVIRONMENT_CHANGED, guards
    from support.lab import make_loop, open_lab
    from test_in_flight import seed_effects, sim_lab

    root = sim_lab(tmp_path / "lab", sleep=2.0)  # a look of seconds: the upgrade lands while it runs
    real, upgraded = node_facts(), facts_with(numpy="9.9.9")
    monkeypatch.setattr(environment, "_FACTS", {environment.NVIDIA_PROC: real})  # what the driver starts with
    lab = open_lab(root)
    store = experiment.open_store(lab)
    exp = experiment.Experiment(lab, store)
    base = experiment.resolve_commit(lab, BASE)
    with exp.driver() as d:  # the baseline's own block, measured before the upgrade
        d.drive(until=experiment.ensure_runs(store, lab, base, lab.tasks(), list(exp.baseline_seeds(base))),
                timeout_s=300)
    [hid] = seed_effects(root, [0.0])
    seen: list[str] = []

    def installed_now() -> dict:
        """The upgrade lands once one of the hypothesis's runs is running: the loop waits on its look."""
        running = any(r.status == "running" and r.commit != base for r in store.runs())
        seen.append("upgraded" if running else "real")
        return upgraded if running else real

    monkeypatch.setattr(pipeline.api, "environment_facts", installed_now)
    monkeypatch.setattr(guards, "ENV_CHECK_S", 0.0)
    loop = make_loop(root, offline=True, max_hypotheses=1)
    try:
        out = loop.run()
    finally:
        loop.close()
    assert out["stopped"] == ENVIRONMENT_CHANGED and seen[-1] == "upgraded" and "real" in seen
    [ev] = [e for e in loop.records.events(20) if e.kind == "environment"]
    assert "under the running loop" in ev.message and "numpy" in ev.message and "9.9.9" in ev.message
    assert loop.records.get(hid).status == "measuring"  # stopped in its look; resumed by the next start
    assert not [r for r in store.runs() if r.status == "running"]  # its runs given back to the queue
    # the next start, in the new environment: the baseline is re-measured, the hypothesis decided
    monkeypatch.setattr(environment, "_FACTS", {environment.NVIDIA_PROC: upgraded})
    monkeypatch.setattr(pipeline.api, "environment_facts", lambda: upgraded)
    again = make_loop(root, offline=True, max_hypotheses=1)
    try:
        out = again.run()
    finally:
        again.close()
    assert out["stopped"] is None and again.records.get(hid).status == "done"
    kinds = [e.message for e in again.records.events(20) if e.kind == "environment"]
    assert len(kinds) == 2 and "measured again as" in kinds[0]  # newest first


@pytest.mark.integration
def test_check_names_the_environment_and_warns_of_a_pattern_that_matches_nothing(tmp_path: Path, tiny_registered) -> None:
    from agent.commands import check_lab
    from support.tiny import git

    lab = make_lab(tmp_path / "lab")
    summary, warnings = check_lab(lab.root, {})
    assert summary["environment"].startswith("CPython") and not [w for w in warnings if "environment" in w]
    text = (lab.root / "research.toml").read_text().replace("[run]\n", '[run]\nenvironment = ["numpy", "torhc*"]\n', 1)
    (lab.root / "research.toml").write_text(text)
    git(lab.root, "commit", "-qam", "count numpy and a typo")
    summary, warnings = check_lab(lab.root, {})
    assert f"numpy {metadata.version('numpy')}" in summary["environment"]
    assert warnings == ["[run] environment: 'torhc*' matches no distribution installed on this machine, so no version "
                        "of it is counted here"]


@pytest.mark.unit
def test_the_pairing_statistics_in_plain_python_equal_numpys() -> None:
    """`lab_pairing` (every `status`) computes the seed-k statistics of 500 comparisons in plain
    Python: the same correlation, paired sd and variance ratio as numpy's, and None where numpy's
    are undefined (fewer than 2 or 3 pairs, a constant side)."""
    import random

    import numpy as np

    from pipeline.variance import _pair_stats

    rng = random.Random(7)
    cases = [([1.0, 1.0, 1.0], [2.0, 2.0, 2.0]), ([], []), ([0.5], [0.7])]
    cases += [([rng.gauss(0, 1) for _ in range(n)],) for n in (2, 3, 5, 10, 30) for _ in range(60)]
    for case in cases:
        b = case[0]
        c = case[1] if len(case) > 1 else [v + rng.gauss(0, 0.5) for v in b]
        got = _pair_stats(b, c)
        x, y = np.array(b, dtype=float), np.array(c, dtype=float)
        n = len(x)
        assert got["pairs"] == n
        want_sd = float(x.std(ddof=1)) if n > 1 else None
        assert (got["sd"] is None) == (want_sd is None) and (want_sd is None or abs(got["sd"] - want_sd) < 1e-9)
        if n < 2:
            assert got["sd_paired_difference"] is None and got["variance_ratio"] is None
            continue
        assert abs(got["sd_paired_difference"] - float((y - x).std(ddof=1))) < 1e-9
        unpaired = x.var(ddof=1) + y.var(ddof=1)
        ratio = float((y - x).var(ddof=1) / unpaired) if unpaired > 0 else None
        assert (got["variance_ratio"] is None) == (ratio is None)
        assert ratio is None or abs(got["variance_ratio"] - ratio) < 1e-9
        corr = float(np.corrcoef(x, y)[0, 1]) if n > 2 and x.std() > 0 and y.std() > 0 else None
        assert (got["pair_correlation"] is None) == (corr is None)
        assert corr is None or abs(got["pair_correlation"] - corr) < 1e-9
