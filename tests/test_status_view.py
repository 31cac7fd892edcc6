"""`status` prints what humans typed verbatim: brackets in a title are text, not rich markup."""

import subprocess
import sys


def cli(lab, *args):
    return subprocess.run([sys.executable, "-m", "agent.cli", "--repo", str(lab), *args], capture_output=True, text=True)


def test_status_shows_titles_with_brackets(lab):
    assert cli(lab, "seed", "Use [/b] tokens and [bold]x[/bold]").returncode == 0
    proc = cli(lab, "status")
    assert proc.returncode == 0, proc.stderr
    assert "[/b]" in proc.stdout and "[bold]x" in proc.stdout
