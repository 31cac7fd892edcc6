"""`autoresearch variance`: identical baseline runs through the real executor, summarised."""

import json
import subprocess
import sys

import pytest

from support.lab import cli_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_variance_study_on_the_tiny_lab(lab):
    proc = subprocess.run([sys.executable, "-m", "agent.cli", "--repo", str(lab), "variance", "--runs", "3", "--json"],
                          capture_output=True, text=True, env=cli_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["runs"] == 3 and set(out["tasks"]) == {"default_90d", "churn_60d"}
    for t in out["tasks"].values():
        assert t["runs"] + t["failed"] == 3
        assert 0.0 < t["mean"] < 1.0 and t["sd"] > 0
        # the MDE shrinks as the challenger arm grows
        assert t["mde"]["2"] > t["mde"]["3"] > 0
    assert -1.0 <= out["mean_cross_task_correlation"] <= 1.0
    # a second call measures nothing new: the runs exist under their keys
    again = subprocess.run([sys.executable, "-m", "agent.cli", "--repo", str(lab), "variance", "--runs", "3", "--json"],
                           capture_output=True, text=True, env=cli_env(), timeout=600)
    assert json.loads(again.stdout)["tasks"] == out["tasks"]


def test_variance_needs_two_runs(lab):
    proc = subprocess.run([sys.executable, "-m", "agent.cli", "--repo", str(lab), "variance", "--runs", "1"],
                          capture_output=True, text=True, env=cli_env())
    assert proc.returncode == 2
