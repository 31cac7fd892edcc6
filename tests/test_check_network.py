"""`network = true` and the review page / store (issue 20, "Limits that hold"): a stage with the
network shares the host's, loopback included, so it can reach `autoresearch serve` and a PostgreSQL
store on this machine. That cannot be prevented from inside the sandbox, so `check` says so in one
line (stderr, and under `warnings` in `check --json`). Through the real CLI on a lab made by
`autoresearch init`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.lab import cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WARNING = ("warning: [run] network = true: stages share the host's network and can reach the review page "
           "(autoresearch serve) and a PostgreSQL store on this machine; prefer network = false")


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("net") / "lab"
    out = cli(root, "init", str(root), "--harness", "command")
    assert out.returncode == 0, out.stderr
    return root


def set_network(lab: Path, value: str) -> None:
    toml = lab / "research.toml"
    text = toml.read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith("network = ")]
    assert len(lines) == 1, lines
    toml.write_text(text.replace(lines[0], f"network = {value}"))


def test_check_warns_in_one_line_when_stages_have_the_network(lab: Path) -> None:
    set_network(lab, "true")
    out = cli(lab, "check")
    assert out.returncode == 0, out.stderr
    assert [ln for ln in out.stderr.splitlines() if "network" in ln] == [WARNING]
    assert "Traceback" not in out.stderr
    out = cli(lab, "check", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["warnings"] == [WARNING.removeprefix("warning: ")]


def test_check_says_nothing_of_the_network_when_it_is_off(lab: Path) -> None:
    set_network(lab, "false")
    out = cli(lab, "check")
    assert out.returncode == 0, out.stderr
    assert "network" not in out.stderr
    assert json.loads(cli(lab, "check", "--json").stdout)["warnings"] == []


def test_check_warns_of_a_notify_url_with_a_path_written_into_research_toml(lab: Path) -> None:
    """A Slack-style hook's path is its secret; research.toml is committed and stages can read it."""
    toml = lab / "research.toml"
    before = toml.read_text()
    try:
        toml.write_text(before + '\n[notify]\n[[notify.target]]\nkind = "slack"\nname = "team"\n'
                                 'url = "https://hooks.example/services/T0K3N"\n'
                                 '[[notify.target]]\nkind = "webhook"\nurl = "http://127.0.0.1:9000"\n')
        out = cli(lab, "check", "--json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["warnings"] == [
            "[notify] target team: its url has a path or query, which for Slack-style hooks is the secret; "
            "research.toml is committed and every stage can read it; prefer url_env"]
        assert "T0K3N" not in out.stdout + out.stderr
    finally:
        toml.write_text(before)


def test_a_network_that_is_not_a_boolean_is_one_line_exit_2(lab: Path) -> None:
    set_network(lab, '"yes"')
    out = cli(lab, "check")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "run.network" in out.stderr, out.stderr
    set_network(lab, "false")
