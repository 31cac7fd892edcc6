"""Decisions against the current baseline (issue 22): with several hypotheses in flight, one measured
against baseline A0 that reaches its promotion after another was promoted to A1 is re-based (merged
onto A1 without a working tree), measured again against A1 from its first look, and promoted only on
that comparison; a conflict with A1 is an abandon with the reason and nothing half-merged.

Everything is real: the numpy lab of `autoresearch init --harness command` (no torch), its train.py
given two planted settings that interact (each alone sharpens its under-confident predictions, both
together over-sharpen them: a gain alone, a harm together), git, SQLite, the gate, and `autoresearch
run --offline` with `[agent] max_in_flight = 2` through the CLI.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from support.lab import cli, git, make_branch

from agent.labinit import init_lab

pytestmark = pytest.mark.system

BASELINE = "autoresearch/baseline"

# train.py's planted interaction: the fitted logits are scaled by SHARPNESS[(sharpen, stretch)]
PLANTED = '''
# planted for tests/test_rebase.py: either setting alone sharpens the under-confident predictions (a
# gain), both together over-sharpen them (a harm)
SHARPNESS = {(False, False): 0.3, (True, False): 1.0, (False, True): 1.0, (True, True): 10.0}
scale = SHARPNESS[(bool(cfg.get("sharpen", False)), bool(cfg.get("stretch", False)))]
prob = 1 / (1 + np.exp(-scale * (features(test["x"]) @ w)))
'''


def planted_lab(root: Path) -> Path:
    """The command lab, two tasks, looks 1 → 2 → 3, two planted settings in config.toml."""
    init_lab(root, harness="command")
    research = (root / "research.toml").read_text()
    for old, new in (('tasks = ["default", "churn", "fraud"]', 'tasks = ["default", "churn"]'),
                     ("baseline_runs = 10", "baseline_runs = 3"), ("looks = [1, 2, 5, 10]", "looks = [1, 2, 3]"),
                     ('model = "gpt-4.1-mini"', 'model = "gpt-4.1-mini"\nmax_in_flight = 2')):
        assert old in research, old
        research = research.replace(old, new)
    (root / "research.toml").write_text(research)
    train = (root / "train.py").read_text()
    old = 'prob = 1 / (1 + np.exp(-features(test["x"]) @ w))\n'
    assert old in train
    (root / "train.py").write_text(train.replace(old, PLANTED))
    config = (root / "config.toml").read_text()
    assert config.startswith("[train]\n")  # the two settings far apart: a change of each merges with the other
    (root / "config.toml").write_text(config.replace("[train]\n", "[train]\nsharpen = false\n", 1) + "stretch = false\n")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "planted lab: sharpen and stretch interact")
    git(root, "branch", "-f", BASELINE, "HEAD")
    return root


def refs(root: Path) -> set[str]:
    return set(git(root, "for-each-ref", "--format=%(refname) %(objectname)").splitlines())


def gate_records(root: Path, hypothesis: str, kind: str) -> list[dict]:
    con = sqlite3.connect(root / "runs" / "autoresearch.db")
    try:
        rows = con.execute("SELECT payload FROM gate_record WHERE hypothesis = ? AND kind = ? ORDER BY look",
                           (hypothesis, kind)).fetchall()
    finally:
        con.close()
    return [json.loads(p) for (p,) in rows]


def seed_branch(root: Path, branch: str) -> int:
    out = cli(root, "seed", "--branch", branch, "--title", branch)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip())


def run_loop(root: Path) -> dict:
    out = cli(root, "run", "--offline", "--max-hypotheses", "2", "--workers", "2", "--json", timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def hypotheses(root: Path) -> dict[int, dict]:
    out = cli(root, "status", "--json")
    assert out.returncode == 0, out.stderr
    return {h["id"]: h for h in json.loads(out.stdout)["hypotheses"]}


def store_records(root: Path):
    from agent.records import Records
    from pipeline import experiment
    from pipeline.lab import load_lab

    return Records(experiment.open_store(load_lab(root)))


def test_two_gains_that_harm_together_the_second_is_rebased_measured_against_a1_and_not_promoted(tmp_path: Path):
    root = planted_lab(tmp_path / "lab")
    a0 = git(root, "rev-parse", BASELINE)
    commits = {"sharpen": make_branch(root, "sharpen", [("config.toml", "sharpen = false", "sharpen = true")]),
               "stretch": make_branch(root, "stretch", [("config.toml", "stretch = false", "stretch = true")])}
    ids = {seed_branch(root, "sharpen"): "sharpen", seed_branch(root, "stretch"): "stretch"}
    run_loop(root)

    rec = store_records(root)
    hs = [rec.get(i) for i in ids]
    (first,) = [h for h in hs if h.promoted_tag]
    (second,) = [h for h in hs if not h.promoted_tag]
    a1 = git(root, "rev-parse", BASELINE)
    # the first: promoted exactly as before, on its comparison with A0 (its base never moved): a
    # fast-forward to its own commit, no re-base, its looks only
    assert (first.decision, first.promoted_tag, first.base_commit) == ("promote", "baseline/v1", a0)
    assert first.commit == commits[ids[first.id]] == a1
    assert gate_records(root, str(first.id), "rebase") == []
    assert [r["look"] for r in gate_records(root, str(first.id), "verdict")] == [1, 2]
    assert git(root, "tag", "--list", "baseline/*").split() == ["baseline/v1"]

    # the second: a gain against A0 too, re-based onto A1 at its promotion, measured again and not promoted
    (moved,) = gate_records(root, str(second.id), "rebase")
    assert (moved["from_base"], moved["to_base"], moved["from_commit"]) == (a0, a1, commits[ids[second.id]])
    assert (moved["verdict"], moved["to_tag"]) == ("improvement", "baseline/v1")
    earlier = gate_records(root, moved["archived_as"], "verdict")
    assert earlier and earlier[-1]["verdict"] == "improvement"  # against A0: kept aside, never promoting
    con = sqlite3.connect(root / "runs" / "autoresearch.db")  # its decisions too, in the agent's table
    try:
        aside = [d for (d,) in con.execute("SELECT decision FROM agent_decision WHERE hypothesis = ? ORDER BY look",
                                           (moved["archived_as"],))]
    finally:
        con.close()
    assert aside and aside[-1] == "promote", aside
    assert second.base_commit == a1 and second.commit == moved["commit"]
    parents = git(root, "rev-list", "--parents", "-n", "1", second.commit).split()[1:]
    assert parents == [a1, commits[ids[second.id]]]  # a merge onto A1; the old commit stays in its history
    assert git(root, "rev-parse", f"exp/{second.id}^{{commit}}") == commits[ids[second.id]]
    assert git(root, "rev-parse", f"refs/heads/{second.branch}") == second.commit
    now = gate_records(root, str(second.id), "verdict")
    assert now and all(v["verdict"] in ("futile", "harm", "escalate") for v in now), now
    assert second.verdict in ("futile", "harm") and second.decision == "abandon" and not second.promoted_tag
    # its runs against A1 are on A1's seed block; A1's own runs serve as its baseline arm
    from pipeline import experiment
    from pipeline.lab import SEED_BLOCK, load_lab

    store = experiment.open_store(load_lab(root))
    seeds = {r.seed for r in store.runs(commit=second.commit)}
    assert seeds and all(SEED_BLOCK <= s < 2 * SEED_BLOCK for s in seeds), seeds
    # the record says why: re-based from A0, then its verdict against A1
    why = second.rationale_decision or ""
    assert why.startswith(f"Re-based from {BASELINE}@{a0[:10]} onto baseline/v1 before its promotion"), why
    assert f"against baseline/v1: The gate's verdict is {second.verdict}" in why, why
    summary = (root / "runs" / "summaries" / f"{second.id}.md").read_text()
    assert f"Re-based from {BASELINE}@{a0[:10]} onto baseline/v1" in summary
    events = [e.message for e in rec.events(50) if e.kind == "rebase"]
    assert events == [f"#{second.id} re-based from {BASELINE}@{a0[:10]} onto baseline/v1: its verdict improvement "
                      f"at look 2 against {BASELINE}@{a0[:10]} does not count; measured again against baseline/v1"]
    assert git(root, "rev-parse", BASELINE) == a1  # the baseline did not move again


def test_a_rebase_that_conflicts_is_abandoned_with_the_reason_and_nothing_half_merged(tmp_path: Path):
    root = planted_lab(tmp_path / "lab")
    a0 = git(root, "rev-parse", BASELINE)
    commits = {"sharpen": make_branch(root, "sharpen", [("config.toml", "sharpen = false", "sharpen = true")]),
               "sharpen-too": make_branch(root, "sharpen-too", [("config.toml", "sharpen = false",
                                                                  "sharpen = true  # the same, said otherwise")])}
    ids = {seed_branch(root, "sharpen"): "sharpen", seed_branch(root, "sharpen-too"): "sharpen-too"}
    before = refs(root)
    run_loop(root)

    rec = store_records(root)
    hs = [rec.get(i) for i in ids]
    (first,) = [h for h in hs if h.promoted_tag]
    (second,) = [h for h in hs if not h.promoted_tag]
    a1 = git(root, "rev-parse", BASELINE)
    assert a1 == first.commit == commits[ids[first.id]]
    assert (second.decision, second.status, second.verdict) == ("abandon", "done", "improvement")
    why = second.rationale_decision or ""
    assert why.startswith(f"Re-based from {BASELINE}@{a0[:10]} onto baseline/v1 before its promotion"), why
    assert "conflicts with" in why and "in config.toml" in why and "Abandoned: never measured against baseline/v1" in why
    assert "Traceback" not in why and "\n" not in why
    # nothing half-merged: no ref for it beyond its experiment tag, the baseline where the first put it
    new = {line.split()[0] for line in refs(root) - before}
    assert new == {f"refs/heads/{BASELINE}", "refs/tags/baseline/v1", "refs/tags/autoresearch/trusted",
                   *(f"refs/tags/exp/{i}" for i in ids)}, new  # (the trusted tag: the harness's, made at the first run)
    assert second.commit == commits[ids[second.id]] and second.base_commit == a0  # its record is untouched
    assert git(root, "rev-parse", f"exp/{second.id}^{{commit}}") == second.commit
    (moved,) = gate_records(root, str(second.id), "rebase")
    assert moved["commit"] is None and "config.toml" in moved["outcome"]
    assert git(root, "tag", "--list", "baseline/*").split() == ["baseline/v1"]


def test_merge_onto_is_deterministic_and_a_conflict_writes_no_ref(tmp_path: Path):
    from agent.errors import PromotionConflict
    from agent.workspace import Workspace
    from pipeline.lab import load_lab

    root = planted_lab(tmp_path / "lab")
    a = make_branch(root, "a", [("config.toml", "sharpen = false", "sharpen = true")])
    b = make_branch(root, "b", [("config.toml", "stretch = false", "stretch = true")])
    c = make_branch(root, "c", [("config.toml", "sharpen = false", "sharpen = true # c")])
    ws = Workspace(load_lab(root))
    before = refs(root)
    merged = ws.merge_onto(a, b, "hyp 2 re-based")
    assert ws.merge_onto(a, b, "hyp 2 re-based") == merged  # a re-run finds the same commit
    assert ws.read(merged, "config.toml").count("= true") == 2
    assert ws.merge_onto(a, merged, "x") == merged  # a commit that contains the head is its own re-base
    with pytest.raises(PromotionConflict) as info:
        ws.merge_onto(a, c, "hyp 3 re-based")
    assert "in config.toml" in str(info.value) and "\n" not in str(info.value)
    assert refs(root) == before  # objects only: no branch or tag moved or made


def test_an_approved_hold_whose_base_moved_is_rebased_and_measured_against_the_new_baseline(tmp_path: Path):
    """`--supervised`: both hypotheses are gains against A0 and wait for a human; both are approved.
    The first approval promotes (A1); the second's base has moved, so its approval is no promotion of
    an unmeasured merge: it is re-based onto A1, measured again, and abandoned there (a harm together)."""
    root = planted_lab(tmp_path / "lab")
    a0 = git(root, "rev-parse", BASELINE)
    make_branch(root, "sharpen", [("config.toml", "sharpen = false", "sharpen = true")])
    make_branch(root, "stretch", [("config.toml", "stretch = false", "stretch = true")])
    ids = [seed_branch(root, "sharpen"), seed_branch(root, "stretch")]
    out = cli(root, "run", "--offline", "--supervised", "--max-hypotheses", "2", "--workers", "2", "--json",
              timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    held = hypotheses(root)
    assert [(held[i]["status"], held[i]["verdict"]) for i in ids] == [("held", "improvement")] * 2, held
    assert git(root, "rev-parse", BASELINE) == a0  # nothing promoted without a human
    for i in ids:
        r = cli(root, "review", str(i), "--approve")
        assert r.returncode == 0, r.stderr
    out = cli(root, "run", "--offline", "--supervised", "--max-hypotheses", "2", "--workers", "2", "--json",
              timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]

    rec = store_records(root)
    first, second = rec.get(ids[0]), rec.get(ids[1])
    a1 = git(root, "rev-parse", BASELINE)
    assert (first.decision, first.promoted_tag, first.base_commit, first.commit) == ("promote", "baseline/v1", a0, a1)
    (moved,) = gate_records(root, str(second.id), "rebase")
    assert (moved["from_base"], moved["to_base"], moved["to_tag"]) == (a0, a1, "baseline/v1")
    assert second.base_commit == a1 and second.decision == "abandon" and not second.promoted_tag
    assert second.verdict in ("futile", "harm"), second.verdict
    why = second.rationale_decision or ""
    assert why.startswith(f"Re-based from {BASELINE}@{a0[:10]} onto baseline/v1 before its promotion"), why
    assert git(root, "tag", "--list", "baseline/*").split() == ["baseline/v1"]


def test_a_seeded_branch_made_off_an_earlier_baseline_is_merged_onto_the_current_one_before_it_is_measured(
        tmp_path: Path):
    """One hypothesis at a time: both branches are made off A0; the first is promoted (A1) before the
    second starts. The second is not compared as made (without the first's change, which would count
    the promotion it lacks against it): it is merged onto A1 and measured against A1 (a harm there)."""
    from support.lab import set_research

    root = planted_lab(tmp_path / "lab")
    set_research(root, "max_in_flight = 2", "max_in_flight = 1")
    make_branch(root, "sharpen", [("config.toml", "sharpen = false", "sharpen = true")])
    stretch = make_branch(root, "stretch", [("config.toml", "stretch = false", "stretch = true")])
    first_id, second_id = seed_branch(root, "sharpen"), seed_branch(root, "stretch")
    run_loop(root)

    rec = store_records(root)
    first, second = rec.get(first_id), rec.get(second_id)
    a1 = git(root, "rev-parse", BASELINE)
    assert first.promoted_tag == "baseline/v1" and first.commit == a1
    assert second.base_commit == a1
    assert git(root, "rev-list", "--parents", "-n", "1", second.commit).split()[1:] == [a1, stretch]
    assert second.branch.startswith(f"hyp/{second.id}-") and git(root, "rev-parse", "stretch") == stretch
    assert git(root, "rev-parse", f"exp/{second.id}^{{commit}}") == stretch
    assert second.decision == "abandon" and second.verdict in ("futile", "harm") and not second.promoted_tag
    events = [e.message for e in rec.events(50) if e.kind == "rebase"]
    assert events == [f"#{second.id}: branch stretch was made off an earlier baseline; merged onto baseline/v1 "
                      "and measured against it"], events
