"""`autoresearch power` and `autoresearch gate-sim` through the real entry point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_power_json_reproduces_reference_post():
    p = cli("power", "--sigma", "0.02", "--baseline", "5", "--challenger", "2", "--two-sided", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["mde"] == pytest.approx(0.0765, abs=5e-4) and out["power"] == pytest.approx(0.95)
    assert out["alpha"] == 0.05 and out["two_sided"] is True


def test_power_json_several_challenger_counts_and_effect():
    p = cli("power", "--sigma", "0.02", "--baseline", "5", "--challenger", "2", "--challenger", "5",
            "--challenger", "10", "--effect", "0.04", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert [r["challenger"] for r in out["rows"]] == [2, 5, 10]
    powers = [r["power"] for r in out["rows"]]
    assert powers == sorted(powers) and out["power"] == powers[0] == pytest.approx(0.488, abs=0.01)


def test_power_table_without_json():
    p = cli("power", "--sigma", "0.02", "--baseline", "5", "--challenger", "2")
    assert p.returncode == 0 and "MDE" in p.stdout and "0.07653" in p.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["--sigma", "0", "--baseline", "5", "--challenger", "2"],
        ["--sigma", "-0.1", "--baseline", "5", "--challenger", "2"],
        ["--sigma", "0.02", "--baseline", "5", "--challenger", "2", "--alpha", "1.5"],
        ["--sigma", "0.02", "--baseline", "0", "--challenger", "2"],
        ["--sigma", "0.02", "--baseline", "5", "--challenger", "2", "--power", "1"],
    ],
)
def test_power_bad_input_exits_2_with_one_line(args):
    p = cli("power", *args, "--json")
    assert p.returncode == 2
    assert p.stdout == "" and len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr


@pytest.mark.slow  # a simulation through the CLI
def test_gate_sim_json_null_and_effect():
    p = cli("gate-sim", "--protocol", "sequential", "--trials", "2000", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert {"false_positive_rate", "mean_challenger_runs", "horizontal_rate", "per_task_rate"} <= set(out)
    assert 0 <= out["false_positive_rate"] < 0.1 and 2 <= out["mean_challenger_runs"] <= 10
    p = cli("gate-sim", "--protocol", "fixed", "--effect", "2", "--tasks", "3", "--rho", "0.5", "--trials", "1000",
            "--json")
    out = json.loads(p.stdout)
    assert p.returncode == 0 and out["power"] > 0.5 and "false_positive_rate" not in out


@pytest.mark.parametrize("args", [["--rho", "1.5"], ["--protocol", "bayes"], ["--looks", "2,x"], ["--trials", "0"]])
def test_gate_sim_bad_input_exits_2(args):
    p = cli("gate-sim", *args, "--trials" if "--trials" not in args else "--seed", "10", "--json")
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].startswith("error:") and "Traceback" not in p.stderr
