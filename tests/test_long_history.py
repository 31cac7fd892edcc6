"""Months of a busy lab: the proposal prompt lists the latest decided hypotheses and the latest
promoted ones, and counts the rest, so it stops growing with the history (a table of every one
passes a 128k context after about 4,000 hypotheses: every proposal would then be refused)."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.summary import services

from agent.graph import build_context
from agent.graph.context import HISTORY_PROMOTED, HISTORY_ROWS
from agent.policy_llm import history_table
from agent.records import Hypothesis

pytestmark = pytest.mark.integration


def decided(svc, n: int, start: int) -> None:
    """`n` decided hypotheses as the loop leaves them: one in 10 promoted, the rest abandoned."""
    with svc.store.session() as s:
        for i in range(start, start + n):
            promote = i % 10 == 0
            s.add(Hypothesis(title=f"Idea {i}", status="done", origin="offline",
                             verdict="improvement" if promote else "no_effect",
                             decision="promote" if promote else "abandon"))
        s.commit()


def test_the_proposal_history_stops_growing_and_counts_what_it_leaves_out(lab: Path) -> None:
    svc = services(lab)
    decided(svc, 40, 0)
    few = build_context(svc)
    assert len(few.history) == 40 and few.history_left_out == {}  # a short history: every row
    assert "not listed" not in history_table(few.history, few.history_left_out)

    decided(svc, 400, 40)
    ctx = build_context(svc)
    ids = [h["id"] for h in ctx.history]
    latest = sorted(h.id for h in svc.records.briefs())[-HISTORY_ROWS:]
    assert set(latest) <= set(ids) and ids == sorted(ids)
    promoted = [h["id"] for h in ctx.history if h["decision"] == "promote"]
    assert len(promoted) == HISTORY_PROMOTED and len(ids) < HISTORY_ROWS + HISTORY_PROMOTED
    assert sum(ctx.history_left_out.values()) == 440 - len(ids)
    assert ctx.history_left_out["promote"] == 44 - HISTORY_PROMOTED  # 44 promoted, the latest 30 listed
    table = history_table(ctx.history, ctx.history_left_out)
    assert f"{440 - len(ids)} earlier decided hypotheses are not listed" in table

    decided(svc, 800, 440)
    longer = history_table(*(lambda c: (c.history, c.history_left_out))(build_context(svc)))
    assert len(longer) < 1.1 * len(table)  # three times the history, the same prompt


def test_directions_are_found_once_for_finished_hypotheses_and_their_runs_counted_in_one_query(lab: Path) -> None:
    """`group_directions` runs at every proposal over every hypothesis: a finished one's direction is
    recorded the first time (git asked once), and grouping again asks git nothing for it."""
    from support.summary import SAME, decided as decide, implemented, measured

    from agent.directions import _CACHE, group_directions

    svc = services(lab)
    done = [decide(svc, measured(svc, implemented(svc), SAME)) for _ in range(2)]
    svc.store.ensure_arm(done[0].commit)
    svc.store.enqueue(done[0].commit, [("default_90d", 0), ("churn_60d", 0)])
    from pipeline.lease import Owner
    from pipeline.store import Result

    for claim in svc.store.claim(Owner.current(), 2):
        svc.store.finish(claim, Result(run_id=claim.run.id, commit=done[0].commit, task=claim.run.task,
                                       seed=claim.run.seed, value=0.6))
    first = group_directions(svc.workspace, svc.store, svc.records)
    recorded = {h.id: h.direction for h in svc.records.briefs()}
    assert all(recorded[h.id] for h in done)
    _CACHE.clear()
    again = group_directions(None, svc.store, svc.records)  # no workspace: nothing asked of git
    assert [(g.label, g.hypotheses, g.runs) for g in again] == [(g.label, g.hypotheses, g.runs) for g in first]
    assert sum(g.runs for g in again) == 2


def test_status_pairing_reads_the_latest_comparisons(lab: Path) -> None:
    """`status` reports how well seed k pairs from the lab's latest LAB_PAIRING_LATEST comparisons,
    not a year of them at every call: older comparisons that paired the other way are not read."""
    from sqlalchemy import insert

    from pipeline.api import lab_pairing
    from pipeline.store.tables import Arm, Comparison, Result, Run
    from pipeline.variance import LAB_PAIRING_LATEST

    svc = services(lab)
    tasks = svc.lab.tasks()
    old, new = LAB_PAIRING_LATEST + 100, LAB_PAIRING_LATEST
    base = [1.0, 2.0, 3.0]
    arms = {"b0": base} | {f"old{i}": [3.0, 2.0, 1.0] for i in range(old)} \
        | {f"new{i}": [1.1, 2.3, 3.2] for i in range(new)}  # the old ones anti-correlated, the latest paired
    runs = [{"commit": c, "task": t, "seed": k, "status": "done"} for c in arms for t in tasks for k in range(3)]
    with svc.store.engine.begin() as conn:
        conn.execute(insert(Arm), [{"commit": c} for c in arms])
        ids = conn.execute(insert(Run).returning(Run.id, Run.commit, Run.task, Run.seed), runs).all()
        conn.execute(insert(Result), [{"run_id": i, "commit": c, "task": t, "seed": k, "value": arms[c][k],
                                       "outcome": "ok"} for i, c, t, k in ids])
        conn.execute(insert(Comparison), [{"challenger": c, "baseline": "b0", "created_at": n}
                                          for n, c in enumerate(c for c in arms if c != "b0")])
    pr = lab_pairing(svc.lab, svc.store)
    assert pr is not None and pr["comparisons"] == LAB_PAIRING_LATEST
    assert pr["median_pair_correlation"] > 0.9  # every one of the 600 older would say -1


def test_generations_of_many_commits_in_one_walk_agree_with_one_at_a_time(tmp_path: Path) -> None:
    """`status` asks the generation of every champion: found in one walk of the history (a bit set of
    baseline tags per commit), the answer is `git tag --merged`'s, with lightweight and annotated
    tags, a merge, a side branch, other tags, and a commit tagged twice."""
    import subprocess

    from pipeline import labrepo

    root = tmp_path / "repo"
    root.mkdir()

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout.strip()

    def commit(msg: str) -> str:
        git("commit", "-q", "--allow-empty", "-m", msg)
        return git("rev-parse", "HEAD")

    git("init", "-q", "-b", "main")
    git("config", "user.email", "t@t"), git("config", "user.name", "t")
    shas = [commit("start")]
    git("tag", "baseline/v1")
    shas.append(commit("a"))
    git("tag", "-a", "baseline/v2", "-m", "annotated")
    git("tag", "other/v9")  # not a baseline tag
    git("checkout", "-q", "-b", "side")
    side = commit("side")
    git("tag", "baseline/v3")
    git("checkout", "-q", "main")
    shas.append(commit("b"))
    git("tag", "baseline/v4"), git("tag", "baseline/v5")  # one commit, two tags
    git("merge", "-q", "--no-ff", "-m", "merge", "side")
    shas += [git("rev-parse", "HEAD"), side, commit("c")]
    labrepo._generations.clear()
    one_at_a_time = {c: labrepo.generation(str(root), c) for c in shas}
    assert one_at_a_time[shas[0]] == 1 and one_at_a_time[side] == 3 and one_at_a_time[shas[-1]] == 5
    labrepo._generations.clear()
    labrepo.generations(str(root), shas)
    state = labrepo._tags_state(str(root))
    assert {c: labrepo._generations[(str(root), c, state)] for c in shas} == one_at_a_time
    repo = labrepo.LabRepo(root)  # the newest baseline tag at a commit, by git's own filter
    assert [repo.baseline_tag(c) for c in shas] == ["baseline/v1", "baseline/v2", "baseline/v5", None,
                                                   "baseline/v3", None]
    last = commit("d")  # a tag of a tag (a person's doing): counted through both, as git does
    git("tag", "-a", "inner", "-m", "inner"), git("tag", "baseline/v6", "inner")
    labrepo._generations.clear()
    assert labrepo.generation(str(root), last) == 6
    labrepo._generations.clear()
    labrepo.generations(str(root), [last])
    assert labrepo._generations[(str(root), last, labrepo._tags_state(str(root)))] == 6


def test_the_champions_standings_in_one_read_equal_each_ones_and_a_deleted_tag_is_left_out(lab_template,
                                                                                        tmp_path: Path) -> None:
    """`status` and the chart ask the standing of every champion: read for all at once, each is what
    `standing` says of it alone; a tag deleted by hand is an error for that revision only, and the
    progress leaves that champion out instead of failing."""
    import subprocess

    from agent.progress import champions, split_progress
    from pipeline.experiment import Experiment
    from support.views import build_views_lab

    root = build_views_lab(lab_template, tmp_path / "lab")["lab"]
    svc = services(root)
    exp = Experiment(svc.lab, svc.store)
    revs = [rev for _, rev, _ in champions(svc.records)]
    assert "baseline/v1" in revs and len(revs) >= 2
    together = exp.standings(revs)
    assert together == {rev: exp.standing(rev) for rev in revs}
    assert together["baseline/v1"] is not None and together["baseline/v1"]["holdout"] is not None
    # `status` reads the first baseline and the latest champions only: the same gains, fewer reads
    every = split_progress(svc.lab, svc.store, svc.records)
    latest = split_progress(svc.lab, svc.store, svc.records, latest=1)
    assert len(every["points"]) >= 2 and every["champions"] == len(revs) - 1
    assert latest["points"] == [every["points"][0], every["points"][-1]] and latest["champions"] == every["champions"]
    assert (latest["gate_gain"], latest["holdout_gain"]) == (every["gate_gain"], every["holdout_gain"])
    subprocess.run(["git", "tag", "-d", "baseline/v1"], cwd=root, check=True, capture_output=True)
    assert isinstance(exp.standings(revs)["baseline/v1"], Exception)
    split = split_progress(svc.lab, svc.store, svc.records)
    assert "baseline/v1" not in [p["label"] for p in split["points"]]


def test_status_lists_the_latest_hypotheses_and_counts_every_one(lab: Path) -> None:
    """A year of hypotheses is 20,000: `status` lists the latest STATUS_HYPOTHESES (its JSON was
    6 MB) and counts every one by status, the rejected ones by kind, from the indexes."""
    from collections import Counter

    from agent.commands import STATUS_HYPOTHESES, status_of

    svc = services(lab)
    decided(svc, STATUS_HYPOTHESES + 150, 0)
    with svc.store.session() as s:
        for i, kind in enumerate(["smoke_failed", "duplicate", "smoke_failed", None]):
            s.add(Hypothesis(title=f"Rejected {i}", status="done", decision="reject", reject_kind=kind))
        s.add(Hypothesis(title="Measuring", status="measuring"))
        s.add(Hypothesis(title="Queued", status="queued"))
        s.commit()
    every = svc.records.briefs()
    st = status_of(svc.lab, svc.store, svc.records)
    assert [h["id"] for h in st["hypotheses"]] == [h.id for h in every][-STATUS_HYPOTHESES:]
    assert st["hypotheses_total"] == len(every) == STATUS_HYPOTHESES + 156
    assert st["by_status"] == dict(Counter(str(h.status) for h in every))
    assert st["rejected"] == {"?": 1, "duplicate": 1, "smoke_failed": 2}
    from agent.records import ACTIVE

    assert st["in_flight"] == [h.id for h in every if h.status in ACTIVE] and len(st["in_flight"]) == 1
    assert svc.records.latest_briefs(3) == every[-3:]
    assert svc.records.briefs_of([every[5].id, every[2].id, 10**9]) == [every[2], every[5]]


def test_a_first_look_reads_the_latest_comparisons_of_the_lab(lab: Path, monkeypatch) -> None:
    """The paired gate's prior and σ_task come from the lab's earlier comparisons: the latest
    HISTORY_COMPARISONS of them (a year's would be 16,000, read at every hypothesis's first look)."""
    from sqlalchemy import insert

    from pipeline import experiment
    from pipeline.store.tables import Arm, Comparison, Result, Run

    svc = services(lab)
    tasks = svc.lab.tasks()
    monkeypatch.setattr(experiment, "HISTORY_COMPARISONS", 3)
    arms = {"b0": 0.0} | {f"c{i}": float(i) for i in range(6)}  # challenger i is the baseline + i
    runs = [{"commit": c, "task": t, "seed": k, "status": "done"} for c in arms for t in tasks for k in range(3)]
    with svc.store.engine.begin() as conn:
        conn.execute(insert(Arm), [{"commit": c} for c in arms])
        ids = conn.execute(insert(Run).returning(Run.id, Run.commit, Run.task, Run.seed), runs).all()
        conn.execute(insert(Result), [{"run_id": i, "commit": c, "task": t, "seed": k, "value": 0.5 + k + arms[c],
                                       "outcome": "ok"} for i, c, t, k in ids])
        conn.execute(insert(Comparison), [{"challenger": f"c{i}", "baseline": "b0", "created_at": float(i)}
                                          for i in range(6)])
    pairs, arm_rows = experiment.Experiment(svc.lab, svc.store).histories(tasks)
    assert [d[tasks[0]] for d in pairs] == [[3.0] * 3, [4.0] * 3, [5.0] * 3]  # c3, c4, c5: the latest three
    assert len(arm_rows) == 4  # b0 and those three


def test_finished_hypotheses_newest_first_by_pages_never_repeat_one(lab: Path) -> None:
    """The loop's streak counts read finished hypotheses newest first a page at a time: by key, so
    one finishing between two pages shifts nothing (with OFFSET it was read twice), ties included."""
    svc = services(lab)
    with svc.store.session() as s:
        for i, t in enumerate([10.0, 20.0, 20.0, 30.0, 40.0]):
            s.add(Hypothesis(title=f"h{i}", status="done", origin="offline", finished_at=t, decision="abandon"))
        s.commit()
    pages = svc.records.done_newest_first(page=2)
    seen = [next(pages).id, next(pages).id]
    with svc.store.session() as s:  # a hypothesis finishes while the loop reads
        s.add(Hypothesis(title="new", status="done", origin="offline", finished_at=50.0, decision="abandon"))
        s.commit()
    seen += [h.id for h in pages]
    times = {h.id: h.finished_at for h in svc.records.done_newest_first()}
    assert len(seen) == len(set(seen)) == 5 and [times[i] for i in seen] == [40.0, 30.0, 20.0, 20.0, 10.0]
    assert [h.finished_at for h in svc.records.done_newest_first(page=1)] == [50.0, 40.0, 30.0, 20.0, 20.0, 10.0]


def test_the_review_pages_list_is_paged_newest_first_with_its_filters_in_the_query(lab: Path) -> None:
    """/hypotheses at a year was one page of 20,000 rows: it shows HYPOTHESES_PAGE at a time, newest
    first, filtered by the database, and its links to older and newer pages keep the filters."""
    import re

    from starlette.testclient import TestClient

    from agent.web import HYPOTHESES_PAGE, make_app

    svc = services(lab)
    decided(svc, 2 * HYPOTHESES_PAGE + 50, 0)  # one in ten promoted
    token = "t" * 32
    client = TestClient(make_app(lab, None, token), base_url="http://127.0.0.1")
    client.get(f"/files/none.png?token={token}")  # the token's cookie

    def ids(html: str) -> list[int]:
        return [int(x) for x in re.findall(r'href="/hypotheses/(\d+)"', html)]

    every = [h.id for h in svc.records.briefs()][::-1]
    first = client.get("/hypotheses")
    assert first.status_code == 200 and ids(first.text) == every[:HYPOTHESES_PAGE]
    assert f"1–{HYPOTHESES_PAGE} of {len(every)}, newest first" in first.text and 'id="newer"' not in first.text
    last = client.get("/hypotheses?page=3")
    assert ids(last.text) == every[2 * HYPOTHESES_PAGE:] and 'id="older"' not in last.text
    assert 'href="/hypotheses?page=2"' in last.text
    promoted = client.get("/hypotheses?decision=promote&page=1")
    want = [h.id for h in svc.records.briefs() if h.decision == "promote"][::-1]
    assert ids(promoted.text) == want and f"of {len(want)}," in promoted.text
    assert len(ids(client.get("/hypotheses?decision=promote&page=2").text)) == 0
    page2 = client.get("/hypotheses?status=done&page=2")
    assert 'href="/hypotheses?status=done&amp;page=1"' in page2.text and 'href="/hypotheses?status=done&amp;page=3"' in page2.text
    for bad in ("0", "x", "-1", "9" * 12, "²"):
        assert client.get(f"/hypotheses?page={bad}").status_code == 400
    unknown = client.get("/hypotheses?status=bogus&decision=%3Cscript%3Ex1")  # no such value: none, escaped
    assert unknown.status_code == 200 and ids(unknown.text) == [] and "<script>x1" not in unknown.text
    picked = client.get("/compare")
    assert picked.status_code == 200 and ids(picked.text)[:3] == every[:3]
