"""The loop with no LLM: `autoresearch seed` and `autoresearch run --offline` as real processes on the tiny lab."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.lab import BASELINE, TASKS, cli, cli_json, git, make_branch, make_loop, records
from pipeline.harness.transactions.variants import NOOPS

pytestmark = pytest.mark.system


def seed(lab: Path, *args: str) -> int:
    out = cli(lab, "seed", *args)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip())


def test_seeds_by_priority_branches_as_is_noops_never_promoted_then_offline_proposals(lab: Path) -> None:
    base = git(lab, "rev-parse", BASELINE)
    words = seed(lab, "Try a wider transformer", "--priority", "1")
    make_branch(lab, "res/fewer-runs", [("research.toml", "baseline_runs = 3", "baseline_runs = 2"),
                                        ("config.toml", "lr = 3e-4", "lr = 1e-3")])
    harness = seed(lab, "--branch", "res/fewer-runs", "--priority", "30")
    noops = []
    for prio, (name, variant) in zip(("20", "15"), NOOPS.items()):
        make_branch(lab, f"res/{name}", [(e.path, e.search, e.replace) for e in variant])
        noops.append(seed(lab, "--branch", f"res/{name}", "--priority", prio, "--title", f"no-op: {name}"))
    bad = cli(lab, "seed", "--branch", "res/does-not-exist")
    assert bad.returncode == 2 and bad.stderr.startswith("error: unknown branch")

    run = cli(lab, "run", "--offline", "--json", "--max-hypotheses", "5", "--workers", "2", timeout=400)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout)
    assert out["started"] == 5 and len(out["hypotheses"]) == 5  # the budget: five hypotheses, no more
    assert "measuring, look of 2 challenger runs on 2 tasks" in run.stderr  # progress on stderr

    hs = {h.id: h for h in records(lab).all()}
    offline = max(hs)
    # human seeds first, by priority, then the offline policy's proposal
    order = sorted(hs, key=lambda i: hs[i].finished_at or 0)
    assert order == [harness, *noops, words, offline]
    # a branch touching research.toml is refused before any run
    h = hs[harness]
    assert (h.decision, h.reject_kind, h.commit) == ("reject", "harness", None)
    assert "research.toml" in h.reject_reason
    # a hypothesis in words needs an LLM to implement it: said, not guessed
    assert (hs[words].decision, hs[words].reject_kind) == ("reject", "needs_llm")
    # the researcher's branches are measured as they are, and known no-ops are never promoted
    for i, (name, _variant) in zip(noops, NOOPS.items()):
        h = hs[i]
        assert h.commit == git(lab, "rev-parse", f"res/{name}") and h.base_commit == base
        assert h.verdict and h.decision in ("abandon", "refine") and h.promoted_tag is None
        assert git(lab, "rev-parse", f"exp/{i}^{{commit}}") == h.commit
    # the offline policy proposes a [search_space] change, implemented as a config.toml commit
    h = hs[offline]
    assert (h.origin, h.status) == ("offline", "done") and h.verdict
    assert git(lab, "diff", "--name-only", h.base_commit, h.commit) == "config.toml"
    assert h.title.startswith("Set ") and h.change
    promoted = git(lab, "tag", "--list", "baseline/v*").split()
    assert all(git(lab, "rev-parse", f"{t}^{{commit}}") not in {hs[i].commit for i in noops} for t in promoted)

    st = cli_json(lab, "status", "--json")
    assert set(st) >= {"lab", "baseline", "queue", "running", "hypotheses", "in_flight", "compute", "llm", "events",
                       "rejected"}
    assert set(st["queue"]) == {"queued", "running", "done", "failed"} and st["queue"]["running"] == 0
    assert st["in_flight"] == [] and st["running"] == []
    assert [h["id"] for h in st["hypotheses"]] == sorted(hs)
    assert set(st["hypotheses"][0]) == {"id", "title", "origin", "status", "look", "verdict", "decision",
                                        "promoted_tag", "review", "reject_kind"}
    assert st["rejected"] == {"harness": 1, "needs_llm": 1}
    assert st["compute"]["useful_cpu_s"] > 0 and 0 < st["compute"]["goodput"] <= 1
    # the two no-ops and the proposal were smoke-run first (the others were refused before): booked apart
    assert (st["compute"]["smoke_runs"], st["compute"]["smoke_rejected"]) == (3, 0)
    assert 0 < st["compute"]["smoke_cpu_s"] < st["compute"]["useful_cpu_s"]
    # every run scored (the lab's baseline runs on the holdout too), the dataset prepared: booked apart
    assert st["compute"]["harness_calls"] > st["queue"]["done"] and st["compute"]["harness_cpu_s"] > 0
    text = cli(lab, "status").stdout
    assert "smoke runs: 3 (0 rejected), " in text and "scoring and preparing data: " in text
    runs_line = next(line for line in (lab / "runs" / "summaries" / f"{offline}.md").read_text().splitlines()
                     if line.startswith("- **Runs:** "))  # what the hypothesis cost, its screening too
    assert " challenger runs (" in runs_line and runs_line.endswith(" CPU s") and "; before them, 1 smoke run on tiny data, " in runs_line
    assert st["llm"]["spent_today_usd"] == 0

    rep = cli_json(lab, "report", str(noops[0]), "--json")
    assert rep["hypothesis"]["verdict"] == hs[noops[0]].verdict
    gate = rep["gate"]
    assert [t["task"] for t in gate["tasks"]] == TASKS and gate["verdict"] == hs[noops[0]].verdict
    assert all(t["baseline_runs"] == 3 and t["challenger_runs"] == gate["look"] for t in gate["tasks"])
    assert cli_json(lab, "report", str(harness), "--json")["gate"] is None


def test_after_k_rejections_in_a_row_the_loop_backs_off_and_says_so(lab: Path) -> None:
    """The guard holds the policy's proposals back, never a human seed (issue 20): three failing
    seeds no longer stall the loop."""
    from agent.commands import seed as seed_fn
    from agent.loop import GUARD_STREAK

    def seed(name: str, edit: dict, priority: int) -> None:
        spec = lab.parent / f"{name}.json"
        spec.write_text(json.dumps({"title": name, "edits": [edit]}))
        seed_fn(lab, None, None, None, priority, None, spec)

    bad_paths = ["research.toml", "program.md", "../outside.py"]
    assert len(bad_paths) == GUARD_STREAK
    for i, path in enumerate(bad_paths):
        seed(f"bad {i}", {"path": path, "content": "x = 1\n"}, 10)
    # a fourth seed, queued behind them, is taken while the guard holds (rejected cheaply: it changes nothing)
    seed("late seed", {"path": "config.toml", "search": "lr = 3e-4", "replace": "lr = 3e-4"}, 1)

    loop = make_loop(lab, offline=True, max_hypotheses=10)
    try:
        out = loop.run()
    finally:
        loop.close()
    assert out["started"] == GUARD_STREAK + 1
    hs = records(lab).all()
    assert [h.reject_kind for h in hs] == ["harness", "harness", "escapes_lab", "empty"]
    assert hs[3].title == "late seed" and hs[3].status == "done"  # taken although the guard held
    assert not [h for h in hs if h.origin == "offline"]  # the policy's proposals were held back
    assert any(s.startswith("guard: 3 hypotheses in a row") and "human seeds still start" in s for s in loop.said)
    assert any("a guard holds new hypotheses back" in s for s in loop.said)
    st = cli(lab, "status")
    assert st.returncode == 0
    assert "guard: 3 hypotheses in a row were rejected or failed their runs" in " ".join(st.stdout.split())
    # a restart within the back-off starts a newly queued seed, and still no proposal
    seed("seed after restart", {"path": "config.toml", "search": "lr = 3e-4", "replace": "lr = 3e-4"}, 1)
    loop = make_loop(lab, offline=True, max_hypotheses=10)
    try:
        assert loop.run()["started"] == 1
        assert loop.guard_holds()
    finally:
        loop.close()
    hs = records(lab).all()
    assert (hs[-1].title, hs[-1].status) == ("seed after restart", "done") and len(hs) == 5


def test_the_guard_holds_the_policys_own_queued_follow_ups_and_still_starts_human_seeds(lab: Path) -> None:
    """A `refine` decision queues the policy's follow-up (status queued, origin the policy's): while
    the guard holds, it waits with the proposals; a human seed queued behind it (lower priority) starts."""
    from agent.commands import seed as seed_fn
    from agent.graph import queue_refinement
    from agent.loop import GUARD_STREAK

    def seed(name: str, edit: dict, priority: int) -> None:
        spec = lab.parent / f"{name}.json"
        spec.write_text(json.dumps({"title": name, "edits": [edit]}))
        seed_fn(lab, None, None, None, priority, None, spec)

    for i, path in enumerate(["research.toml", "program.md", "../outside.py"][:GUARD_STREAK]):
        seed(f"bad {i}", {"path": path, "content": "x = 1\n"}, 10)
    loop = make_loop(lab, offline=True, max_hypotheses=10)
    try:
        assert loop.run()["started"] == GUARD_STREAK
        assert loop.guard_holds()
        last = records(lab).all()[-1]
        child = queue_refinement(loop.svc, last, "# Refine the last one\nthe same edit, smaller")
    finally:
        loop.close()
    assert (child.status, child.origin, child.priority) == ("queued", "offline", 10)
    seed("human seed", {"path": "config.toml", "search": "lr = 3e-4", "replace": "lr = 3e-4"}, 0)

    loop = make_loop(lab, offline=True, max_hypotheses=10)
    try:
        assert loop.run()["started"] == 1
        assert loop.guard_holds()
    finally:
        loop.close()
    hs = {h.title: h for h in records(lab).all()}
    assert hs["human seed"].status == "done"  # taken although the guard held
    assert hs["Refine the last one"].status == "queued"  # held back with the policy's proposals
    assert not [h for h in hs.values() if h.origin == "offline" and h.status != "queued"]
