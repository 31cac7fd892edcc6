"""Hermetic stages: a stage sees only the editable files its `inputs` declare, so a cache key can
never miss a file the stage reads; and a human's branch is smoke-run before any run is queued.

The case that motivated it: a lab whose stage `inputs` forgot `train.py`. A comment-only branch
then got the previous hypothesis's cached outputs, and so its verdict, to the digit. Now the stage
cannot see `train.py` at all: every run fails with a reason that names the file, `check` warns
about it, and no branch is measured on another's code.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from agent.labinit import init_lab
from support.lab import cli, git
from pipeline import runner
from pipeline.executors.local import LocalExecutor
from pipeline.lab import load_lab
from pipeline import experiment, labrepo

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BASE = "autoresearch/baseline"


def _lab(root: Path, inputs: str) -> Path:
    init_lab(root, harness="command")
    toml = root / "research.toml"
    toml.write_text(toml.read_text().replace('inputs = ["train.py", "config.toml"]', f"inputs = {inputs}"))
    git(root, "commit", "-q", "--allow-empty", "-am", "inputs")
    git(root, "branch", "-f", BASE, "HEAD")
    return root


def _comment_branch(root: Path, name: str) -> str:
    git(root, "checkout", "-q", "-b", name, BASE)
    (root / "train.py").write_text((root / "train.py").read_text() + "\n# a comment-only change\n")
    git(root, "commit", "-qam", name)
    git(root, "checkout", "-q", "main")
    return git(root, "rev-parse", name)


def _measure(root: Path, rev: str) -> list:
    lab = load_lab(root)
    store = experiment.open_store(lab)
    tasks = lab.tasks()
    ids = experiment.ensure_runs(store, lab, rev, tasks, [0, 1])
    with runner.Driver(lab, store, LocalExecutor(preload=("numpy",), slots=2)) as d:
        d.drive(until=ids, timeout_s=300)
    return store.results_for(labrepo.resolve_commit(lab, rev))


def test_an_undeclared_editable_file_fails_loudly_instead_of_hitting_a_stale_cache(tmp_path: Path) -> None:
    root = _lab(tmp_path / "lab", '["config.toml"]')  # train.py forgotten
    check = cli(root, "check", "--json")
    assert check.returncode == 0 and json.loads(check.stdout)["undeclared"] == ["train.py"]
    assert "train.py is editable but no stage lists it in `inputs`" in check.stderr

    base = _measure(root, BASE)
    assert base and all(r.outcome == "method_failure" and r.kind == "crash" for r in base), base
    log = Path(base[0].detail.rsplit("log ", 1)[1])
    assert "train.py" in log.read_text() and "No such file or directory" in log.read_text()

    # the comment-only branch is not served the baseline's outputs: it runs, and fails the same way
    commit = _comment_branch(root, "comment-only")
    results = _measure(root, commit)
    assert results and all(r.outcome == "method_failure" for r in results)
    db = sqlite3.connect(root / "runs" / "autoresearch.db")
    served = db.execute("SELECT count(*) FROM stage_exec s JOIN run r ON r.id = s.run_id "
                        "WHERE r.\"commit\" = ? AND s.outcome = 'cache_hit'", (commit,)).fetchone()[0]
    assert served == 0


def test_declared_inputs_key_the_cache_so_a_changed_file_reruns(tmp_path: Path) -> None:
    root = _lab(tmp_path / "lab", '["train.py", "config.toml"]')
    check = cli(root, "check", "--json")
    assert json.loads(check.stdout)["undeclared"] == [] and "warning" not in check.stderr
    base = _measure(root, BASE)
    assert base and all(r.outcome == "ok" for r in base)
    commit = _comment_branch(root, "comment-only")
    results = _measure(root, commit)
    assert all(r.outcome == "ok" for r in results)
    db = sqlite3.connect(root / "runs" / "autoresearch.db")
    outcomes = [o for (o,) in db.execute("SELECT s.outcome FROM stage_exec s JOIN run r ON r.id = s.run_id "
                                         "WHERE r.\"commit\" = ?", (commit,))]
    assert outcomes and all(o == "ok" for o in outcomes), outcomes  # executed again, never a cache hit


def test_a_human_branch_that_does_not_run_is_rejected_before_any_run_is_queued(tmp_path: Path) -> None:
    root = _lab(tmp_path / "lab", '["train.py", "config.toml"]')
    git(root, "checkout", "-q", "-b", "broken", BASE)
    (root / "train.py").write_text((root / "train.py").read_text().replace("def features(", "def features(("))
    git(root, "commit", "-qam", "broken")
    git(root, "checkout", "-q", "main")
    assert cli(root, "seed", "--branch", "broken").returncode == 0
    run = cli(root, "run", "--offline", "--max-hypotheses", "1")
    assert run.returncode == 0, run.stderr
    h = json.loads(cli(root, "status", "--json").stdout)["hypotheses"][0]
    assert h["decision"] == "reject" and h["reject_kind"] == "smoke_failed", h
    db = sqlite3.connect(root / "runs" / "autoresearch.db")
    reason = db.execute("SELECT reject_reason FROM hypothesis WHERE id = ?", (h["id"],)).fetchone()[0]
    assert "SyntaxError" in reason, reason
    commit = git(root, "rev-parse", "broken")
    assert db.execute("SELECT count(*) FROM run WHERE \"commit\" = ?", (commit,)).fetchone()[0] == 0
