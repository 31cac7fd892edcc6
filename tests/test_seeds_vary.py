"""Seeds must vary (README, The gate), through the real CLI: a branch that ignores the seed it is given and
hard-codes the baseline's luckiest one repeats that one draw on every run. Its runs have no spread
while the baseline's do: the gate says so at every look, and the loop never promotes it on its
own (held for review with the reason, if the gate's verdict is an improvement at all)."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest

from support.lab import cli, git
from test_attacks import FEATURIZE, RESEARCH, TEMPLATE, TRAIN

pytestmark = pytest.mark.system


def _lab(root: Path) -> Path:
    root.mkdir(parents=True)
    for name in ("prepare.py", "score.py", "program.md"):
        shutil.copy(TEMPLATE / name, root / name)
    (root / ".gitignore").write_text("runs/\n__pycache__/\n")
    research = RESEARCH.replace("baseline_runs = 5\nlooks = [2, 5]", "baseline_runs = 10\nlooks = [2, 5, 10]")
    assert research != RESEARCH
    (root / "research.toml").write_text(research)
    (root / "featurize.py").write_text(FEATURIZE)
    (root / "train.py").write_text(TRAIN)
    (root / "config.toml").write_text("[train]\nl2 = 0.05\n")
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "lab")
    git(root, "branch", "autoresearch/baseline")
    return root


def test_a_branch_that_hard_codes_the_luckiest_seed_is_never_promoted(tmp_path: Path) -> None:
    root = _lab(tmp_path / "lab")
    # the attacker has seen the baseline's runs: the variance study measures its first 10 seeds
    out = cli(root, "variance", "--runs", "10", "--json", timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    base = json.loads(out.stdout)["commit"]
    db = sqlite3.connect(root / "runs" / "autoresearch.db")
    rows = db.execute("SELECT seed, AVG(value) FROM result WHERE \"commit\" = ? GROUP BY seed", (base,)).fetchall()
    assert len(rows) == 10
    best = min(rows, key=lambda r: r[1])[0]  # log-loss: lower is better
    lucky = TRAIN.replace("rng = np.random.default_rng(a.seed)", f"rng = np.random.default_rng({best})  # ignores --seed")
    assert lucky != TRAIN
    git(root, "checkout", "-q", "-b", "lucky-seed", "autoresearch/baseline")
    (root / "train.py").write_text(lucky)
    git(root, "commit", "-qam", "a lucky seed")
    git(root, "checkout", "-q", "main")

    assert cli(root, "seed", "--branch", "lucky-seed", "--title", "lucky seed").returncode == 0
    run = cli(root, "run", "--offline", "--max-hypotheses", "1", timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    status = json.loads(cli(root, "status", "--json").stdout)
    (h,) = status["hypotheses"]
    assert git(root, "tag", "-l", "baseline/*") == "" and not h["promoted_tag"], h

    looks = [json.loads(p) for (p,) in db.execute(
        "SELECT payload FROM gate_record WHERE hypothesis = ? AND kind = 'verdict' ORDER BY look", (str(h["id"]),))]
    assert looks and all(r["look"] >= 2 for r in looks)
    for r in looks:  # every look saw it: no spread over seeds while the baseline's runs vary
        assert r["seed_spread"]["held"] and r["seed_spread"]["ratio"] == 0, r["seed_spread"]
    chal = db.execute("SELECT DISTINCT task, value FROM result WHERE \"commit\" != ?", (base,)).fetchall()
    assert len(chal) == 3  # one value per task, whatever the seed
    if h["verdict"] == "improvement":
        assert h["status"] == "held" and h["decision"] == "hold", h
        reason = db.execute("SELECT rationale_decision FROM hypothesis WHERE id = ?", (h["id"],)).fetchone()[0]
        assert "seeds must vary" in reason and "do not vary with the seed" in reason, reason
    else:
        assert h["decision"] == "abandon", h
