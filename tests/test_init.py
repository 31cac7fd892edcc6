"""`autoresearch init`: a real git repo with the template, a baseline branch, runs/ ignored."""

import subprocess
import sys

import git
import pytest

from pipeline.lab import BASELINE_BRANCH, load_lab

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "agent.cli", *args], capture_output=True, text=True, cwd=cwd)


def test_init_creates_a_lab_repo(tmp_path):
    target = tmp_path / "lab"
    proc = cli("init", str(target), "--suite", "full")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(target.resolve())
    repo = git.Repo(target)
    assert BASELINE_BRANCH in repo.heads
    assert repo.heads[BASELINE_BRANCH].commit == repo.head.commit
    tracked = set(repo.git.ls_files().split())
    assert {"research.toml", "program.md", "model.py", "train.py", "config.toml", ".gitignore"} <= tracked
    assert not repo.is_dirty(untracked_files=True)
    lab = load_lab(target)
    assert lab.config.benchmark.suite == "full" and len(lab.tasks()) == 24
    (target / "runs" / "x.txt").write_text("state")
    assert repo.ignored("runs/x.txt") == ["runs/x.txt"]


def test_init_refuses_non_empty_dir_without_force(tmp_path):
    target = tmp_path / "lab"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    proc = cli("init", str(target))
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "--force" in proc.stderr
    assert (target / "notes.txt").read_text() == "mine" and not (target / ".git").exists()
    proc = cli("init", str(target), "--force")
    assert proc.returncode == 0, proc.stderr
    assert (target / "notes.txt").read_text() == "mine"


def test_init_unknown_suite_is_bad_input(tmp_path):
    proc = cli("init", str(tmp_path / "lab"), "--suite", "medium")
    assert proc.returncode == 2 and "unknown suite 'medium'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_init_of_the_simulated_lab_takes_its_one_suite_without_being_told(tmp_path):
    proc = cli("init", str(tmp_path / "lab"), "--harness", "sim")
    assert proc.returncode == 0, proc.stderr
    assert "(suite sim)" in proc.stderr
    lab = load_lab(tmp_path / "lab")
    assert (lab.config.benchmark.harness, lab.config.benchmark.suite) == ("sim", "sim") and len(lab.tasks()) == 8
    proc = cli("init", str(tmp_path / "other"), "--harness", "sim", "--suite", "small")  # named, it is checked
    assert proc.returncode == 2 and "unknown suite 'small'; expected one of ['sim']" in proc.stderr
    assert "Traceback" not in proc.stderr
