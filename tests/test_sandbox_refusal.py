"""Where the kernel refuses the sandbox's namespaces, `run` refuses to start: one line, exit 2,
naming the opt-out; nothing runs. An opted-out lab runs, and says UNSANDBOXED.

The refusal is real, not simulated: the loop runs in a user namespace whose limit on nested user
namespaces is 0 (`user.max_user_namespaces`, which a namespace's owner may lower for itself).
"""

from __future__ import annotations

import json
import shlex
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from agent.labinit import init_lab
from support.lab import REPO, cli, cli_env, git

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _run_without_user_namespaces(root: Path) -> subprocess.CompletedProcess[str]:
    loop = shlex.join([sys.executable, "-m", "agent.cli", "--repo", str(root), "run", "--offline",
                       "--max-hypotheses", "1"])
    return subprocess.run(["unshare", "-Ur", "sh", "-c", f"echo 0 > /proc/sys/user/max_user_namespaces && exec {loop}"],
                          cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)


def test_run_refuses_in_one_line_where_namespaces_are_refused(tmp_path: Path) -> None:
    root = init_lab(tmp_path / "lab", harness="command")
    out = _run_without_user_namespaces(root)
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the Linux sandbox cannot start here (")
    assert "user.max_user_namespaces" in last and 'set [run] sandbox = "off"' in last
    assert "Traceback" not in out.stderr
    db = sqlite3.connect(root / "runs" / "autoresearch.db")
    assert db.execute("SELECT count(*) FROM result").fetchone()[0] == 0
    assert db.execute("SELECT count(*) FROM stage_exec").fetchone()[0] == 0


def test_an_opted_out_lab_runs_there_and_says_unsandboxed(tmp_path: Path) -> None:
    root = init_lab(tmp_path / "lab", harness="command")
    toml = root / "research.toml"
    toml.write_text(toml.read_text().replace('sandbox = "auto"', 'sandbox = "off"'))
    git(root, "commit", "-qam", "opt out")
    git(root, "branch", "-f", "autoresearch/baseline", "HEAD")
    out = _run_without_user_namespaces(root)
    assert out.returncode == 0, out.stderr[-2000:]
    status = json.loads(cli(root, "status", "--json").stdout)
    assert status["sandbox"] == "UNSANDBOXED"
    assert status["hypotheses"] and status["hypotheses"][0]["verdict"]
    assert "UNSANDBOXED" in cli(root, "check").stdout
