"""`status` prints what humans typed verbatim: brackets in a title are text, not rich markup."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def cli(lab, *args):
    return subprocess.run([sys.executable, "-m", "agent.cli", "--repo", str(lab), *args], capture_output=True, text=True)


def test_status_shows_titles_with_brackets(lab):
    assert cli(lab, "seed", "Use [/b] tokens and [bold]x[/bold]").returncode == 0
    proc = cli(lab, "status")
    assert proc.returncode == 0, proc.stderr
    assert "[/b]" in proc.stdout and "[bold]x" in proc.stdout


def test_seed_file_with_unknown_tasks_is_bad_input(lab, tmp_path):
    f = tmp_path / "idea.json"
    f.write_text('{"title": "x", "expected_tasks": ["weather"], "edits": []}')
    proc = cli(lab, "seed", "--file", str(f))
    assert proc.returncode == 2 and "expected_tasks" in proc.stderr and "Traceback" not in proc.stderr
    f.write_text('{"title": "x", "edits": "not a list"}')
    proc = cli(lab, "seed", "--file", str(f))
    assert proc.returncode == 2 and "must be a list" in proc.stderr
