"""What one loop did with its GPU, from nvidia-smi's samples and the lab's store (standard library only).

    python3 benchmarks/gpu/report.py --mode sandbox LAB SMI_CSV [--mode off LAB SMI_CSV ...] [--side-by-side]

For each mode (a lab that `autoresearch run` worked on, and `nvidia-smi --query-gpu=timestamp,index,
utilization.gpu,memory.used --format=csv,noheader -lms 500` taken while it ran), over the loop's wall
time, from the first stage's start to the last stage's end (the store's `stage_exec` rows):
- GPU busy: the share of samples with utilisation > 0, and the mean utilisation;
- runs per GPU-hour: runs finished (done or failed) ÷ the GPU-hours of that wall time;
- GPU held: the share of that wall time in which a stage (or a smoke run's stages: from the first
  one's start to the last one's end) held a GPU, and the GPU share held on average (stages'
  and smoke runs' GPU-seconds ÷ GPU-seconds of wall): the most the GPU could have been busy under the
  loop's schedule, whatever the stages did with it; the gaps in which nothing held one (the loop's
  own waits: gate, looks, smoke runs queued) with the longest;
- each executed stage's dispatch overhead: its `wall_s` less the compute its own `device ... train X.XXs`
  line reports in the stage log (what the sandbox, the fork and the imports cost it).
`--side-by-side` prints only the table of all modes, with sandboxed against unsandboxed and packed
against one GPU per stage where those modes are there.
"""

from __future__ import annotations

import argparse
import re
import sqlite3
import statistics
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

SERVED = ("cache_hit", "shared", "upstream_failed", "running")  # no compute of their own
COMPUTE = re.compile(r"^device .* train (\d+(?:\.\d+)?)s\s*$", re.M)
GAP_S = 0.05  # a shorter span with nothing on a GPU is a hand-over between stages, not a gap
SMI_TIME = "%Y/%m/%d %H:%M:%S.%f"  # nvidia-smi's timestamp, in the machine's local time


@dataclass
class Stage:
    stage: str
    run_id: int
    outcome: str
    wall_s: float
    compute_s: float | None

    @property
    def overhead_s(self) -> float | None:
        return None if self.compute_s is None else self.wall_s - self.compute_s


@dataclass
class Mode:
    name: str
    start: float | None = None
    end: float | None = None
    gpus: int = 1
    runs_finished: int = 0
    utils: list[float] = field(default_factory=list)  # the samples within [start, end]
    stages: list[Stage] = field(default_factory=list)
    nvml: tuple[int, float, float] | None = None  # the store's own sampler: samples, busy share, mean util
    held: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of each stage or smoke run's stages on a GPU
    gpu_s: float = 0.0  # their GPU-seconds (share × wall), within [start, end]

    def held_share(self) -> float | None:
        """The share of [start, end] in which something held a GPU."""
        if not self.wall_s:
            return None
        return sum(b - a for a, b in self.gaps(held=True)) / self.wall_s

    def gaps(self, held: bool = False) -> list[tuple[float, float]]:
        """The spans of [start, end] in which nothing held a GPU (or, `held`, the union of those in which
        something did)."""
        if self.start is None or self.end is None:
            return []
        spans: list[tuple[float, float]] = []
        for a, b in sorted((max(a, self.start), min(b, self.end)) for a, b in self.held):
            if b <= a:
                continue
            if spans and a <= spans[-1][1]:
                spans[-1] = (spans[-1][0], max(spans[-1][1], b))
            else:
                spans.append((a, b))
        if held:
            return spans
        edges = [self.start, *[t for span in spans for t in span], self.end]
        return [(a, b) for a, b in zip(edges[::2], edges[1::2]) if b - a >= GAP_S]

    @property
    def wall_s(self) -> float:
        return (self.end - self.start) if self.start is not None and self.end is not None else 0.0

    @property
    def runs_per_gpu_hour(self) -> float | None:
        return self.runs_finished / (self.wall_s * self.gpus / 3600) if self.wall_s > 0 else None

    @property
    def busy(self) -> float | None:
        return sum(u > 0 for u in self.utils) / len(self.utils) if self.utils else None

    @property
    def mean_util(self) -> float | None:
        return statistics.fmean(self.utils) if self.utils else None

    def measured(self) -> list[Stage]:
        return [s for s in self.stages if s.overhead_s is not None]

    def median(self, what: str) -> float | None:
        values = [getattr(s, what) for s in self.measured()]
        return statistics.median(values) if values else None


def read_smi(path: Path) -> list[tuple[float, str, float]]:
    """(UNIX time, GPU index, utilisation %) per sample; lines that are not samples are skipped."""
    samples = []
    for line in path.read_text(errors="replace").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) not in (3, 4):  # timestamp[, index], utilization.gpu, memory.used
            continue
        gpu, util = (parts[1], parts[2]) if len(parts) == 4 else ("0", parts[1])
        try:
            samples.append((datetime.strptime(parts[0], SMI_TIME).timestamp(), gpu, float(util.rstrip(" %"))))
        except ValueError:
            continue
    return samples


def stage_compute(log_path: str | None) -> float | None:
    """The seconds the stage's own `device ... train X.XXs` line reports; None without one."""
    try:
        found = COMPUTE.findall(Path(log_path).read_text(errors="replace")) if log_path else []
    except OSError:
        return None
    return float(found[-1]) if found else None


def measure(name: str, lab: Path, smi: Path) -> Mode:
    mode = Mode(name)
    db = sqlite3.connect(f"file:{lab / 'runs' / 'autoresearch.db'}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT stage, run_id, outcome, wall_s, started_at, finished_at, log_path, gpu_s FROM stage_exec "
                          f"WHERE outcome NOT IN ({','.join('?' * len(SERVED))}) AND finished_at IS NOT NULL "
                          "ORDER BY started_at, id", SERVED).fetchall()
        mode.runs_finished = db.execute("SELECT COUNT(*) FROM run WHERE status IN ('done', 'failed')").fetchone()[0]
        try:
            samples, busy, util_sum = db.execute("SELECT SUM(samples), SUM(busy), SUM(util_sum) FROM gpu_usage").fetchone()
            if samples:
                mode.nvml = (samples, busy / samples, util_sum / samples)
        except sqlite3.OperationalError:  # a store from before the GPU sampler
            pass
        try:
            smokes = db.execute("SELECT gpu_from, gpu_to, gpu_s FROM smoke_exec "
                                "WHERE gpu_s > 0 AND gpu_from IS NOT NULL").fetchall()
        except sqlite3.OperationalError:  # a store from before smoke runs were booked
            smokes = []
    finally:
        db.close()
    for stage, run_id, outcome, wall_s, _, _, log_path, _ in rows:
        mode.stages.append(Stage(stage, run_id, outcome, wall_s, stage_compute(log_path)))
    if rows:
        mode.start, mode.end = min(r[4] for r in rows), max(r[5] for r in rows)
        # a stage held its GPU for its wall time up to its end (its `started_at` is when it was submitted)
        on_gpu = [(r[5] - r[3], r[5], r[7]) for r in rows if r[7]] + list(smokes)
        mode.held = [(a, b) for a, b, _ in on_gpu]
        for a, b, g in on_gpu:  # the part of each within the loop's wall time
            inside = max(0.0, min(b, mode.end) - max(a, mode.start))
            mode.gpu_s += g * inside / (b - a) if b > a else 0.0
        samples = read_smi(smi) if smi.is_file() else []
        mode.gpus = max(1, len({gpu for _, gpu, _ in samples}))
        mode.utils = [u for t, _, u in samples if mode.start <= t <= mode.end]
    return mode


def fmt(value: float | None, spec: str, unit: str = "") -> str:
    """`value` formatted by `spec`, or n/a in the same width."""
    if value is None:
        return "n/a".rjust(int(re.match(r"[<>^]?(\d*)", spec).group(1) or 0))  # type: ignore[union-attr]
    return f"{value:{spec}}{unit}"


def pct(share: float | None) -> float | None:
    return None if share is None else 100 * share


def print_mode(mode: Mode) -> None:
    print(f"== {mode.name}")
    if not mode.stages:
        print("no stage ran to its end")
        return
    print(f"loop wall {mode.wall_s:.1f} s (first stage start to last stage end), {mode.gpus} GPU(s)")
    print(f"runs finished {mode.runs_finished}: {fmt(mode.runs_per_gpu_hour, '.1f')} runs per GPU-hour")
    print(f"GPU busy {fmt(pct(mode.busy), '.1f', ' %')} of {len(mode.utils)} samples, "
          f"mean utilisation {fmt(mode.mean_util, '.1f', ' %')}")
    held = mode.held_share()
    gaps = mode.gaps()
    longest = max(gaps, key=lambda g: g[1] - g[0]) if gaps else None
    print(f"GPU held {fmt(pct(held), '.1f', ' %')} of the wall time, "
          f"{fmt(mode.gpu_s / (mode.wall_s * mode.gpus) if mode.wall_s else None, '.2f')} of its GPU(s) on average; "
          f"nothing held one for "
          f"{sum(b - a for a, b in gaps):.1f} s in {len(gaps)} gap(s) of {GAP_S:g} s or more"
          + (f", the longest {longest[1] - longest[0]:.1f} s from +{longest[0] - mode.start:.1f} s" if longest else ""))
    if mode.nvml:
        samples, busy, util = mode.nvml
        print(f"NVML sampler (store): busy {100 * busy:.1f} % of {samples} samples, mean utilisation {util:.1f} %")
    measured = mode.measured()
    overhead = sum(s.overhead_s or 0.0 for s in measured)
    share = overhead / sum(s.wall_s for s in measured) if measured else None
    print(f"stage dispatch overhead (wall - own compute), {len(measured)} of {len(mode.stages)} executed stages: "
          f"median {fmt(mode.median('overhead_s'), '.2f', ' s')}, {fmt(pct(share), '.1f', ' %')} of their wall")
    print(f"  {'stage':<10} {'run':>5} {'outcome':<8} {'wall_s':>8} {'compute_s':>9} {'overhead_s':>10}")
    for s in mode.stages:
        print(f"  {s.stage:<10} {s.run_id:>5} {s.outcome:<8} {s.wall_s:>8.2f} {fmt(s.compute_s, '>9.2f')} "
              f"{fmt(s.overhead_s, '>10.2f')}")


def print_side_by_side(modes: list[Mode]) -> None:
    print(f"{'mode':<12} {'runs':>5} {'wall_s':>7} {'runs/GPU-h':>10} {'held %':>7} {'busy %':>7} {'util %':>7} "
          f"{'stages':>6} {'med wall':>8} {'med compute':>11} {'med overhead':>12}")
    for m in modes:
        print(f"{m.name:<12} {m.runs_finished:>5} {m.wall_s:>7.1f} {fmt(m.runs_per_gpu_hour, '>10.1f')} "
              f"{fmt(pct(m.held_share()), '>7.1f')} {fmt(pct(m.busy), '>7.1f')} {fmt(m.mean_util, '>7.1f')} {len(m.measured()):>6} "
              f"{fmt(m.median('wall_s'), '>8.2f')} {fmt(m.median('compute_s'), '>11.2f')} "
              f"{fmt(m.median('overhead_s'), '>12.2f')}")
    by = {m.name: m for m in modes}
    for a, b in (("sandbox", "off"), ("packed", "packed-off")):  # what the sandbox costs a stage
        if a in by and b in by:
            mine, theirs, wall = by[a].median("overhead_s"), by[b].median("overhead_s"), by[b].median("wall_s")
            if mine is not None and theirs is not None and wall:
                print(f"{a} vs {b}: median stage overhead {mine - theirs:+.2f} s, "
                      f"{100 * (mine - theirs) / wall:+.1f} % of {b}'s median stage wall")
    for a, b in (("packed", "sandbox"), ("packed-off", "off")):  # what packing buys
        if a in by and b in by:
            mine, theirs = by[a].runs_per_gpu_hour, by[b].runs_per_gpu_hour
            if mine and theirs:
                print(f"{a} vs {b}: runs per GPU-hour x{mine / theirs:.2f}, GPU busy "
                      f"{fmt(pct(by[a].busy), '.1f', ' %')} vs {fmt(pct(by[b].busy), '.1f', ' %')}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", nargs=3, action="append", required=True, metavar=("NAME", "LAB", "SMI_CSV"))
    parser.add_argument("--side-by-side", action="store_true", help="only the table of all modes")
    args = parser.parse_args(argv)
    modes = [measure(name, Path(lab), Path(smi)) for name, lab, smi in args.mode]
    if not args.side_by_side:
        for mode in modes:
            print_mode(mode)
    if args.side_by_side or len(modes) > 1:
        print_side_by_side(modes)


if __name__ == "__main__":
    main()
