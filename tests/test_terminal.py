"""`autoresearch run` as a person sees it. On a terminal (a real pseudo-terminal here): timestamped
lines without the logging handler's source path, a progress bar per look with runs done of total
and an ETA, a closing table. Piped: plain lines, the closing table on stdout, JSON only with
`--json`. The real CLI process, the tiny lab."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.lab import REPO, cli, cli_env

pytestmark = pytest.mark.system


def run_in_pty(root: Path, *args: str, timeout: float = 400) -> str:
    """The command with stdout and stderr on a pseudo-terminal (80×... as a terminal would be); its output."""
    master, slave = pty.openpty()
    env = cli_env(COLUMNS="120", LINES="40", TERM="xterm-256color")
    proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "--repo", str(root), *args], cwd=REPO, env=env,
                            stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            r, _, _ = select.select([master], [], [], 0.5)
            if master in r:
                try:
                    data = os.read(master, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not data:
                    break
                out += data
            elif proc.poll() is not None:
                break
        proc.wait(timeout=60)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out.decode(errors="replace")[-3000:]
    return out.decode(errors="replace")


def test_on_a_terminal_progress_bars_no_source_paths_and_a_closing_table(lab: Path) -> None:
    text = run_in_pty(lab, "run", "--offline", "--max-hypotheses", "1", "--workers", "2")
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)
    assert "cli.py:" not in plain and "loop.py:" not in plain  # no logging source paths
    assert "loop started" in plain
    assert re.search(r"#1 look 2 .*\d+/\d+ .*running, ETA", plain), plain[-3000:]  # a look's bar
    assert "━" in plain  # rich's bar
    assert re.search(r"┃ id ┃ title", plain) or "│ 1" in plain, plain[-2000:]  # the closing table
    assert '"started"' not in plain  # no raw JSON blob


def test_piped_plain_lines_a_table_on_stdout_and_json_only_when_asked(lab: Path) -> None:
    run = cli(lab, "run", "--offline", "--max-hypotheses", "1")
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d loop started", run.stderr)
    assert "━" not in run.stderr and "cli.py:" not in run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].split() == ["id", "title", "status", "verdict", "decision", "baseline"]
    assert lines[1].split()[0] == "1" and "done" in lines[1]
    with_json = cli(lab, "run", "--offline", "--max-hypotheses", "1", "--json")
    assert with_json.returncode == 0, with_json.stderr[-3000:]
    out = json.loads(with_json.stdout)
    assert out["started"] == 1 and [r["id"] for r in out["this_run"]] == [2]
