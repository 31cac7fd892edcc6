"""Many hypotheses in flight (issue 22): the derived `max_in_flight`, the queue's order across looks,
and the simulated lab (`autoresearch init --harness sim`) measured through the real loop with its
driver working the queue in a thread of its own.

Real parts: git, SQLite, the sandboxed local executor, the CLI, the graph, the gate.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from support.lab import cli, git

from agent.loop import in_flight_room

pytestmark = pytest.mark.integration


@pytest.mark.unit
def test_one_hypothesis_at_a_time_where_one_first_look_fills_the_slots() -> None:
    assert in_flight_room(2, 8, 0, 0)  # nothing in flight: always one
    assert not in_flight_room(2, 8, 1, 0)  # a workstation: 8 runs of a first look fill 2 slots
    assert not in_flight_room(8, 8, 1, 0)


@pytest.mark.unit
def test_on_a_cluster_hypotheses_start_while_the_queue_is_shallow_up_to_a_bound() -> None:
    slots, first = 64, 8
    assert in_flight_room(slots, first, 1, 8)
    assert in_flight_room(slots, first, 5, 2 * slots + first - 1)
    assert not in_flight_room(slots, first, 5, 2 * slots + first)  # two rounds of stages queued: enough
    assert in_flight_room(slots, first, 23, 0)
    assert not in_flight_room(slots, first, 24, 0)  # at most 3 x slots / first look, however shallow


def sim_lab(root: Path, *, tasks: int = 2, sleep: float = 0.3, extra: str = "") -> Path:
    from agent.labinit import init_lab

    init_lab(root, harness="sim", suite="sim")
    research = root / "research.toml"
    text = research.read_text()
    names = ", ".join(f'"t{i}"' for i in range(1, tasks + 1))
    for old, new in (('tasks = ["t1", "t2", "t3", "t4", "t5", "t6", "t7", "t8"]', f"tasks = [{names}]"),
                     ("--sleep 2 ", f"--sleep {sleep:g} "), ("baseline_runs = 10", "baseline_runs = 5"),
                     ("looks = [1, 2, 5, 10]", "looks = [1, 2, 5]")):
        assert old in text, old
        text = text.replace(old, new)
    research.write_text(text + extra)
    git(root, "commit", "-qam", "a small simulated lab")
    git(root, "branch", "-f", "autoresearch/baseline", "HEAD")
    return root


def effect_branches(root: Path, effects: dict[str, float]) -> Path:
    """A branch per name off the baseline, each adding `effect_<name>.toml` with its effect (σ units)."""
    for name, effect in effects.items():
        git(root, "checkout", "-qb", name, "autoresearch/baseline")
        (root / f"effect_{name}.toml").write_text(f"effect = {effect}\n")
        git(root, "add", "-A")
        git(root, "commit", "-qm", name)
    git(root, "checkout", "-q", "main")
    return root


def test_a_look_queues_both_arms_at_its_priority_and_raises_a_queued_baseline_run(tmp_path: Path) -> None:
    from pipeline import experiment, labrepo
    from pipeline.experiment import Experiment
    from pipeline.lab import load_lab

    root = effect_branches(sim_lab(tmp_path / "lab"), {"a": 1.0, "b": 1.0})
    lab = load_lab(root)
    store = experiment.open_store(lab)
    exp = Experiment(lab, store)
    base = "autoresearch/baseline"
    shallow = exp.queue_look(base, "a", 1)
    deep = exp.queue_look(base, "b", 2, rank=60)
    assert exp.run_priority(1) < exp.run_priority(1, rank=60) < exp.run_priority(2) < exp.run_priority(5)
    runs = {r.id: r for r in store.runs(shallow + deep)}
    a, b = labrepo.resolve_commit(lab, "a"), labrepo.resolve_commit(lab, "b")
    base_sha = labrepo.resolve_commit(lab, base)
    assert {r.priority for r in runs.values() if r.commit == a} == {exp.run_priority(1)}
    assert {r.priority for r in runs.values() if r.commit == b} == {exp.run_priority(2, rank=60)}
    # the baseline's runs: the deeper look raised every one it waits for (none is lowered)
    assert {r.priority for r in runs.values() if r.commit == base_sha} == {exp.run_priority(2, rank=60)}
    assert exp.queue_look(base, "a", 1) == shallow  # idempotent: no new run, no priority lowered
    assert {r.priority for r in store.runs(shallow) if r.commit == base_sha} == {exp.run_priority(2, rank=60)}
    # claimed in that order: the deeper look's runs (both arms) before the shallower look's challenger
    from pipeline.store import Owner

    order = [c.run.commit for c in store.claim(Owner.current(), len(runs))]
    assert order.index(a) > max(i for i, c in enumerate(order) if c in (b, base_sha))


def seed_effects(root: Path, effects: list[float]) -> list[int]:
    ids = []
    for i, e in enumerate(effects, start=1):
        spec = root.parent / f"h{i}.json"
        spec.write_text(json.dumps({"title": f"h{i} {e:+g} sigma",
                                    "edits": [{"path": f"effect_h{i}.toml", "content": f"effect = {e}\n"}]}))
        out = cli(root, "seed", "--file", str(spec))
        assert out.returncode == 0, out.stderr
        ids.append(int(out.stdout.strip()))
    return ids


@pytest.mark.system
def test_the_simulated_lab_keeps_several_hypotheses_in_flight_on_more_slots_than_a_look_has_runs(tmp_path: Path):
    """8 slots, 2 tasks (a first look is 2 runs): `max_in_flight` unset, so the loop starts more
    hypotheses while the queue is shallow. Runs of different hypotheses run at once; every one is
    decided; the planted 4σ gain is promoted, the -4σ harm never."""
    from support.lab import records

    root = sim_lab(tmp_path / "lab")
    effects = [0.0, 4.0, 0.0, -4.0, 0.0, 0.0]
    ids = seed_effects(root, effects)
    out = cli(root, "run", "--offline", "--max-hypotheses", str(len(ids)), "--workers", "8", "--json", timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rec = records(root)
    hs = {i: rec.get(i) for i in ids}
    assert all(h.status == "done" and h.decision in ("promote", "abandon") for h in hs.values()), hs
    assert hs[ids[1]].decision == "promote" and hs[ids[3]].decision == "abandon"
    # more than one hypothesis's challenger runs were running at the same moment
    con = sqlite3.connect(root / "runs" / "autoresearch.db")
    try:
        commits = [hs[i].commit for i in ids]
        spans = con.execute(f'SELECT "commit", started_at, finished_at FROM run WHERE "commit" IN '
                            f'({", ".join("?" * len(commits))}) AND finished_at IS NOT NULL', commits).fetchall()
    finally:
        con.close()
    overlapping = {c1 for c1, s1, f1 in spans for c2, s2, f2 in spans if c1 != c2 and s1 < f2 and s2 < f1}
    assert len(overlapping) >= 2, spans


def test_a_looks_verdict_does_not_move_when_other_runs_of_its_baseline_finish_later(tmp_path: Path) -> None:
    """The gate's variance prior at a look is the baseline's runs the look waits for and those
    finished before the comparison was first recorded: a deeper look of another challenger that
    finishes meanwhile changes nothing (judged again, the same record), and a comparison recorded
    after those runs borrows them (a different σ_task on the same pairs)."""
    import time

    from pipeline import experiment, labrepo
    from pipeline.experiment import Experiment
    from pipeline.lab import load_lab
    from pipeline.store import Owner, Result

    root = sim_lab(tmp_path / "lab")
    for name in ("a", "b", "c"):
        git(root, "checkout", "-qb", name, "autoresearch/baseline")
        (root / f"effect_{name}.toml").write_text("effect = 1.0\n")
        git(root, "add", "-A")
        git(root, "commit", "-qm", name)
    git(root, "checkout", "-q", "main")
    lab = load_lab(root)
    store = experiment.open_store(lab)
    exp = Experiment(lab, store)
    base = "autoresearch/baseline"
    base_sha = labrepo.resolve_commit(lab, base)
    level = {0: 0.50, 1: 0.53, 2: 0.46, 3: 0.56, 4: 0.44}

    def finish(commit: str, lift: float) -> None:
        sha = labrepo.resolve_commit(lab, commit)
        for claim in store.claim(Owner.current(), 100, commits=[sha]):
            r = claim.run
            value = level[r.seed] + 0.01 * int(r.task[1:]) + lift + 0.002 * (r.seed % 2)
            assert store.finish(claim, Result(run_id=r.id, commit=sha, task=r.task, seed=r.seed, value=value,
                                              dataset_id="sim-s0"))
        time.sleep(0.01)  # the next rows are created strictly later

    exp.queue_look(base, "a", 2)
    finish(base, 0.0)
    finish("a", 0.02)
    first = exp.judge_look(base, "a", 2).to_json()
    exp.queue_look(base, "b", 5)  # another challenger's deeper look: baseline seeds 2-4
    finish(base, 0.0)
    assert len(store.results_for(base_sha)) == 2 * 5
    assert exp.judge_look(base, "a", 2).to_json() == first
    exp.queue_look(base, "c", 2)  # recorded after seeds 2-4 finished: they are its prior
    finish("c", 0.02)
    later = exp.judge_look(base, "c", 2).to_json()
    assert [t["delta"] for t in later["tasks"]] == pytest.approx([t["delta"] for t in first["tasks"]])
    assert later["horizontal"] != first["horizontal"]
    store.dispose()
