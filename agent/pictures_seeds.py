"""The hypothesis page's runs-by-seed picture (`/files/ID.seeds.png`, drawn from the store on request):
per task, the baseline's and the challenger's runs on the seeds they share, pairs joined, the looks
dashed, each arm's mean ± its t interval."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any

from agent.pictures import new_figure
from agent.verdicts import verdicts

SEEDS_SUFFIX = ".seeds.png"


@dataclass
class SeedTask:
    """One task of the per-seed view: each arm's metric by seed (None: a failed run)."""

    task: str
    baseline: dict[int, float | None]
    challenger: dict[int, float | None]


@dataclass
class SeedView:
    title: str
    metric: str
    higher_is_better: bool
    level: float  # of the per-arm intervals (the gate's 1 − 2α)
    block_start: int  # seed k is drawn at x = k − block_start
    looks: list[int]  # challenger seed counts where looks were taken
    planned: list[int]  # the lab's look schedule
    tasks: list[SeedTask]


def seed_view(lab: Any, store: Any, h: Any) -> SeedView | None:
    """The runs of a hypothesis and of its baseline by seed, on the seed block they share (a
    promoted challenger's later runs, and its baseline's runs as a challenger before, lie in other
    blocks and are left out); None before its commit exists."""
    from pipeline.api import Experiment, generation, seed_block

    if not (h.commit and h.base_commit):
        return None
    tasks = lab.tasks()
    block = seed_block(generation(str(lab.root), h.base_commit))
    exp = Experiment(lab, store)
    base = exp.results(h.base_commit, tasks)  # both are full shas in the records
    chal = exp.results(h.commit, tasks)

    recs = verdicts(store, h.id)
    alpha = float((recs[-1].alpha if recs else None) or lab.config.gate.alpha)
    looks = sorted({int(r.look or 0) for r in recs if r.is_look} - {0})
    rows = [SeedTask(t, {s: v for s, v in base.get(t, {}).items() if s in block},
                     {s: v for s, v in chal.get(t, {}).items() if s in block}) for t in tasks]
    title = f"#{h.id} {h.title}"[:90].replace("$", r"\$")  # a branch-written title is text, never mathtext
    return SeedView(title, lab.config.benchmark.metric, lab.config.benchmark.higher_is_better,
                    1 - 2 * alpha, block.start, looks, list(lab.config.gate.looks), rows)


def mean_ci(values: list[float], level: float) -> tuple[float, float | None, float | None]:
    """The mean and its two-sided t interval at `level` (no interval under 2 values)."""

    n = len(values)
    m = sum(values) / n
    if n < 2:
        return m, None, None
    from scipy.stats import t as student

    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))
    half = float(student.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
    return m, m - half, m + half


def draw_seeds(view: SeedView) -> bytes:
    """Per task: each seed's baseline (grey) and challenger (blue) run, the pair joined by a line,
    dashed lines at the looks' seed counts, and each arm's mean ± interval at the right. PNG bytes."""

    n_tasks = max(len(view.tasks), 1)
    cols = min(n_tasks, 2)
    rows = (n_tasks + cols - 1) // cols
    fig = new_figure(4.6 * cols + 0.4, 3.1 * rows + 0.7)
    colors = {"baseline": "#7f7f7f", "challenger": "#1f77b4"}
    for i, st in enumerate(view.tasks):
        ax = fig.add_subplot(rows, cols, i + 1)
        seeds = sorted(set(st.baseline) | set(st.challenger))
        width = max([s - view.block_start + 1 for s in seeds] + view.looks + [1])
        failed = 0
        for s in seeds:
            x = s - view.block_start
            b, c = st.baseline.get(s), st.challenger.get(s)
            failed += (s in st.baseline and b is None) + (s in st.challenger and c is None)
            if b is not None and c is not None:
                ax.plot([x - 0.12, x + 0.12], [b, c], color="#bbbbbb", lw=1, zorder=1)
            if b is not None:
                ax.scatter([x - 0.12], [b], color=colors["baseline"], s=22, zorder=2,
                           label="baseline" if "baseline" not in ax.get_legend_handles_labels()[1] else None)
            if c is not None:
                ax.scatter([x + 0.12], [c], color=colors["challenger"], s=22, zorder=2,
                           label="challenger" if "challenger" not in ax.get_legend_handles_labels()[1] else None)
        for n in view.looks:
            ax.axvline(n - 0.5, color="#d62728", lw=1, ls="--", zorder=0)
            ax.annotate(f"look {n}", xy=(n - 0.5, 1.0), xycoords=("data", "axes fraction"), xytext=(2, -10),
                        textcoords="offset points", fontsize=7, color="#d62728")
        for j, (arm, vals) in enumerate((("baseline", st.baseline), ("challenger", st.challenger))):
            ok = [v for v in vals.values() if v is not None]
            if not ok:
                continue
            m, lo, hi = mean_ci(ok, view.level)
            x = width + 0.2 + 0.35 * j
            err = [[m - lo], [hi - m]] if lo is not None else None
            ax.errorbar([x], [m], yerr=err, fmt="D", color=colors[arm], capsize=3, ms=5, zorder=3)
        ax.set_xlim(-0.6, width + 1.0)
        ticks = list(range(width))
        ax.set_xticks(ticks + [width + 0.37], [str(view.block_start + k) for k in ticks] + ["mean"], fontsize=7)
        ax.set_title(st.task + (f" ({failed} failed runs)" if failed else ""), fontsize=9, loc="left")
        ax.set_xlabel("seed", fontsize=8)
        ax.set_ylabel(f"{view.metric} ({'higher' if view.higher_is_better else 'lower'} is better)", fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(alpha=0.3)
        if i == 0:
            ax.legend(fontsize=7, loc="best")
    fig.suptitle(f"{view.title}\nruns by seed, pairs joined; dashed: looks; right: mean ± {view.level:.0%} t interval",
                 fontsize=9, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
