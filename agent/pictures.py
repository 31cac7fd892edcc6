"""PNG pictures beside the summaries: the lab's progress chart and one forest plot per hypothesis.

Both are drawn from the gate's stored records only, like every number in a summary.

- `runs/summaries/progress.png`: x is the hypothesis order (ids, in the order they were
  proposed; hypotheses overlap in time, so wall-clock time would scatter them); y is the mean
  over tasks of the metric. The line is the level of the baseline each hypothesis was measured
  against (the mean of the baseline runs' per-task means in its gate record): it steps up after a
  promotion (down, for a lower-is-better metric; the y label says which). Each hypothesis is a dot
  at its baseline's level plus its mean per-task Δ, coloured by decision; a hypothesis rejected
  before any run is an × on the line. Metric units rather than the gate's horizontal σ units
  because σ-unit deltas are relative to each hypothesis's own baseline and do not chain into one
  axis.
- `runs/summaries/<id>.forest.png`: per task, Δ (challenger − baseline) with the gate's interval
  (level 1 − 2α; repeated intervals under the sequential protocol), coloured by the gate's flags;
  below it the horizontal Δ in σ units with its interval. Task Δ is raw, so for a lower-is-better
  metric an improvement lies left of 0, while the horizontal Δ is oriented (+ = better, always
  right): the axis labels say which side is better.

matplotlib is imported inside the drawing functions (object API on the Agg canvas, no pyplot
state): the CLI starts without it and drawing is safe from any thread.

`Painter` draws them in a process of its own, for the loop: matplotlib's rendering holds the GIL,
and in the loop's process it held off the driver's thread (`benchmarks/scale.py`, 32 slots on
PostgreSQL: 85.5 % slot utilisation drawing in the loop's thread, 95.5 % not drawing).
"""

from __future__ import annotations

import bisect
import logging
import math
import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.lifecycle import Decision, Status
from agent.progress import split_progress
from agent.verdicts import VERDICT

log = logging.getLogger("autoresearch.pictures")

PROGRESS_NAME = "progress.png"
POINTS_READ = 1000  # verdicts read at a time for the chart
PROGRESS_TAGS = 20  # champions named on the progress chart: the latest

DECISION_COLORS = {
    "promote": "#2ca02c",
    "hold": "#ff7f0e",
    "escalate": "#1f77b4",
    "refine": "#9467bd",
    "abandon": "#7f7f7f",
    "reject": "#d62728",
    "in flight": "#17becf",
}
FLAG_COLORS = {"win": "#2ca02c", "harm": "#d62728"}


def summaries_dir(lab: Any) -> Path:
    return lab.state / "summaries"


def forest_path(lab: Any, hid: int) -> Path:
    return summaries_dir(lab) / f"{hid}.forest.png"


def progress_path(lab: Any) -> Path:
    return summaries_dir(lab) / PROGRESS_NAME


# ----------------------------------------------------------------------------- data

@dataclass
class Point:
    """One hypothesis on the progress chart."""

    id: int
    title: str
    decision: str  # a DECISION_COLORS key
    verdict: str | None
    base: float | None  # its baseline's level: mean over tasks of the baseline runs' mean
    level: float | None  # base + mean per-task Δ
    horizontal_delta: float | None  # the gate's horizontal Δ, σ units
    horizontal_ci: tuple[float | None, float | None]
    tag: str | None
    finished_at: float | None


def _decision(h: Any) -> str:
    """The decision so far: the chart is redrawn while a summary is written, before status `done`."""
    if h.status == Status.HELD:
        return "hold"
    return h.decision if h.decision in DECISION_COLORS else "in flight"


_DONE_POINTS: dict[tuple[str, int, float | None], Point] = {}  # (store, id, finished) → a finished one's point


def progress_points(store: Any, records: Any, briefs: list[Any] | None = None) -> list[Point]:
    """Every proposed hypothesis, in order, with its levels from its latest gate record. A finished
    hypothesis's point does not change: it is kept (`_DONE_POINTS`), and a long-running process (the
    loop, the review page) reads the verdicts of the others only, POINTS_READ at a time (a year's
    records at once held 600 MB). `briefs`: `records.briefs()` where the caller read them already."""

    where = f"{store.url}#{store.schema}"
    briefs = [h for h in (records.briefs() if briefs is None else briefs) if h.title]  # untitled: not proposed yet
    missing = [h for h in briefs if (where, h.id, h.finished_at) not in _DONE_POINTS]
    if len(_DONE_POINTS) + len(missing) > 200_000:  # years of several labs in one process: start again
        _DONE_POINTS.clear()
        missing = briefs
    made: dict[int, Point] = {}
    for i in range(0, len(missing), POINTS_READ):
        chunk = missing[i:i + POINTS_READ]
        recs = store.latest_gate_records(VERDICT, [str(h.id) for h in chunk])
        for h in chunk:
            rec = recs.get(str(h.id))
            made[h.id] = _point(h, rec.payload if rec is not None else None)
            if h.status == Status.DONE and h.finished_at is not None:
                _DONE_POINTS[(where, h.id, h.finished_at)] = made[h.id]
    return [made[h.id] if h.id in made else _DONE_POINTS[(where, h.id, h.finished_at)] for h in briefs]


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def _point(h: Any, verdict: dict[str, Any] | None) -> Point:
    """A hypothesis's point from its latest verdict's record as stored (`GateResult.to_json`): the
    baseline's level (mean over tasks of the baseline means), its own (plus the mean Δ), the
    horizontal Δ and interval; read from the JSON, not validated into a `GateResult` (a year's are
    thousands)."""
    base = level = hd = None
    ci: tuple[float | None, float | None] = (None, None)
    if verdict is not None:
        pairs = [(b, d) for t in verdict.get("tasks") or []
                 if (b := _num(t.get("baseline_mean"))) is not None and (d := _num(t.get("delta"))) is not None]
        if pairs:
            base = sum(b for b, _ in pairs) / len(pairs)
            level = base + sum(d for _, d in pairs) / len(pairs)
        hor = verdict.get("horizontal") or {}
        hd, ci = _num(hor.get("delta")), (_num(hor.get("ci_low")), _num(hor.get("ci_high")))
    return Point(h.id, h.title, _decision(h), h.verdict, base, level, hd, ci, h.promoted_tag, h.finished_at)


# ----------------------------------------------------------------------------- drawing

def new_figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fig.savefig(tmp, format="png")
    tmp.replace(path)
    return path


def _fmt(v: float | None, digits: int = 4, signed: bool = True) -> str:
    if v is None:
        return "—"
    return f"{v:+.{digits}f}" if signed else f"{v:.{digits}f}"


def _p(v: float | None) -> str:
    return "—" if v is None else (f"{v:.1e}" if v < 1e-3 else f"{v:.3f}")


def forest_xlabel(metric: str, higher_is_better: bool, level: float, kind: str = "") -> str:
    """The task panel's x label: raw Δ, and on which side of 0 an improvement lies."""
    better = "better →" if higher_is_better else "← better"
    return (f"Δ {metric} (challenger − baseline), {level:.0%} {kind}interval; "
            f"{'higher' if higher_is_better else 'lower'} is better ({better})")


HORIZONTAL_XLABEL = "horizontal Δ in σ units, oriented: + is better (per seed, trimmed mean over tasks of metric ÷ task σ)"


def progress_ylabel(metric: str, higher_is_better: bool) -> str:
    return f"mean {metric} over tasks ({'higher' if higher_is_better else 'lower'} is better)"


def draw_forest(result: Any, path: Path, title: str, metric: str = "metric") -> Path:
    """The per-task Δ with intervals of one gate record, and the horizontal Δ below it."""
    from matplotlib.ticker import MaxNLocator

    tasks = list(result.tasks)
    # laid out in inches so the panels keep their spacing whatever the number of tasks
    top, rows, gap, strip, bottom = 0.6, 0.42 * max(len(tasks), 1) + 0.3, 0.8, 0.45, 0.55
    height = top + rows + gap + strip + bottom
    fig = new_figure(8.0, height)
    left, width = 0.2, 0.52
    ax = fig.add_axes((left, (bottom + strip + gap) / height, width, rows / height))
    ys = list(range(len(tasks)))[::-1]
    for y, t in zip(ys, tasks):
        flags = t.flags if result.is_look else [f for f in t.flags if f == "unstable"]
        color = next((FLAG_COLORS[f] for f in ("harm", "win") if f in flags), "#333333")
        if t.delta is None:
            ax.text(0, y, "no result (all runs failed)", va="center", ha="center", fontsize=8, color="#d62728")
            continue
        lo = t.delta - t.ci_low if t.ci_low is not None else 0
        hi = t.ci_high - t.delta if t.ci_high is not None else 0
        ax.errorbar([t.delta], [y], xerr=[[lo], [hi]], fmt="o", color=color, ecolor=color, capsize=3, ms=5)
        note = f"Δ {_fmt(t.delta)}  p {_p(t.p)}  q {_p(t.q)}" + (f"  {', '.join(flags)}" if flags else "")
        ax.annotate(note, xy=(1.01, y), xycoords=("axes fraction", "data"), va="center", fontsize=7.5, color=color)
    ax.axvline(0, color="#999999", lw=1, ls="--")
    ax.set_yticks(ys, [t.task for t in tasks])
    ax.set_ylim(-0.7, len(tasks) - 0.3)
    level = 1 - 2 * result.alpha
    kind = "repeated " if result.protocol == "sequential" else ""
    ax.set_xlabel(forest_xlabel(metric, result.higher_is_better, level, kind))
    ax.xaxis.set_major_locator(MaxNLocator(nbins=6))
    head = (f"verdict {result.verdict.value if result.verdict else '—'} at look {result.look}" if result.is_look
            else f"between looks ({result.look} challenger runs): estimates only")
    ax.set_title(f"{title}\n{head}", fontsize=10, loc="left")

    hz = result.horizontal
    ax2 = fig.add_axes((left, bottom / height, width, strip / height))
    if hz.delta is not None:
        lo = hz.delta - hz.ci_low if hz.ci_low is not None else 0
        hi = hz.ci_high - hz.delta if hz.ci_high is not None else 0
        ax2.errorbar([hz.delta], [0], xerr=[[lo], [hi]], fmt="s", color="#1f77b4", capsize=3, ms=5)
        ax2.annotate(f"Δ {_fmt(hz.delta, 3)}σ  t {_fmt(hz.t, 2, False)}", xy=(1.01, 0),
                     xycoords=("axes fraction", "data"), va="center", fontsize=7.5)
    ax2.axvline(0, color="#999999", lw=1, ls="--")
    ax2.set_yticks([0], ["horizontal"])
    ax2.set_ylim(-1, 1)
    ax2.set_xlabel(HORIZONTAL_XLABEL)
    ax2.xaxis.set_major_locator(MaxNLocator(nbins=6))
    return _save(fig, path)


def draw_progress(points: list[Point], path: Path, lab_name: str, metric: str, higher_is_better: bool,
                  splits: dict | None = None) -> Path:
    """The baseline's level across hypotheses, each hypothesis a dot coloured by decision; below it,
    with a holdout and at least one champion, the cumulative gain on the gate split and on the holdout."""
    champions = (splits or {}).get("points", [])
    two = len(champions) >= 2
    fig = new_figure(9.0, 7.2 if two else 4.8)
    ax = fig.add_subplot(2, 1, 1) if two else fig.add_subplot(1, 1, 1)
    measured = [p for p in points if p.base is not None]
    xs, base = [], []
    current = None
    for p in points:
        current = p.base if p.base is not None else current
        if current is not None:
            xs.append(p.id)
            base.append(current)
    if xs:  # steps half-way between hypotheses, drawn to both edges
        ax.step([xs[0] - 0.6, *xs, xs[-1] + 0.6], [base[0], *base, base[-1]], where="mid", color="#444444", lw=1.5,
                label="baseline", zorder=1)
    seen: set[str] = set()
    groups: dict[tuple[str, str], tuple[list[float], list[float]]] = {}  # one scatter per (decision, marker)
    steps = sorted(zip(xs, base))  # the baseline's level at each id: an unmeasured one is drawn on it
    step_ids = [x for x, _ in steps]
    tagged = [p.id for p in points if p.level is not None and p.tag]
    named = set(tagged[-PROGRESS_TAGS:])  # a year's champions' names would cover the chart: the latest
    for p in points:
        seen.add(p.decision)
        if p.level is None:
            i = bisect.bisect_right(step_ids, p.id) - 1
            y = steps[i][1] if i >= 0 else (measured[0].base if measured else 0.0)
            marker, level = "x", y
        else:
            marker, level = ("*" if p.decision == Decision.PROMOTE else "o"), p.level
            if p.tag and p.id in named:
                ax.annotate(p.tag, xy=(p.id, p.level), xytext=(4, 6), textcoords="offset points", fontsize=8)
        gx, gy = groups.setdefault((p.decision, marker), ([], []))
        gx.append(p.id)
        gy.append(level)
    labelled: set[str] = set()
    for (decision, marker), (gx, gy) in groups.items():
        color = DECISION_COLORS[decision]
        label = decision if decision not in labelled else None
        labelled.add(decision)
        if marker == "x":
            ax.scatter(gx, gy, marker="x", color=color, s=60, linewidths=2.5, label=label, zorder=3)
        else:
            ax.scatter(gx, gy, marker=marker, color=color, s=110 if marker == "*" else 40,
                       edgecolors="black" if marker == "*" else "none", linewidths=0.5, label=label, zorder=3)
    promoted = sum(p.decision == Decision.PROMOTE for p in points)
    ax.set_title(f"{lab_name}: {len(points)} hypotheses, {promoted} promoted", fontsize=10, loc="left")
    ax.set_xlabel("hypothesis (in the order proposed)")
    ax.set_ylabel(progress_ylabel(metric, higher_is_better))
    if points:
        ids = [p.id for p in points]
        ax.set_xlim(min(ids) - 0.6, max(ids) + 0.6)
        if len(ids) <= 30:
            ax.set_xticks(ids)
    ax.grid(alpha=0.3)
    if seen or xs:
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    if two:
        _draw_splits(fig.add_subplot(2, 1, 2), champions, metric)
        fig.subplots_adjust(left=0.1, right=0.82, top=0.94, bottom=0.08, hspace=0.45)
    else:
        fig.subplots_adjust(left=0.1, right=0.82, top=0.9, bottom=0.12)
    return _save(fig, path)


def _draw_splits(ax: Any, champions: list[dict], metric: str) -> None:
    """Cumulative gain of each champion over the first baseline, on its own runs: gate split vs holdout."""
    xs = list(range(len(champions)))
    ax.plot(xs, [c["gate_gain"] for c in champions], marker="o", color="#1f77b4", label="gate split")
    hold = [(x, c["holdout_gain"]) for x, c in zip(xs, champions) if c["holdout_gain"] is not None]
    if hold:
        ax.plot([x for x, _ in hold], [y for _, y in hold], marker="s", color="#d62728", label="holdout")
    ax.axhline(0.0, color="#888888", lw=0.8)
    ax.set_xticks(xs)
    ax.set_xticklabels([c["label"].removeprefix("baseline/") for c in champions], fontsize=8)
    ax.set_xlabel("champion (each measured on its own runs)")
    ax.set_ylabel(f"gain in {metric} since start\n(+ is better)", fontsize=9)
    ax.set_title("test-reuse check: gain on the split the gate decides on vs on a sealed holdout it never sees",
                 fontsize=9, loc="left")
    ax.grid(alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)


# ----------------------------------------------------------------------------- lab-level entry points

def write_forest(lab: Any, hid: int, title: str, result: Any) -> Path:
    return draw_forest(result, forest_path(lab, hid), f"#{hid} {title}"[:90], lab.config.benchmark.metric)


def write_progress(lab: Any, store: Any, records: Any, splits: dict | None = None,
                   points: list[Point] | None = None) -> Path:
    """The progress chart (`draw_progress`), from the caller's `splits` and `points` where it has them."""
    bench = lab.config.benchmark
    if splits is None:
        splits = split_progress(lab, store, records)
    return draw_progress(progress_points(store, records) if points is None else points, progress_path(lab),
                         lab.config.lab.name, bench.metric, bench.higher_is_better, splits)


# ----------------------------------------------------------------------------- in a process of its own

def _paint_forest(result: dict[str, Any], path: str, title: str, metric: str) -> str:
    from pipeline.api import GateResult

    return str(draw_forest(GateResult.from_dict(result), Path(path), title, metric))


def _paint_progress(points: list[Point], path: str, lab_name: str, metric: str, higher_is_better: bool,
                    splits: dict | None) -> str:
    return str(draw_progress(points, Path(path), lab_name, metric, higher_is_better, splits))


def _worker_start() -> None:
    """The painter's worker yields the CPU to the stages and the driver (a picture may come late)."""
    os.nice(19)


class Painter:
    """The loop's pictures, drawn in order by one worker process (spawned at the first picture, so
    nothing of the loop's threads is forked; it imports matplotlib once). What a picture shows is
    read here, from the store, when it is asked for; only the drawing is the worker's. A picture
    that fails is logged; a worker that died is started again at the next picture, and the one it
    was drawing is drawn here instead. `flush` waits for what was asked (the loop's `close` does)."""

    def __init__(self) -> None:
        self._pool: Any = None
        self._pending: list[tuple[Any, Any, tuple[Any, ...]]] = []  # (future, function, arguments)
        self._lock = threading.Lock()

    # the module's `write_forest` and `write_progress`, drawn by the worker: a caller takes either
    def write_forest(self, lab: Any, hid: int, title: str, result: Any) -> Path:
        path = forest_path(lab, hid)
        self._submit(_paint_forest, result.to_json(), str(path), f"#{hid} {title}"[:90], lab.config.benchmark.metric)
        return path

    def write_progress(self, lab: Any, store: Any, records: Any) -> Path:

        bench, path = lab.config.benchmark, progress_path(lab)
        self._submit(_paint_progress, progress_points(store, records), str(path), lab.config.lab.name, bench.metric,
                     bench.higher_is_better, split_progress(lab, store, records))
        return path

    def _submit(self, fn: Any, *args: Any) -> None:

        with self._lock:
            self._reap()
            try:
                if self._pool is None:
                    self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                     initializer=_worker_start)
                self._pending.append((self._pool.submit(fn, *args), fn, args))
                return
            except (BrokenProcessPool, RuntimeError, OSError) as e:  # the worker died, or cannot start
                log.warning("the pictures' worker is gone (%s); drawing here", e)
                self._pool = None
        fn(*args)

    def _reap(self, wait_s: float = 0.0) -> None:
        """Say what failed among the pictures asked for; draw here those a dead worker took with it;
        keep those not done yet."""

        if wait_s and self._pending:
            wait([f for f, _, _ in self._pending], timeout=wait_s)
        left = []
        for f, fn, args in self._pending:
            if not f.done():
                left.append((f, fn, args))
                continue
            e = f.exception()
            if isinstance(e, BrokenProcessPool):
                if self._pool is not None:
                    self._pool.shutdown(wait=False)
                    self._pool = None  # started again at the next picture
                try:
                    fn(*args)
                except Exception as again:
                    log.warning("a picture was not drawn: %s: %s", type(again).__name__, again)
            elif e is not None:
                log.warning("a picture was not drawn: %s: %s", type(e).__name__, e)
        self._pending = left

    def flush(self, timeout_s: float = 60.0) -> None:
        with self._lock:
            self._reap(timeout_s)

    def close(self, timeout_s: float = 60.0) -> None:
        self.flush(timeout_s)
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
                self._pool = None
