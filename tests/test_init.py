"""`autoresearch init`: a real git repo with the template, a baseline branch, runs/ ignored."""

import contextlib
import importlib
import subprocess
import sys
from pathlib import Path

import git
import pytest

from agent.labinit import init_lab
from pipeline.lab import BASELINE_BRANCH, load_lab

pytestmark = [pytest.mark.integration, pytest.mark.slow]


TEMPLATE = Path(__file__).resolve().parent.parent / "pipeline" / "templates" / "transactions"


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


def test_init_gpus_writes_a_gpu_lab_that_parses(tmp_path):
    proc = cli("init", str(tmp_path / "lab"), "--gpus", "0.25")
    assert proc.returncode == 0, proc.stderr
    assert "[run] gpus = 0.25" in proc.stderr
    assert load_lab(tmp_path / "lab").config.run.gpus == 0.25
    assert "gpus = 0.25\n" in (tmp_path / "lab" / "research.toml").read_text()
    assert not git.Repo(tmp_path / "lab").is_dirty(untracked_files=True)  # committed as the baseline

    # a template without a gpus line gets one under [run]
    assert load_lab(init_lab(tmp_path / "cmd", harness="command", gpus=2)).config.run.gpus == 2

    proc = cli("init", str(tmp_path / "bad"), "--gpus", "1.5")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert "run.gpus" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "bad").exists()  # refused before anything was written


def test_template_trains_on_cuda_with_bf16_only_when_cuda_is_there(monkeypatch):
    import torch

    monkeypatch.syspath_prepend(str(TEMPLATE))
    try:
        train = importlib.import_module("train")
        device, autocast = train.device_and_autocast()
        if not torch.cuda.is_available():  # this machine: the CPU, in float32, as before
            assert device == torch.device("cpu") and isinstance(autocast, contextlib.nullcontext)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch, "autocast", lambda device_type, dtype: (device_type, dtype))
        assert train.device_and_autocast() == (torch.device("cuda"), ("cuda", torch.bfloat16))
    finally:
        for mod in ("train", "model"):
            sys.modules.pop(mod, None)
