"""Rich tables for the planning commands (`power`, `gate-sim`); the gate's own record renders in report.py."""

from __future__ import annotations

from typing import Any

from pipeline.gate.sim import SimResult


def power_table(plan: dict[str, Any]) -> Any:
    """One row per challenger count: df, SE, MDE at the target power, power at the effect."""
    from rich.table import Table

    sided = "two-sided" if plan["two_sided"] else "one-sided"
    table = Table(
        title=f"pooled t: σ={plan['sigma']:g}, {plan['baseline']} baseline runs, α={plan['alpha']:g} {sided}"
    )
    for col in ("challenger runs", "df", "SE", f"MDE @ {plan['target_power']:.0%} power", "effect", "power"):
        table.add_column(col, justify="right")
    for r in plan["rows"]:
        table.add_row(
            str(r["challenger"]), str(r["df"]), f"{r['se']:.4g}", f"{r['mde']:.4g}", f"{r['power_at']:.4g}",
            f"{r['power']:.3f}",
        )
    return table


def sim_table(result: SimResult) -> Any:
    """The simulated rates with their binomial standard errors."""
    from rich.table import Table

    table = Table(
        title=(
            f"gate-sim {result.protocol}: effect {result.effect:g}σ on {result.affected}/{result.tasks} tasks, "
            f"ρ={result.rho:g}, pair ρ={result.pair_rho:g}"
            + (f" (history {result.history_pair_rho:g}, {result.pair_history} comparisons, "
               f"{'lazy' if result.lazy else 'eager'} baseline)" if result.history_pair_rho is not None else "")
            + (f", challenger σ × {result.challenger_sd:g}" if result.challenger_sd != 1 else "")
            + f", {result.trials} trials, looks {result.looks}"
        )
    )
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_column("± SE", justify="right")
    headline = "power (improvement verdict)" if result.effect else "false-positive rate (improvement verdict)"
    rows: list[tuple[str, float | None]] = [
        (headline, result.improvement_rate),
        ("of which held: seeds do not vary, or noisier than the lab", result.held_rate),
        ("horizontal test crossed (looks reached)", result.horizontal_rate),
        ("horizontal test crossed (every look)", result.horizontal_rate_all_looks),
        ("per-task test crossed (looks reached)", result.per_task_rate),
        ("per-task test crossed (every look)", result.per_task_rate_all_looks),
        ("unaffected tasks crossed (looks reached)", result.per_task_null_rate),
        ("unaffected tasks crossed (every look)", result.per_task_null_rate_all_looks),
    ]
    for name, value in rows:
        if value is not None:
            table.add_row(name, f"{value:.4f}", f"{result.standard_error(value):.4f}")
    table.add_row("mean challenger runs", f"{result.mean_challenger_runs:.2f}", "")
    for verdict, rate in result.verdict_rates.items():
        table.add_row(f"verdict {verdict}", f"{rate:.4f}", "")
    return table
