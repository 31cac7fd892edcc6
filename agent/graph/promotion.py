"""Where a measured hypothesis meets the baseline: promote (a fast-forward and a tag), re-base (its
base moved), re-verify (the champion on fresh seeds), a refinement queued, a look's runs queued."""

from __future__ import annotations

from typing import Any

from agent.graph.state import Services, State
from agent.lifecycle import Decision, Review, Status
from agent.records import ACTIVE, Hypothesis
from agent.verdicts import rebases, replicate_record
from agent.workspace import EditRejected, PromotionConflict, slugify

def queue_refinement(svc: Services, h: Hypothesis, follow_up: str) -> Hypothesis:
    """The child hypothesis a `refine` decision asks for, once (a re-run finds it queued)."""
    child = next(iter(svc.records.children(h.id)), None)
    if child is not None:
        return child
    first = follow_up.strip().splitlines()[0].lstrip("# ").strip()
    return svc.records.add(Hypothesis(
        title=first[:120], seed_text=follow_up.strip(), parent_id=h.id, origin=svc.policy.name, priority=h.priority,
        rationale=f"Refines #{h.id} ({h.title}), verdict {h.verdict}: {follow_up.strip()}",
        expected_effect=h.expected_effect, expected_tasks=list(h.expected_tasks or [])))


def promote(svc: Services, h: Hypothesis) -> dict[str, Any]:
    """Fast-forward the baseline to the measured commit, tag `baseline/vN`, and queue the new
    champion's own runs. Refused (an abandon, with the reason) when the commit is not exactly what
    the gate measured against the current head, or when its tree changes a path the agent may not
    change (`Workspace.check_tree`, against the head it would replace)."""
    ws = svc.workspace
    head = ws.baseline_head()
    try:
        if h.commit != head and ws.repo.is_ancestor(head, h.commit):  # the tree a fast-forward takes
            ws.check_tree(head, h.commit)  # (any other: promoted already, or refused by `promote` below)
        new, tag = ws.promote(h.commit, f"promote hyp {h.id}: {h.title}", base=h.base_commit or "")
    except (PromotionConflict, EditRejected) as e:
        return {"decision": Decision.ABANDON, "rationale_decision": f"promotion refused: {e}"}
    svc.experiment.queue_champion(new, tag, replicated=replicated(svc, h))
    return {"promoted_tag": tag}


def replicated(svc: Services, h: Hypothesis) -> int:
    """On how many fresh seeds per task the hypothesis's promotion was replicated (0: it was not):
    its champion re-verifies on the seeds after those, whatever `replicate_runs` says since."""
    r = replicate_record(svc.store, h.id)
    return len(r["seeds"]) if r else 0


def base_moved(svc: Services, h: Hypothesis) -> bool:
    """Whether the baseline moved since the hypothesis was measured against `base_commit` (not a
    re-run of a promotion that already landed: then its commit is in the baseline's history)."""
    ws = svc.workspace
    head = ws.baseline_head()
    return bool(h.base_commit and h.commit) and h.base_commit != head and not ws.repo.is_ancestor(h.commit, head)


def withdraw_replication(svc: Services, h: Hypothesis) -> int:
    """The replication runs not started yet of a promotion given up (rejected or abandoned at its
    hold, re-based, ended unpromoted, given up by the loop): queued above every look, they would
    otherwise run before the looks of the hypotheses still in flight (removed; moved to the back of the
    queue when running now or given back by a crash with a history). The challenger's arm, unless
    its commit is in the baseline's history (a champion: those seeds are its own runs) or another
    hypothesis in flight or held has it; the old baseline's arm too once the baseline moved on from it
    (every challenger of it is re-based, none replicated against it). Idempotent."""
    base, commit = h.base_commit, h.commit
    if not (base and commit):
        return 0
    ws = svc.workspace
    head = ws.baseline_head()
    arms = [] if base == head else [base]
    if not ws.repo.is_ancestor(commit, head) and not any(
            o.id != h.id and o.commit == commit for o in svc.records.all((*ACTIVE, Status.HELD))):
        arms.append(commit)
    removed, back = svc.experiment.withdraw_replication(base, arms) if arms else (0, 0)
    if removed or back:
        svc.records.event("replication", f"#{h.id}: {removed} queued replication runs withdrawn"
                          + (f", {back} running or given back by a crash moved to the back of the queue" if back else "")
                          + " (its promotion was given up)")
    return removed


def rebase(svc: Services, h: Hypothesis) -> tuple[State, dict[str, Any]]:
    """A hypothesis about to be promoted whose base moved: its commit merged onto the current
    baseline head (no working tree, as promotion does), measured again from its first look.

    A conflict, a merge that leaves the baseline as it is, or one that changes a path the agent may
    not change (`Workspace.check_tree`: the merge follows renames) is an `abandon` with the reason
    and nothing written but unreferenced objects. Otherwise the merge (deterministic for the same head
    and commit) becomes the hypothesis's commit and its branch moves there (a seeded branch is left
    alone: `hyp/<id>-<slug>` is made); the old commit stays in the merge's history and under its
    tag `exp/<id>`. The earlier comparison's gate records are moved aside, to the key
    `<id>@<old base>`, so no verdict or decision against the old base can promote it: the policy's
    evidence and the gate's looks start over against the new base, on its generation's seed block.
    A record `rebase` (and a loop event) says from where to where, and what the old base's verdict
    was. Each step is idempotent; the hypothesis's row changes last: the state's update and the
    row's fields are returned, for the promote node to project."""
    ws, rec, store = svc.workspace, svc.records, svc.store
    head = ws.baseline_head()
    old_base, old_commit = h.base_commit or "", h.commit or ""
    withdraw_replication(svc, h)  # against the old base: nobody waits for them now
    frm, onto = ws.baseline_name(old_base), ws.baseline_name(head)
    earlier = f"its verdict {h.verdict} at look {h.look} against {frm}"
    payload: dict[str, Any] = {"from_base": old_base, "from_commit": old_commit, "from_tag": frm, "to_base": head,
                               "to_tag": onto, "verdict": h.verdict, "look": h.look,
                               "archived_as": f"{h.id}@{old_base[:12]}"}
    new, why = None, ""
    try:
        new = ws.merge_onto(head, old_commit, f"hyp {h.id} re-based onto {onto}: {h.title}")
        if ws.tree(new) == ws.tree(head):
            why = f"merged onto {onto} it changes nothing: its change is in the baseline already"
        else:
            ws.check_tree(head, new)
    except PromotionConflict as e:
        why = str(e)
    except EditRejected as e:  # e.g. an editable file the baseline moved to a locked path: the merge follows
        why = f"merged onto {onto} it changes {e}"
    done = rebases(store, h.id)
    if not any(r.get("to_base") == head and r.get("from_commit") == old_commit for r in done):
        store.put_gate_record(str(h.id), len(done) + 1, {**payload, "commit": None if why else new,
                                                         "outcome": why or "re-measured"}, kind="rebase")
        said = (f"#{h.id} re-based from {frm} onto {onto}: " +
                (f"abandoned, {why}" if why else f"{earlier} does not count; measured again against {onto}"))
        rec.event("rebase", said)
    if why:
        return {"phase": Status.SUMMARIZING}, {
            "decision": Decision.ABANDON,
            "rationale_decision": f"Re-based from {frm} onto {onto} before its promotion ({earlier}): {why}. "
                                  f"Abandoned: never measured against {onto}."}
    assert new is not None
    branch = h.branch if h.branch and h.branch != h.seed_branch else f"hyp/{h.id}-{slugify(h.title)}"
    if branch == h.seed_branch:
        branch = f"hyp/{h.id}-rebased"
    ws.point_branch(branch, new)
    store.move_gate_records(str(h.id), payload["archived_as"], ("verdict", "replicate"))
    rec.archive_decisions(h.id, payload["archived_as"])
    if old_commit != new:
        svc.experiment.release(old_commit)
    return {"phase": Status.MEASURING, "look": svc.lab.config.gate.looks[0], "verdict": None}, {
        "commit": new, "base_commit": head, "branch": branch, "decision": None, "follow_up": None, "review": Review.NONE,
        "rationale_decision": f"Re-based from {frm} onto {onto} before its promotion: {earlier} does not "
                              f"count; measured again against {onto}."}


def rebased_note(svc: Services, h: Hypothesis) -> str:
    """'Re-based from A0 onto A1 (...)' before a re-based hypothesis's decision rationale; '' if it never was."""
    recs = [r for r in rebases(svc.store, h.id) if r.get("commit")]
    if not recs:
        return ""
    last = recs[-1]
    return (f"Re-based from {last['from_tag']} onto {last['to_tag']} before its promotion (its verdict "
            f"{last['verdict']} at look {last['look']} against {last['from_tag']} does not count); "
            f"against {last['to_tag']}: ")


def reverification(svc: Services, h: Hypothesis) -> dict[str, Any] | None:
    """How the champion of a promotion held up on its fresh baseline seeds (None until they are in)."""
    return svc.experiment.reverification(h.promoted_tag, h.commit, h.base_commit, h.look or 0,
                                         replicated=replicated(svc, h))


def queue_rank(h: Hypothesis) -> int:
    """Where a hypothesis's runs go in the queue among looks equally deep (0-99, higher first): a
    human seed before the policy's proposals, then by the seed's priority."""
    return min(99, (50 if h.origin == "human" else 0) + min(max(h.priority, 0), 49))


def queue_look(svc: Services, h: Hypothesis, look: int) -> list[int]:
    """Queue (idempotently) the runs of the hypothesis's look: the baseline's and its own."""
    return svc.experiment.queue_look(h.base_commit, h.commit, look, label=h.branch, rank=queue_rank(h))


def queue_replication(svc: Services, h: Hypothesis) -> list[int]:
    """Queue (idempotently) the runs of the replication a promotion of the hypothesis waits for
    (`[gate] replicate_runs`): both arms on fresh seeds; empty when the lab asks for none."""
    return svc.experiment.queue_replication(h.base_commit, h.commit, label=h.branch, rank=queue_rank(h))
