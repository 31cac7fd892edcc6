"""The CLI starts light: no torch, peft, ray or langgraph at start-up."""

import subprocess
import sys

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


def test_unknown_command_is_usage_error():
    proc = subprocess.run([sys.executable, "-m", "agent.cli", "no-such-command"], capture_output=True, text=True)
    assert proc.returncode == 2
