"""The `autoresearch` command line: thin wrappers over `pipeline/` and `agent/`.

Start-up imports nothing heavy (no torch, peft, ray, langgraph): each command imports what it
needs inside its body. Data goes to stdout, progress and logs to stderr. Exit codes: 0 ok,
1 failure, 2 bad input (a `UserError`, printed as one line, never a traceback).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from pipeline.errors import UserError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Agent-driven autoresearch loop: hypotheses as branches, a multi-task benchmark, a statistical gate.",
)


class Ctx:
    repo: Path = Path(".")
    db: str | None = None


@app.callback()
def _global(
    repo: Path = typer.Option(
        Path(os.environ.get("AUTORESEARCH_REPO", ".")), "--repo", help="The lab (env AUTORESEARCH_REPO)."
    ),
    db: Optional[str] = typer.Option(
        os.environ.get("AUTORESEARCH_DB"), "--db", help="Store URL (env AUTORESEARCH_DB; default SQLite in runs/)."
    ),
) -> None:
    Ctx.repo = repo
    Ctx.db = db


def emit_json(obj: object) -> None:
    """Stable JSON on stdout: sorted keys, no NaN surprises."""
    sys.stdout.write(json.dumps(obj, sort_keys=True, indent=2, default=str) + "\n")


@app.command()
def init(
    directory: Path = typer.Argument(..., help="Where to create the lab."),
    suite: str = typer.Option("small", "--suite", help="Benchmark suite: small (8 tasks, CPU) or full (24 tasks)."),
    force: bool = typer.Option(False, "--force", help="Create even if DIR exists and is not empty."),
) -> None:
    """Create a lab from the bundled template: a git repo with a baseline branch."""
    from agent.labinit import init_lab

    root = init_lab(directory, suite=suite, force=force)
    typer.echo(str(root))
    typer.echo(f"lab created at {root} (suite {suite}); baseline branch autoresearch/baseline", err=True)


@app.command()
def check(as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Validate the lab (research.toml, harness, tasks, editable files) and summarise it."""
    from pipeline.lab import load_lab

    lab = load_lab(Ctx.repo)
    cfg = lab.config
    summary = {
        "lab": cfg.lab.name,
        "root": str(lab.root),
        "harness": cfg.benchmark.harness,
        "suite": cfg.benchmark.suite,
        "tasks": lab.tasks(),
        "stages": [s.name for s in lab.stages_in_order()],
        "editable": cfg.lab.editable,
        "protocol": cfg.gate.protocol,
        "looks": cfg.gate.looks,
    }
    if as_json:
        emit_json(summary)
    else:
        for key, value in summary.items():
            typer.echo(f"{key:10s} {', '.join(map(str, value)) if isinstance(value, list) else value}")


def main() -> None:
    """Console-script entry point: user errors become one line and exit code 2.

    Usage errors (unknown command or option) are typer's own, also exit code 2.
    """
    try:
        app()
    except UserError as e:
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
