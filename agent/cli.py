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


def main() -> None:
    """Console-script entry point: user errors become one line and exit code 2."""
    try:
        app(standalone_mode=False)
    except UserError as e:
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)
    except typer.Abort:
        typer.echo("aborted", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # click usage errors carry their own exit code
        import click

        if isinstance(e, click.exceptions.ClickException):
            e.show()
            sys.exit(2 if isinstance(e, click.UsageError) else 1)
        if isinstance(e, click.exceptions.Exit):
            sys.exit(e.exit_code)
        raise


if __name__ == "__main__":
    main()
