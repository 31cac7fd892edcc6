"""Decisions bounded by the gate's verdict, and what promotion does to the lab's git history and queue.

The tiny lab is too noisy for a planted gain to pass the gate reliably in a test's budget, so these
tests plant *results*: the hypothesis is implemented and queued for real, then its runs are claimed
and finished through the store's own claim/finish API (standing in for the executor) with chosen
values. Everything after that is the real thing: the gate computes the verdict from the store,
the graph decides, promotion moves `autoresearch/baseline`, tags it and queues the new champion's runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.fake_openai import content
from support.lab import (
    BASELINE,
    LR_EDIT,
    TASKS,
    RoutedOpenAI,
    crash_in,
    decision,
    git,
    make_branch,
    make_loop,
    one_pass,
    proposal,
)

pytestmark = pytest.mark.system

BASE_VALUES = [0.600, 0.604, 0.598]


def plant(store, commit: str, values: list[float], shift: dict[str, float] | None = None,
          dataset: str | None = None) -> None:
    """Finish the queued runs of `commit` with `values[seed]` (+ a per-task shift), like an executor."""
    from pipeline.lab import SEED_BLOCK
    from pipeline.store import Owner, Result

    owner = Owner.current()
    for claim in store.claim(owner, 100, commits=[commit]):
        run = claim.run
        value = values[run.seed % SEED_BLOCK] + (shift or {}).get(run.task, 0.0)
        assert store.finish(claim, Result(run_id=run.id, commit=run.commit, task=run.task, seed=run.seed, value=value,
                                          dataset_id=dataset))


def measured(loop, challenger: list[float]):
    """A seeded LR hypothesis implemented, its look's runs planted, and the graph run to its decision."""
    h = one_pass(loop)
    assert h.status == "measuring", h.reject_reason
    plant(loop.store, h.base_commit, BASE_VALUES, {"churn_60d": 0.05})
    plant(loop.store, h.commit, challenger, {"churn_60d": 0.05})
    return loop.advance(h)


def seed_lr(lab: Path) -> None:
    from agent.commands import seed

    spec = lab.parent / "lr.json"
    spec.write_text(json.dumps({"title": "Fine-tune with lr 3e-3", "rationale": "planted",
                                "edits": [{"path": LR_EDIT["path"], "search": LR_EDIT["search"],
                                           "replace": LR_EDIT["replace"]}]}))
    seed(lab, None, None, None, 10, None, spec)


def decision_record(loop, hid: int) -> dict:
    (rec,) = loop.records.decisions(hid)
    return rec.to_dict()


def test_allowed_decisions_follow_the_verdict() -> None:
    from agent.graph import allowed_decisions

    looks = [2, 5, 10]
    assert allowed_decisions("improvement", 2, looks, False) == ["promote", "abandon"]
    assert allowed_decisions("improvement", 2, looks, True) == ["hold", "abandon"]
    assert allowed_decisions("escalate", 2, looks, False) == ["escalate", "abandon"]
    assert allowed_decisions("escalate", 10, looks, False) == ["abandon", "refine"]  # no look left to escalate to
    for verdict in ("single_task", "harm", "futile", "inconclusive", None):
        assert "promote" not in allowed_decisions(verdict, 2, looks, False)
        assert "escalate" not in allowed_decisions(verdict, 2, looks, False)


def test_an_improvement_is_promoted_merged_tagged_and_the_new_baseline_queued(lab: Path) -> None:
    seed_lr(lab)
    loop = make_loop(lab, offline=True)
    try:
        base_before = git(lab, "rev-parse", BASELINE)
        h = measured(loop, [0.700, 0.703])
    finally:
        loop.close()

    assert (h.status, h.verdict, h.decision, h.promoted_tag) == ("done", "improvement", "promote", "baseline/v1")
    assert decision_record(loop, h.id)["allowed"] == ["promote", "abandon"]
    # a fast-forward: the baseline is the experiment's commit, tagged; its branch and tag are kept
    assert h.base_commit == base_before
    assert git(lab, "rev-parse", BASELINE) == h.commit == git(lab, "rev-parse", "baseline/v1^{commit}")
    assert git(lab, "rev-parse", "exp/1^{commit}") == git(lab, "rev-parse", h.branch) == h.commit
    # the new champion re-verifies on fresh seeds, the next block: its challenger runs (seeds 0, 1) stay
    # in the store and every (task, own seed) is queued anew; none is a seed it was selected on
    runs = loop.store.runs(commit=h.commit)
    assert sorted((r.task, r.seed) for r in runs if r.status != "queued") == sorted((t, s) for t in TASKS for s in (0, 1))
    assert sorted((r.task, r.seed) for r in runs if r.status == "queued") == sorted(
        (t, s) for t in TASKS for s in (1000, 1001, 1002))
    # the next hypothesis branches off the new baseline
    from agent.commands import status

    assert status(lab, None)["baseline"] == {"commit": h.commit, "tag": "baseline/v1"}


def test_status_and_digest_set_the_gate_split_beside_the_holdout_champion_by_champion(lab: Path) -> None:
    seed_lr(lab)
    loop = make_loop(lab, offline=True)
    try:
        h = measured(loop, [0.700, 0.703])
        assert h.decision == "promote"
        plant(loop.store, h.commit, [0.690, 0.690, 0.690])  # the champion's fresh runs, on its own seeds
        # what the runner's holdout scorer wrote: each baseline's own runs (its own seed block)
        for commit, value, own in ((h.base_commit, 0.610, (0, 1, 2)), (h.commit, 0.630, (1000, 1001, 1002))):
            assert loop.store.is_baseline(commit)
            for r in loop.store.runs(commit=commit):
                if r.seed in own:
                    loop.store.holdout_put(r.id, r.commit, r.task, r.seed, value)
    finally:
        loop.close()
    from agent.commands import digest, status
    from agent.views import digest_markdown

    pr = status(lab, None)["progress"]
    assert [p["label"] for p in pr["points"]] == ["start", "baseline/v1"]
    base_gate = (sum(BASE_VALUES) / 3 + sum(BASE_VALUES) / 3 + 0.05) / 2
    assert pr["points"][0]["gate"] == pytest.approx(base_gate) and pr["points"][1]["gate"] == pytest.approx(0.690)
    assert pr["gate_gain"] == pytest.approx(0.690 - base_gate)
    assert pr["holdout_gain"] == pytest.approx(0.020)
    assert pr["reuse_gap"] == pytest.approx(0.690 - base_gate - 0.020)
    md = digest_markdown(digest(lab, None, "1d"))
    assert f"gate split {0.690 - base_gate:+.4f}, holdout +0.0200" in md


def test_a_comparison_across_two_datasets_is_refused_in_one_line_and_loses_nothing(lab: Path) -> None:
    from pipeline.errors import LabConfigError

    seed_lr(lab)
    loop = make_loop(lab, offline=True)
    try:
        h = one_pass(loop)
        plant(loop.store, h.base_commit, BASE_VALUES, dataset="transactions-v1-small-d0-n300")  # an older store
        plant(loop.store, h.commit, [0.700, 0.703], dataset="transactions-v2-small-d0-n300")
        with pytest.raises(LabConfigError, match="different datasets"):
            loop.advance(h)
        again = loop.records.get(h.id)
        assert (again.status, again.verdict, again.decision) == ("measuring", None, None)
        assert not loop.store.gate_records(str(h.id), kind="verdict")
    finally:
        loop.close()


def test_a_promotion_after_the_baseline_moved_is_rebased_measured_again_then_a_fast_forward(lab: Path) -> None:
    """The baseline moves under a measured hypothesis: at its promotion it is merged onto the new head
    (graph.rebase), measured again against it from its first look, and only then promoted."""
    seed_lr(lab)
    loop = make_loop(lab, offline=True)
    try:
        h = one_pass(loop)
        old, a0 = h.commit, h.base_commit
        # meanwhile a researcher moves the baseline with an unrelated change
        git(lab, "checkout", "-q", BASELINE)
        (lab / "program.md").write_text((lab / "program.md").read_text() + "\nAlso look at fraud.\n")
        git(lab, "commit", "-qam", "program: fraud")
        git(lab, "checkout", "-q", "main")
        moved = git(lab, "rev-parse", BASELINE)
        plant(loop.store, h.base_commit, BASE_VALUES)
        plant(loop.store, h.commit, [0.700, 0.703])
        h = loop.advance(h)  # improvement against the old base: re-based, not promoted
        assert (h.status, h.base_commit, h.verdict, h.promoted_tag) == ("measuring", moved, None, None)
        assert git(lab, "rev-parse", BASELINE) == moved
        assert git(lab, "rev-parse", f"{h.commit}^1") == moved and git(lab, "rev-parse", f"{h.commit}^2") == old
        plant(loop.store, moved, BASE_VALUES)
        plant(loop.store, h.commit, [0.700, 0.703])
        h = loop.advance(h)
    finally:
        loop.close()
    assert h.decision == "promote"
    head = git(lab, "rev-parse", BASELINE)
    assert head == h.commit  # a fast-forward to the commit measured against `moved`
    assert git(lab, "rev-parse", f"{head}^1") == moved and git(lab, "rev-parse", f"{head}^2") == old
    assert "Also look at fraud." in git(lab, "show", f"{head}:program.md")
    assert "lr = 3e-3" in git(lab, "show", f"{head}:config.toml")
    assert git(lab, "rev-parse", "baseline/v1^{commit}") == head
    assert h.rationale_decision.startswith(f"Re-based from {BASELINE}@{a0[:10]} onto {BASELINE}@{moved[:10]}")


def test_a_rebase_killed_before_its_record_runs_again_to_the_same_merge(lab: Path) -> None:
    """kill -9 inside the promote node after the merge, the moved records and the rebase record, before
    the hypothesis's row changed: the re-run makes no second commit, record or event."""
    seed_lr(lab)
    loop = make_loop(lab, offline=True)
    try:
        h = one_pass(loop)
        old, a0 = h.commit, h.base_commit
        git(lab, "checkout", "-q", BASELINE)
        (lab / "program.md").write_text((lab / "program.md").read_text() + "\nAlso look at fraud.\n")
        git(lab, "commit", "-qam", "program: fraud")
        git(lab, "checkout", "-q", "main")
        plant(loop.store, h.base_commit, BASE_VALUES)
        plant(loop.store, h.commit, [0.700, 0.703])
        first = loop.advance(h)
        assert first.status == "measuring"
        h = crash_in(loop, first, "promote", status="promoting", decision="promote", commit=old, base_commit=a0,
                     verdict="improvement", look=2, branch=f"hyp/{h.id}-fine-tune-with-lr-3e-3")
        again = loop.advance(h)
        assert (again.status, again.commit, again.base_commit) == ("measuring", first.commit, first.base_commit)
        assert len(loop.store.gate_records(str(h.id), kind="rebase")) == 1
        assert sum(e.kind == "rebase" for e in loop.records.events(50)) == 1
        assert git(lab, "rev-parse", f"refs/heads/{again.branch}") == first.commit
    finally:
        loop.close()


def test_no_promotion_without_improvement_whatever_the_llm_says(lab: Path, llm: RoutedOpenAI) -> None:
    seed_lr(lab)
    # the model insists on promoting a change that made things worse
    llm.on("decision", *[content(decision("promote", "Looks great."))] * 3)
    loop = make_loop(lab)
    try:
        base_before = git(lab, "rev-parse", BASELINE)
        h = measured(loop, [0.500, 0.503])
    finally:
        loop.close()

    assert not llm.asked("edits")  # a seed's own edits are applied as they are, whatever the policy
    assert h.verdict != "improvement"
    assert (h.status, h.decision, h.promoted_tag) == ("done", "abandon", None)
    asked = llm.asked("decision")
    assert len(asked) == 3  # one answer and two repair rounds, each refused by the verdict's enum
    assert all("promote" not in b["response_format"]["json_schema"]["schema"]["properties"]["decision"]["enum"]
               for b in asked)
    assert "No decision from the policy" in h.rationale_decision
    assert git(lab, "rev-parse", BASELINE) == base_before
    assert git(lab, "tag", "--list", "baseline/*") == ""


def test_a_supervised_improvement_is_held_until_a_human_approves(lab: Path) -> None:
    from agent.commands import review

    seed_lr(lab)
    loop = make_loop(lab, offline=True, supervised=True)
    try:
        base_before = git(lab, "rev-parse", BASELINE)
        h = measured(loop, [0.700, 0.703])
        assert (h.status, h.decision, h.review) == ("held", "hold", "pending")
        assert git(lab, "rev-parse", BASELINE) == base_before
        review(lab, None, h.id, approve=True, reject=False, comment="ship it")
        loop.release_holds()
    finally:
        loop.close()
    h = loop.records.get(h.id)
    assert (h.status, h.decision, h.promoted_tag) == ("done", "promote", "baseline/v1")
    assert git(lab, "rev-parse", BASELINE) == h.commit


@pytest.mark.parametrize("node", ["evaluate", "decide"])
def test_a_hold_killed_before_its_summary_is_summarized_before_it_waits(lab: Path, node: str) -> None:
    """kill -9 after decide wrote `held`, the thread's checkpoint one or two steps behind (a look's
    interrupt, or before decide): the restart summarizes the hold, then waits for the reviewer."""
    from agent.summary import summary_path

    seed_lr(lab)
    loop = make_loop(lab, offline=True, supervised=True)
    try:
        h = measured(loop, [0.700, 0.703])
        assert (h.status, h.decision) == ("held", "hold")
        summary_path(loop.lab, h.id).unlink()
        h = loop.advance(crash_in(loop, h, node, summary_md=None))
        snap = loop.graph.get_state({"configurable": {"thread_id": str(h.id)}})
    finally:
        loop.close()
    assert (h.status, h.decision, h.review, h.promoted_tag) == ("held", "hold", "pending", None)
    assert "held for a human's approval" in summary_path(loop.lab, h.id).read_text()
    assert h.summary_md and snap.next == ("hold",) and snap.interrupts
    assert loop.records.last_event(("error",)) is None  # no node failed on the way


def test_refine_queues_one_child_even_if_decide_runs_again(lab: Path, llm: RoutedOpenAI) -> None:
    llm.on("hypothesis", content(proposal()))
    llm.on("edits", content({"edits": [LR_EDIT], "notes": ""}))
    llm.on("decision", content(decision("refine", "Too large a step.", "Try lr = 1e-3 instead\nA smaller step.")))
    loop = make_loop(lab)
    try:
        h = measured(loop, [0.590, 0.592])
        assert (h.status, h.decision) == ("done", "refine")
        # a crash after the decision's side effects, before its record: decide runs again
        h = loop.advance(crash_in(loop, h, "decide", status="deciding", decision=None))
    finally:
        loop.close()
    assert len(llm.asked("decision")) == 1  # the stored choice is carried out, not asked again
    children = [c for c in loop.records.all() if c.parent_id == h.id]
    assert len(children) == 1
    child = children[0]
    assert (child.status, child.title, child.origin) == ("queued", "Try lr = 1e-3 instead", "llm")
    assert "A smaller step." in child.seed_text and child.expected_tasks == TASKS


def test_decide_follows_the_gate_when_the_llm_gives_no_answer(lab: Path, llm: RoutedOpenAI) -> None:
    seed_lr(lab)
    loop = make_loop(lab)
    try:
        h = measured(loop, [0.700, 0.703])  # nothing scripted for the decision: the endpoint refuses it
    finally:
        loop.close()
    assert llm.unscripted and set(llm.unscripted) == {"decision"}
    assert (h.verdict, h.decision, h.promoted_tag) == ("improvement", "promote", "baseline/v1")
    assert h.rationale_decision.startswith("No decision from the policy (LLMError: decide: LLM request rejected")


def test_implement_and_promote_run_again_after_a_crash_repeat_nothing(lab: Path) -> None:
    seed_lr(lab)
    loop = make_loop(lab, offline=True)
    try:
        h = one_pass(loop)
        commit, branch = h.commit, h.branch
        # killed after the commit and its tag, before the record: implement runs again
        h = loop.advance(crash_in(loop, h, "implement", status="implementing", commit=None, branch=None,
                                  base_commit=None, look=None))
        assert (h.status, h.commit, h.branch, h.look) == ("measuring", commit, branch, 2)
        assert git(lab, "tag", "--list", "exp/*").split() == ["exp/1"]
        assert git(lab, "branch", "--list", "hyp/*").split() == [branch]
        plant(loop.store, h.base_commit, BASE_VALUES)
        plant(loop.store, h.commit, [0.700, 0.703])
        h = loop.advance(h)
        assert h.promoted_tag == "baseline/v1"
        head, n_runs = git(lab, "rev-parse", BASELINE), len(loop.store.runs())
        # killed after the promotion, before its record: decide runs again
        h = loop.advance(crash_in(loop, h, "decide", status="deciding", decision=None, promoted_tag=None))
    finally:
        loop.close()
    assert (h.status, h.decision, h.promoted_tag) == ("done", "promote", "baseline/v1")
    assert git(lab, "rev-parse", BASELINE) == head
    assert git(lab, "tag", "--list", "baseline/*").split() == ["baseline/v1"]
    assert len(loop.store.runs()) == n_runs


def test_a_promote_killed_after_its_projection_is_not_done_again(lab: Path) -> None:
    """kill -9 inside promote after the row was written (the row a step ahead of the checkpoint):
    the re-run takes the row's update (`agent.graph.spec._replayed`): no second merge or tag, no second
    summary, and the thread goes on to re-verify the champion."""
    seed_lr(lab)
    loop = make_loop(lab, offline=True)
    try:
        h = one_pass(loop)
        plant(loop.store, h.base_commit, BASE_VALUES)
        plant(loop.store, h.commit, [0.700, 0.703])
        h = loop.advance(h)
        assert (h.status, h.promoted_tag) == ("done", "baseline/v1")
        head, n_runs, summary = git(lab, "rev-parse", BASELINE), len(loop.store.runs()), h.summary_md
        h = loop.advance(crash_in(loop, h, "promote"))  # the store as promote and summarize left it
        snap = loop.graph.get_state({"configurable": {"thread_id": str(h.id)}})
    finally:
        loop.close()
    assert (h.status, h.decision, h.promoted_tag, h.summary_md) == ("done", "promote", "baseline/v1", summary)
    assert git(lab, "rev-parse", BASELINE) == head
    assert git(lab, "tag", "--list", "baseline/*").split() == ["baseline/v1"]
    assert len(loop.store.runs()) == n_runs
    assert snap.values["phase"] == "done" and snap.next in ((), ("reverify",))


def test_a_promoted_champion_is_re_verified_on_fresh_seeds_and_its_shrinkage_recorded(lab: Path) -> None:
    seed_lr(lab)
    loop = make_loop(lab, offline=True)
    try:
        h = measured(loop, [0.700, 0.703])  # selected on seeds 0, 1: mean 0.7015 (+0.05 on churn)
        assert h.promoted_tag == "baseline/v1"
        loop.note_reverifications()
        assert not loop.store.gate_records(str(h.id), kind="reverify")  # fresh runs still queued
        # the fresh seeds 1000-1002 come in lower than the runs it was selected on
        plant(loop.store, h.commit, [0.690, 0.692, 0.694], {"churn_60d": 0.05})
        loop.note_reverifications()
        loop.note_reverifications()  # once only
        # the champion's own challengers get a seed block of their own: never the seeds it was selected on
        h2 = one_pass(loop)
        assert h2.base_commit == h.commit and h2.status == "measuring"
        runs = loop.store.runs(loop.pending_runs(h2))
        assert sorted({(r.commit, r.seed) for r in runs}) == sorted(
            [(h.commit, s) for s in (1000, 1001, 1002)] + [(h2.commit, s) for s in (1000, 1001)])
    finally:
        loop.close()
    (rec,) = loop.store.gate_records(str(h.id), kind="reverify")
    r = rec.payload
    assert r["tag"] == "baseline/v1" and r["fresh_seeds"] == [1000, 1001, 1002]
    assert abs(r["selected_mean"] - (0.7015 + 0.025)) < 1e-9 and abs(r["fresh_mean"] - (0.692 + 0.025)) < 1e-9
    assert abs(r["shrinkage"] - (0.692 - 0.7015)) < 1e-9 and r["tasks_worse"] == 2
    events = [e.message for e in loop.records.events() if e.kind == "reverified"]
    assert events == ["baseline/v1 re-verified on 3 fresh seeds: mean auc 0.7170 vs 0.7265 on the runs it was "
                      "selected on (-0.0095, worse: higher is better; 2/2 tasks worse)"]


def test_a_git_helper_killed_under_the_loop_is_infrastructure_not_the_ideas_failure(lab: Path) -> None:
    """gitpython keeps `git cat-file` helpers open; one killed (OOM killer, an operator, the soak's
    chaos) left the workspace's repo answering BrokenPipeError for ever, each a failure of the idea."""
    import psutil

    seed_lr(lab)
    loop = make_loop(lab, offline=True)
    try:
        loop.svc.workspace.repo.commit(BASELINE).tree["config.toml"].data_stream.read()  # helpers started
        helpers = [p for p in psutil.Process().children(recursive=True) if "cat-file" in " ".join(p.cmdline())]
        assert helpers
        for p in helpers:
            p.kill()
        psutil.wait_procs(helpers, timeout=5)
        h = one_pass(loop)
        h = h if h.status == "measuring" else loop.advance(h)  # the pass that met the dead helper waits
        assert h.status == "measuring", h.reject_reason
        assert loop.failures == {} and not [e for e in loop.records.events() if e.kind == "error"]
    finally:
        loop.close()


# ----------------------------------------------------------------------------- merged trees (issue 36)

AGENT_EDIT = ("model.py", "return self.ln_f(x)", "return self.ln_f(x)  # agent edit")


def freeze_model(lab: Path) -> str:
    """A researcher moves the baseline: model.py, editable, renamed to frozen/model.py, which is not."""
    git(lab, "checkout", "-q", BASELINE)
    (lab / "frozen").mkdir()
    git(lab, "mv", "model.py", "frozen/model.py")
    git(lab, "commit", "-qm", "freeze the model")
    git(lab, "checkout", "-q", "main")
    return git(lab, "rev-parse", BASELINE)


def move_baseline(lab: Path) -> str:
    """A researcher moves the baseline with an unrelated change."""
    git(lab, "checkout", "-q", BASELINE)
    (lab / "program.md").write_text((lab / "program.md").read_text() + "\nAlso look at fraud.\n")
    git(lab, "commit", "-qam", "program: fraud")
    git(lab, "checkout", "-q", "main")
    return git(lab, "rev-parse", BASELINE)


def seed_branch(lab: Path, branch: str):
    from agent.commands import seed

    return seed(lab, None, None, branch, 10, branch, None)


def test_a_rebase_that_lands_the_agents_edit_in_a_locked_file_through_a_rename_is_abandoned_naming_it(
        lab: Path) -> None:
    """The hypothesis edited model.py; meanwhile the baseline renamed model.py to a path outside
    `editable`. `git merge-tree` follows the rename, so the re-base's merge carries the edit into
    frozen/model.py: the merged tree is checked, and the hypothesis is abandoned, never promoted."""
    from agent.commands import seed

    path, search, replace = AGENT_EDIT
    spec = lab.parent / "model.json"
    spec.write_text(json.dumps({"title": "Mark the model", "rationale": "planted",
                                "edits": [{"path": path, "search": search, "replace": replace}]}))
    seed(lab, None, None, None, 10, None, spec)
    loop = make_loop(lab, offline=True)
    try:
        h = one_pass(loop)
        assert h.status == "measuring", h.reject_reason
        old = h.commit
        moved = freeze_model(lab)
        merged = loop.svc.workspace.merge_onto(moved, old, "probe")
        assert replace in git(lab, "show", f"{merged}:frozen/model.py")  # the hole: the merge followed the rename
        plant(loop.store, h.base_commit, BASE_VALUES)
        plant(loop.store, h.commit, [0.700, 0.703])
        h = loop.advance(h)  # an improvement against the old base: re-based, and the merge refused
    finally:
        loop.close()
    assert (h.status, h.decision, h.promoted_tag, h.commit) == ("done", "abandon", None, old)
    assert "it changes frozen/model.py: not editable" in h.rationale_decision, h.rationale_decision
    assert "\n" not in h.rationale_decision and "Traceback" not in h.rationale_decision
    assert git(lab, "rev-parse", BASELINE) == moved and git(lab, "tag", "--list", "baseline/*") == ""
    (record,) = loop.store.gate_records(str(h.id), kind="rebase")
    assert record.payload["commit"] is None and "frozen/model.py" in record.payload["outcome"]
    assert not loop.store.runs(commit=merged)  # never measured


def test_a_seeded_branch_whose_merge_lands_an_edit_in_a_locked_file_is_refused_naming_it(lab: Path) -> None:
    """A researcher's branch made off A0 edits model.py (editable: its own diff passes); the baseline
    then renamed model.py to frozen/model.py. Adopted onto A1, the merge would measure (and could
    promote) an edit of frozen/model.py: the merged tree is refused by that path's name."""
    tip = make_branch(lab, "mark-model", [AGENT_EDIT])
    moved = freeze_model(lab)
    seeded = seed_branch(lab, "mark-model")
    loop = make_loop(lab, offline=True)
    try:
        h = one_pass(loop)
    finally:
        loop.close()
    assert (h.status, h.decision, h.reject_kind, h.commit) == ("done", "reject", "outside_editable", None)
    assert h.id == seeded.id
    assert h.reject_reason.startswith("branch mark-model merged onto autoresearch/baseline@"), h.reject_reason
    assert "frozen/model.py: not editable" in h.reject_reason, h.reject_reason
    assert git(lab, "rev-parse", BASELINE) == moved and git(lab, "rev-parse", "mark-model") == tip
    assert git(lab, "branch", "--list", "hyp/*") == "" and not loop.store.runs()


def test_a_seeded_branch_resumed_after_a_crash_between_its_tag_and_its_record_measures_the_merge(
        lab: Path) -> None:
    """kill -9 in implement after a seeded branch (made off A0, the baseline now A1) was merged onto A1
    and tagged `exp/<id>`, before its record: the tag holds the branch as seeded, not what is
    measured. The resume merges it onto A1 again (the same commit), measures that, and promotes
    exactly it, a fast-forward; a row left by an older version, the unmerged commit measured against
    A1, is refused at its promotion in one line instead of promoting a merge nobody measured."""
    tip = make_branch(lab, "lr", [("config.toml", LR_EDIT["search"], LR_EDIT["replace"])])
    a1 = move_baseline(lab)
    seed_branch(lab, "lr")
    loop = make_loop(lab, offline=True)
    try:
        h = one_pass(loop)
        assert h.status == "measuring", h.reject_reason
        merged = h.commit
        assert git(lab, "rev-list", "--parents", "-n", "1", merged).split()[1:] == [a1, tip]
        assert git(lab, "rev-parse", f"exp/{h.id}^{{commit}}") == tip
        h = loop.advance(crash_in(loop, h, "implement", status="implementing", commit=None, branch=None,
                                  base_commit=None, look=None))
        assert (h.status, h.commit, h.base_commit) == ("measuring", merged, a1)
        assert {r.commit for r in loop.store.runs()} == {a1, merged}  # tip is never queued
        plant(loop.store, a1, BASE_VALUES)
        plant(loop.store, merged, [0.700, 0.703])
        h = loop.advance(h)
    finally:
        loop.close()
    assert (h.decision, h.promoted_tag) == ("promote", "baseline/v1")
    assert git(lab, "rev-parse", BASELINE) == merged == git(lab, "rev-parse", "baseline/v1^{commit}")


def test_an_unmerged_seed_commit_measured_against_the_current_head_is_refused_at_its_promotion(
        lab: Path) -> None:
    """What an older version's resume left: a seeded branch's commit (made off A0, not containing A1)
    measured against A1. The gate's improvement is of a tree that is not what a merge would promote:
    the promotion is refused in one line and the baseline stays A1."""
    tip = make_branch(lab, "lr", [("config.toml", LR_EDIT["search"], LR_EDIT["replace"])])
    a1 = move_baseline(lab)
    seed_branch(lab, "lr")
    loop = make_loop(lab, offline=True)
    try:
        h = one_pass(loop)
        assert h.status == "measuring", h.reject_reason
        h = loop.advance(crash_in(loop, h, "evaluate", commit=tip, base_commit=a1))  # as the old resume left it
        assert tip in {r.commit for r in loop.store.runs()}
        plant(loop.store, a1, BASE_VALUES)
        plant(loop.store, tip, [0.700, 0.703])
        h = loop.advance(h)
    finally:
        loop.close()
    assert (h.verdict, h.decision, h.promoted_tag) == ("improvement", "abandon", None)
    assert h.rationale_decision == (f"promotion refused: {tip[:10]} does not contain the baseline {a1[:10]} it was "
                                    "measured against: promoting it would take a merge the gate never measured")
    assert git(lab, "rev-parse", BASELINE) == a1 and git(lab, "tag", "--list", "baseline/*") == ""
