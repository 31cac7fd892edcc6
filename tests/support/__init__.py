"""What the tests share, in one package (on the path: pytest puts `tests/` there; the benchmarks
that reuse a lab put it there themselves). The primitives are here; the labs by kind:

- `support.lab` — the tiny transactions lab (the real template, shrunk), the real `Loop`, a CLI
  subprocess that runs to the end (`RunProcess`), a fake OpenAI server that routes answers by prompt;
- `support.tiny` — a numpy-only harness and lab for the execution layer (`TinyHarness`, `make_lab`);
- `support.summary` — hypotheses with real gate records for summaries, reviews, pictures, digests;
- `support.views` — a lab decided by the real loop on planted runs, for the web page and MLflow;
- `support.fake_openai` — a real HTTP server speaking the OpenAI protocol, scripted;
- `support.ray_cluster` — a real Ray cluster started with `ray start`, stopped by pid.

`tests/conftest.py` exposes them as fixtures (`lab`, `lab_template`, `fake_openai`, `llm`, `pg_url`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent.parent  # the checkout
TESTS = REPO / "tests"


def git(root: Path, *args: str) -> str:
    """`git ARGS` in `root`; its stdout, stripped (a failure raises)."""
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout.strip()


def free_port() -> int:
    """A port on loopback nobody listens on now (connections to it are refused until one binds it)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a CLI subprocess: no LLM endpoint unless given, this checkout importable.

    Built from this process's environment (so the session's NO_PROXY and git config set in conftest.py
    pass through), less the host's LLM, lab, Ray cluster and MLflow settings."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OPENAI_", "AUTORESEARCH_")) and k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    env.update(extra)
    return env


def cli(root: Path, *args: str, env: dict[str, str] | None = None,
        timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """The real console entry point on the lab at `root`, in a subprocess (`cli_env()` unless `env`)."""
    return subprocess.run([sys.executable, "-m", "agent.cli", "--repo", str(root), *args], cwd=REPO,
                          env=env or cli_env(), capture_output=True, text=True, timeout=timeout)


def cli_json(root: Path, *args: str) -> Any:
    """`cli` that must succeed, its stdout parsed as JSON."""
    out = cli(root, *args)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)
