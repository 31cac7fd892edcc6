"""The gate's record of one look, and its three renderings (rich table, Markdown, JSON).

The record is what the store keeps and what summaries quote: every number a human or the agent
sees comes from here, never from an LLM. `model_dump(mode="json")` is JSON-safe (no NaN: an
undefined number is null). Between looks (runs still arriving) the record carries estimates and
intervals only: no verdict, no win/harm flags, and the renderings use no "significant" wording.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict

from pipeline.gate.verdict import Verdict


def _finite(v: Any) -> float | None:
    if v is None:
        return None
    v = float(v)
    return v if math.isfinite(v) else None


Num = Annotated[float | None, BeforeValidator(_finite)]


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WelchResult(_Record):
    """Welch's unequal-variance comparison, shown beside the pooled one for unstable challengers."""

    delta: Num
    ci_low: Num
    ci_high: Num
    df: Num
    p: Num  # two-sided


class TaskResult(_Record):
    """One task at one look. Δ = challenger mean - baseline mean in metric units (raw sign)."""

    task: str
    baseline_runs: int
    challenger_runs: int
    failed_runs: int
    baseline_mean: Num
    challenger_mean: Num
    delta: Num
    ci_low: Num  # repeated (sequential) or fixed-sample interval, level 1 - 2α
    ci_high: Num
    sigma: Num  # per-run σ of the test (moderated for `sequential`)
    prior_df: int  # df of the baseline history behind the moderated variance (weight ≤ 30)
    df: Num
    t: Num  # oriented: + means better
    boundary: Num  # |t| needed at this look (None: not a look / cannot cross)
    p_nominal: Num  # two-sided fixed-sample p
    p: Num  # two-sided p on the protocol's scale (sequential: boundary-scaled)
    q: Num  # Benjamini-Hochberg over tasks
    flags: list[str]  # "win", "harm" (only at looks), "unstable" (challenger variance ≫ baseline)
    variance_ratio_p: Num  # one-sided F-test p for challenger variance > baseline variance
    welch: WelchResult | None = None  # present when flagged unstable
    mde_next: Num = None  # minimum detectable improvement (metric units, a size: a decrease if lower is better)
    pairs: int | None = None  # `paired`: the seeds with a result in both arms (the test's n)
    pairs_dropped: int = 0  # `paired`: challenger runs whose baseline seed has no result (left out)


class HorizontalResult(_Record):
    """The horizontal test: per-seed trimmed mean over tasks of (metric - baseline level) / σ_task, in σ units,
    oriented so that + is better (a lower-is-better metric is negated first)."""

    baseline_seeds: int
    challenger_seeds: int
    baseline_mean: Num
    challenger_mean: Num
    delta: Num
    ci_low: Num
    ci_high: Num
    df: Num
    t: Num
    boundary: Num
    p_one_sided: Num  # nominal, improvement side: the futility rule's p
    breadth_t: Num  # t with the most-improved task left out
    breadth_task: str | None
    breadth_required: bool  # that task stands out (Tukey fence): `improvement` needs breadth_t to cross too
    mde_next: Num = None  # in σ units
    pairs: int | None = None  # `paired`: seeds in the test (Δ, t and the interval are on the paired differences)


class SeedSpread(_Record):
    """Seeds must vary: the challenger's spread of per-seed horizontal values over the baseline's, and
    its lower-tail F-test; for `paired`, also not far above the lab's spread (upper tail). `held`:
    never promoted automatically."""

    ratio: Num
    p_lower: Num
    held: bool
    reason: str | None = None
    # `paired`: the challenger's spread over the lab's earlier arms' (the unpaired bound assumes no
    # noisier), and its upper-tail F-test: a significantly noisier challenger is held too
    noisier_ratio: Num = None
    p_upper: Num = None


class FailureReport(_Record):
    """Method failures among the challenger's runs and what the worst case would have said."""

    failed_runs: int
    not_promising: bool
    sensitivity: str | None = None
    sensitivity_verdict: Verdict | None = None


class GateResult(_Record):
    """The gate's record of one look of one hypothesis."""

    protocol: str
    alpha: float
    higher_is_better: bool
    look: int  # challenger runs per task (seed count) at this look
    looks_done: list[int]  # the schedule the boundaries were computed for, this look last
    planned_looks: list[int]
    is_look: bool
    last_look: bool
    next_look: int | None
    verdict: Verdict | None  # None between looks
    reasons: list[str]
    tasks: list[TaskResult]
    horizontal: HorizontalResult
    failures: FailureReport
    seed_spread: SeedSpread | None = None  # None: fewer than 2 runs a side, or a baseline that does not vary
    baseline_runs_used: int
    challenger_runs_used: int  # every challenger run at this look, failed ones included
    mde_power: float

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GateResult":
        """The record back from its JSON form (`to_json`, what the store keeps); a record that does
        not fit the model is a pydantic `ValidationError`."""
        return cls.model_validate(d)


def _f(v: float | None, digits: int = 4) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def _p(v: float | None) -> str:
    if v is None:
        return "—"
    return f"{v:.2e}" if v < 1e-3 else f"{v:.3f}"


def _signed(v: float | None, digits: int = 4) -> str:
    return "—" if v is None else f"{v:+.{digits}f}"


def _headline(r: GateResult) -> str:
    if not r.is_look:
        return f"between looks ({r.look} challenger runs): estimates and intervals only"
    return f"verdict: {r.verdict.value if r.verdict else '—'} at look {r.look} ({r.protocol})"


def _horizontal_line(r: GateResult) -> str:
    h = r.horizontal
    line = (
        f"horizontal: Δ {_signed(h.delta, 3)}σ [{_signed(h.ci_low, 3)}, {_signed(h.ci_high, 3)}], "
        f"t {_f(h.t, 2)}"
    )
    if r.is_look:
        line += f" vs boundary {_f(h.boundary, 2)}; without {h.breadth_task or '—'}: t {_f(h.breadth_t, 2)}"
    if h.pairs is not None:
        line += f"; on the paired differences of {h.pairs} seed(s)"
    return line


def direction_line(higher_is_better: bool) -> str:
    """How to read the signs: task Δ is raw (challenger − baseline), the horizontal Δ is oriented."""
    word, sign = ("higher", "positive") if higher_is_better else ("lower", "negative")
    return (f"{word} is better: a {sign} task Δ (challenger − baseline) is a gain; "
            f"the horizontal Δ is oriented so that + is better")


def _footer_lines(r: GateResult) -> list[str]:
    lines = [direction_line(r.higher_is_better), _horizontal_line(r)]
    if r.next_look is not None:
        lines.append(
            f"next look at {r.next_look} runs: detectable horizontal Δ {_f(r.horizontal.mde_next, 3)}σ "
            f"at {r.mde_power:.0%} power"
        )
    lines.append(
        f"runs used: {r.baseline_runs_used} baseline, {r.challenger_runs_used} challenger "
        f"({r.failures.failed_runs} failed)"
    )
    if r.failures.sensitivity:
        lines.append(r.failures.sensitivity)
    if r.seed_spread is not None:
        lab = (f", {_f(r.seed_spread.noisier_ratio, 2)}× the lab's earlier arms'"
               if r.seed_spread.noisier_ratio is not None else "")
        lines.append(r.seed_spread.reason if r.seed_spread.held else
                     f"seeds vary: the challenger's spread over seeds is {_f(r.seed_spread.ratio, 2)}× the baseline's{lab}")
    if r.is_look:
        lines.extend(r.reasons)
    return lines


def _columns() -> list[str]:
    return ["task", "baseline", "challenger", "Δ", "CI", "p", "q", "flag"]


def _row(t: TaskResult, is_look: bool) -> list[str]:
    flags = t.flags if is_look else [f for f in t.flags if f == "unstable"]
    flag = ", ".join(flags)
    if "unstable" in t.flags and t.welch is not None:
        flag += f" (Welch p {_p(t.welch.p)})"
    return [
        t.task,
        f"{_f(t.baseline_mean)} (n={t.baseline_runs})",
        f"{_f(t.challenger_mean)} (n={t.challenger_runs})",
        _signed(t.delta),
        f"[{_signed(t.ci_low)}, {_signed(t.ci_high)}]",
        _p(t.p),
        _p(t.q),
        flag,
    ]


def render_markdown(r: GateResult) -> str:
    """A Markdown report: headline, per-task table, horizontal line, MDE, runs, reasons."""
    out = [f"**{_headline(r)}**", "", "| " + " | ".join(_columns()) + " |", "|" + "---|" * len(_columns())]
    out += ["| " + " | ".join(_row(t, r.is_look)) + " |" for t in r.tasks]
    out.append("")
    out += [f"- {line}" for line in _footer_lines(r)]
    return "\n".join(out) + "\n"


def render_table(r: GateResult) -> Any:
    """A rich renderable (Table with the headline as title and the footer as caption)."""
    from rich.table import Table

    table = Table(title=_headline(r), caption="\n".join(_footer_lines(r)), caption_justify="left")
    for i, col in enumerate(_columns()):
        table.add_column(col, justify="left" if i in (0, 7) else "right")
    for t in r.tasks:
        row = _row(t, r.is_look)
        if r.is_look and "harm" in t.flags:
            row[0] = f"[red]{row[0]}[/red]"
        elif r.is_look and "win" in t.flags:
            row[0] = f"[green]{row[0]}[/green]"
        table.add_row(*row)
    return table


def render_text(r: GateResult, width: int = 120) -> str:
    """The rich table as plain text (for logs and tests)."""
    import io

    from rich.console import Console

    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    console.print(render_table(r))
    return console.export_text()
