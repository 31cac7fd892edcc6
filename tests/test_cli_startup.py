"""The CLI starts light: no torch, peft, ray or langgraph at start-up. Imports run one way: the
pipeline never imports the agent, and reading a lab's config imports no numpy."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

HEAVY = ["torch", "peft", "ray", "langgraph", "transformers", "scipy", "matplotlib"]


def test_help_imports_nothing_heavy():
    code = (
        "import sys\n"
        "from agent.cli import app\n"
        "try:\n"
        "    app(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print('HEAVY=' + ','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "Usage" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "HEAVY=", "heavy modules imported at start-up"


def test_the_pipeline_hides_the_agent_without_importing_it(tmp_path):
    from agent.labinit import init_lab

    lab = init_lab(tmp_path / "lab", harness="command")
    code = (
        "import sys\n"
        "from pipeline import isolation\n"
        "from pathlib import Path\n"
        "from pipeline.lab import Lab, parse_config\n"
        f"path = {str(lab / 'research.toml')!r}\n"
        f"lab = Lab(Path({str(lab)!r}), parse_config(open(path).read(), path))\n"
        "hidden = isolation.spec_for(lab, ro=[])['hidden']\n"
        "print(sorted(p.rsplit('/', 1)[-1] for p in hidden[:2]), 'agent' in sys.modules, 'numpy' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["['agent',", "'pipeline']", "False", "False"], proc.stdout


def test_unknown_command_is_usage_error():
    proc = subprocess.run([sys.executable, "-m", "agent.cli", "no-such-command"], capture_output=True, text=True)
    assert proc.returncode == 2


@pytest.mark.slow
def test_repo_and_db_are_accepted_after_the_command_name(tmp_path):
    from agent.labinit import init_lab

    lab = init_lab(tmp_path / "lab", harness="command")
    db = f"sqlite:///{tmp_path / 'other.db'}"
    before = subprocess.run([sys.executable, "-m", "agent.cli", "--repo", str(lab), "--db", db, "status", "--json"],
                            capture_output=True, text=True, cwd=tmp_path)
    after = subprocess.run([sys.executable, "-m", "agent.cli", "status", "--json", f"--repo={lab}", "--db", db],
                           capture_output=True, text=True, cwd=tmp_path)
    assert before.returncode == 0 and after.returncode == 0, after.stderr
    assert before.stdout == after.stdout and '"lab": "mylab"' in after.stdout
    assert (tmp_path / "other.db").is_file() and not (lab / "runs" / "autoresearch.db").exists()
    wrong = subprocess.run([sys.executable, "-m", "agent.cli", "status", "--repo", str(tmp_path)],
                           capture_output=True, text=True, cwd=tmp_path)
    assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1 and "research.toml" in wrong.stderr
