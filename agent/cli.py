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


@app.command("power")
def power_cmd(
    sigma: float = typer.Option(..., "--sigma", help="Per-run standard deviation of the metric (e.g. 0.02 AUC)."),
    baseline: int = typer.Option(..., "--baseline", help="Baseline runs."),
    challenger: list[int] = typer.Option(..., "--challenger", help="Challenger runs; repeat for several counts."),
    alpha: Optional[float] = typer.Option(None, "--alpha", help="Level (default 0.05 two-sided, 0.025 one-sided)."),
    two_sided: bool = typer.Option(False, "--two-sided", help="Two-sided test (the reference post's)."),
    effect: Optional[float] = typer.Option(None, "--effect", help="True difference to compute the power at."),
    target_power: float = typer.Option(0.95, "--power", help="Power at which the MDE is reported."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Power / minimum detectable effect of the pooled Student t (non-central t).

    JSON: {"mde", "power", "challenger"} for the first --challenger, and "rows" with one
    {"challenger", "df", "se", "mde", "power_at", "power"} per count; "power" is at --effect,
    or at the MDE when no effect is given.
    """
    from pipeline.gate.power import plan

    result = plan(sigma, baseline, challenger, alpha, two_sided, effect, target_power)
    if as_json:
        emit_json(result)
    else:
        from rich.console import Console

        from pipeline.gate.cli_views import power_table

        Console().print(power_table(result))


@app.command("gate-sim")
def gate_sim_cmd(
    protocol: str = typer.Option("sequential", "--protocol", help="fixed or sequential."),
    effect: float = typer.Option(0.0, "--effect", help="True improvement in σ units (0: false-positive rate)."),
    tasks: int = typer.Option(8, "--tasks", help="Tasks per hypothesis."),
    rho: float = typer.Option(0.0, "--rho", help="Cross-task correlation of a seed's runs (shared pretraining)."),
    trials: int = typer.Option(20_000, "--trials", help="Simulated hypotheses."),
    baseline_runs: int = typer.Option(5, "--baseline-runs", help="Baseline runs per task."),
    looks: str = typer.Option("2,5,10", "--looks", help="Planned challenger run counts, comma-separated."),
    alpha: float = typer.Option(0.025, "--alpha", help="One-sided level."),
    futility_p: float = typer.Option(0.30, "--futility-p", help="Escalate only while the one-sided p is below this."),
    harm_q: float = typer.Option(0.10, "--harm-q", help="Benjamini-Hochberg q for per-task wins and harms."),
    history: int = typer.Option(0, "--history", help="Extra baseline-commit runs per task (variance prior)."),
    affected: Optional[int] = typer.Option(None, "--affected", help="Tasks carrying the effect (default: all)."),
    seed: int = typer.Option(0, "--seed", help="RNG seed."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Simulate a protocol: false-positive rate (effect 0) or power, and mean challenger runs.

    JSON: "false_positive_rate" (effect 0) or "power" (the rate of `improvement` verdicts) with its
    "_se", "mean_challenger_runs", horizontal and per-task crossing rates, "verdict_rates".
    """
    from pipeline.gate.sim import SimInputError, simulate

    try:
        planned = tuple(int(x) for x in looks.split(",") if x.strip())
    except ValueError:
        raise SimInputError(f"--looks: expected comma-separated integers, got {looks!r}") from None
    typer.echo(f"simulating {trials} trials ({protocol})...", err=True)
    result = simulate(
        protocol=protocol, effect=effect, tasks=tasks, rho=rho, trials=trials, baseline_runs=baseline_runs,
        looks=planned, alpha=alpha, futility_p=futility_p, harm_q=harm_q, history=history, affected=affected,
        seed=seed,
    )
    if as_json:
        emit_json(result.to_json())
    else:
        from rich.console import Console

        from pipeline.gate.cli_views import sim_table

        Console().print(sim_table(result))


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
