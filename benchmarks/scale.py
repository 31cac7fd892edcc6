"""The loop at cluster scale on one small machine (issue 22): the simulated lab at 8, 32 and 64 slots.

    .venv/bin/python benchmarks/scale.py [--slots 8 32 64] [--executor local ray] [--db sqlite postgresql]
        [--stage-s 2] [--minutes 3] [--out benchmarks/results/scale.txt]

Each (executor, store, slots) cell is one real `autoresearch run` loop, in this process: a fresh lab
from the `sim` template (`autoresearch init --harness sim`: one stage that sleeps `--stage-s` and
reports a planted metric, 8 tasks, the paired gate, looks 1/2/5/10), a few hundred human seeds each
adding one `effect_<n>.toml` with its true effect (the prior below), the offline policy,
`[agent] max_in_flight` unset (derived from the slots), the sandbox on, smoke runs on. The store is
SQLite in the lab or a fresh PostgreSQL database on 127.0.0.1:5432 (dropped after); Ray is a
`ray start --head --num-cpus <max slots>` node started here (RAY_AUTH_MODE=disabled) and stopped by
its pids. The loop runs for `--minutes`, then stops as at a time budget.

Measured, over the window from the first stage's start to the loop's stop:
- slot utilisation: the slot-seconds stages were executing ÷ (slots × window); also from the first
  moment every slot was busy (`steady`: excludes the warm workers' start, which on Ray at 64 slots
  is a minute of this machine's 2 cores);
- hypotheses decided per hour (decided in the window ÷ its length);
- the driver's CPU per run (`drv/run`): the CPU time of the driver's thread (claiming, planning,
  dispatching, polling, caching, scoring, recording: `agent.loop.DriverThread`) ÷ runs finished;
  and `all/run`: this whole process's user+system CPU (the driver, and the loop's thread with the
  graph, the gate, summaries and pictures, smoke runs' bookkeeping; not the warm workers or the
  stages, which are other processes) ÷ runs finished;
- the store's latency: every call of a public `Store` method, timed in this process; p50/p99/max.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # support.ray_cluster: the tests' Ray cluster

# (share, effects in σ) of the seeded hypotheses: mostly nothing, some gains, some harms
PRIOR = ((0.70, (0.0,)), (0.15, (0.5, 1.0, 2.0)), (0.10, (-0.5, -1.0)), (0.05, ("one_task",)))
PG_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def effect_file(rng: random.Random, n: int) -> tuple[str, str]:
    u, acc = rng.random(), 0.0
    for share, sizes in PRIOR:
        acc += share
        if u < acc:
            break
    size = rng.choice(sizes)
    if size == "one_task":
        return f"h{n}: t{rng.randint(1, 8)} +2σ", f"effect = 0.0\n[task]\nt{rng.randint(1, 8)} = 2.0\n"
    return f"h{n}: {size:+g}σ", f"effect = {size}\n"


def make_lab(root: Path, stage_s: float) -> Path:
    import git

    from agent.labinit import init_lab

    init_lab(root, harness="sim", suite="sim")
    research = root / "research.toml"
    text = research.read_text()
    assert "--sleep 2 " in text
    research.write_text(text.replace("--sleep 2 ", f"--sleep {stage_s:g} "))
    repo = git.Repo(root)
    repo.git.commit("-qam", f"stage sleeps {stage_s:g} s", "--allow-empty")
    repo.git.branch("-f", "autoresearch/baseline", "HEAD")
    return root


def seed(root: Path, db: str | None, n: int) -> None:
    """`n` human seeds, as `autoresearch seed --file h<i>.json` makes them (one store, not n CLI starts)."""
    from agent.records import Hypothesis, Records
    from agent.workspace import FileEdit
    from pipeline.lab import load_lab
    from pipeline.experiment import open_store

    lab = load_lab(root)
    store = open_store(lab, db)
    rec = Records(store)
    rng = random.Random(1234)
    for i in range(1, n + 1):
        title, content = effect_file(rng, i)
        edit = FileEdit.from_dict({"path": f"effect_h{i}.toml", "content": content})
        rec.add(Hypothesis(origin="human", priority=10, status="queued", title=title, rationale="planted",
                           expected_effect="as planted", expected_tasks=lab.tasks(), plan=[edit.to_dict()]))
    store.engine.dispose()


class StoreTimer:
    """Every public method of `Store`, timed (wall) in this process while installed."""

    def __init__(self) -> None:
        from pipeline.store import Store

        import inspect

        self.cls, self.saved, self.times = Store, {}, []
        self.cpu: dict[tuple[str, str], float] = {}  # (thread, method) -> CPU seconds spent in its calls
        self.lock = threading.Lock()
        for name in dir(Store):  # its own methods and its mixins' (queue, cache, reads)
            fn = inspect.getattr_static(Store, name)
            if name.startswith("_") or not inspect.isfunction(fn):
                continue
            self.saved[name] = vars(Store).get(name)
            setattr(Store, name, self._wrap(name, fn))

    def _wrap(self, name: str, fn: Any) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            t, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                dt, dc = time.perf_counter() - t, time.thread_time() - c
                with self.lock:
                    self.times.append((name, dt))
                    self.cpu[threading.current_thread().name, name] = self.cpu.get(
                        (threading.current_thread().name, name), 0.0) + dc
        return timed

    def remove(self) -> None:
        for name, fn in self.saved.items():
            if fn is None:  # a mixin's: Store finds it there again
                delattr(self.cls, name)
            else:
                setattr(self.cls, name, fn)

    def summary(self) -> dict[str, Any]:
        import numpy as np

        if not self.times:
            return {}
        d = np.array([t for _, t in self.times]) * 1000
        by: dict[str, list[float]] = {}
        for name, t in self.times:
            by.setdefault(name, []).append(t * 1000)
        worst = sorted(((float(np.percentile(v, 99)), k, len(v)) for k, v in by.items()), reverse=True)[:3]
        return {"calls": len(d), "p50_ms": float(np.percentile(d, 50)), "p99_ms": float(np.percentile(d, 99)),
                "max_ms": float(d.max()), "worst_p99": [{"method": k, "p99_ms": p, "calls": n} for p, k, n in worst],
                "driver_cpu_s": {m: round(c, 3) for (th, m), c in sorted(self.cpu.items(), key=lambda kv: -kv[1])
                                 if th == "autoresearch-driver"}}


def fresh_pg() -> tuple[str, str]:
    import sqlalchemy

    name = f"scale_{uuid.uuid4().hex[:8]}"
    eng = sqlalchemy.create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with eng.connect() as c:
        c.execute(sqlalchemy.text(f"CREATE DATABASE {name}"))
    eng.dispose()
    return name, PG_ADMIN.rsplit("/", 1)[0] + "/" + name


def drop_pg(name: str) -> None:
    import sqlalchemy

    eng = sqlalchemy.create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with eng.connect() as c:
        c.execute(sqlalchemy.text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
    eng.dispose()


def busy_fraction(spans: list[tuple[float, float]], slots: int, t0: float, t1: float) -> tuple[float, float | None]:
    """(busy slot-seconds ÷ slots × (t1 - t0), the same from the first moment all slots were busy)."""
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    busy = 0.0
    running, last, full_at = 0, t0, None
    for t, d in events:
        t = min(max(t, t0), t1)
        busy += running * (t - last)
        last = t
        running += d
        if full_at is None and running >= slots:
            full_at = t
    busy += running * (t1 - last)
    total = busy / (slots * (t1 - t0))
    if full_at is None or t1 - full_at < 1:
        return total, None
    steady = sum(max(0.0, min(b, t1) - max(a, full_at)) for a, b in spans) / (slots * (t1 - full_at))
    return total, steady


def cell(executor: str, db: str, slots: int, stage_s: float, minutes: float, hypotheses: int,
         ray_address: str | None) -> dict[str, Any]:
    from sqlmodel import select

    from agent.loop import Loop, LoopOptions
    from pipeline.api import ExecutorOptions
    from agent.records import Records
    from pipeline.lab import load_lab
    from pipeline.experiment import open_store
    from pipeline.outcomes import StageOutcome
    from pipeline.store import Result, StageExec

    root = Path(tempfile.mkdtemp(prefix=f"scale-{executor}-{db}-{slots}-")) / "lab"
    pg = fresh_pg() if db == "postgresql" else None
    url = pg[1] if pg else None
    try:
        make_lab(root, stage_s)
        seed(root, url, hypotheses)
        lab = load_lab(root)
        opts = LoopOptions(max_hypotheses=None, hours=minutes / 60, executor=ExecutorOptions(executor, slots, ray_address),
                           offline=True, db=url, idle_poll_s=1.0)
        timer = StoreTimer()
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        loop = Loop(lab, opts, progress=lambda m: None)
        try:
            out = loop.run()
            driver_cpu = loop.driver_thread.cpu_s
        finally:
            loop.close()
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        t_stop = time.time()
        timer.remove()
        store = open_store(lab, url)
        with store.session() as s:
            executed = (StageOutcome.OK, StageOutcome.METHOD, StageOutcome.TIMEOUT, StageOutcome.CANCELLED)
            stages = list(s.exec(select(StageExec).where(StageExec.outcome.in_(executed))))  # type: ignore[attr-defined]
            results = list(s.exec(select(Result)))
        spans = [(x.started_at, x.finished_at or t_stop) for x in stages]
        if not spans:
            raise SystemExit(f"scale.py: no stage ran in the {minutes:g}-minute cell ({executor}, {db}, {slots} slots): "
                             "give it more --minutes")
        t0 = min(a for a, _ in spans)
        util, steady = busy_fraction(spans, slots, t0, t_stop)
        rec = Records(store)
        decided = [h for h in rec.all(("done",)) if h.finished_at and h.finished_at >= t0]
        window_h = (t_stop - t0) / 3600
        cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        runs = [r for r in results if r.created_at >= t0]
        promoted = [h for h in decided if h.promoted_tag]
        rebased = sum(1 for h in decided if (h.rationale_decision or "").startswith("Re-based")
                      or "Re-based" in (h.reject_reason or ""))
        store.engine.dispose()
        return {"executor": executor, "db": db, "slots": slots, "stage_s": stage_s, "window_s": t_stop - t0,
                "utilisation": util, "steady_utilisation": steady, "decided": len(decided),
                "decided_per_hour": len(decided) / window_h, "promoted": len(promoted), "rebased": rebased,
                "runs": len(runs), "stages": len(stages), "process_cpu_s": cpu, "driver_cpu_s": driver_cpu,
                "driver_cpu_ms_per_run": 1000 * driver_cpu / max(1, len(runs)),
                "process_cpu_ms_per_run": 1000 * cpu / max(1, len(runs)), "store": timer.summary(),
                "stopped": out.get("stopped")}
    finally:
        if pg:
            drop_pg(pg[0])
        shutil.rmtree(root.parent, ignore_errors=True)


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'executor':8} {'store':10} {'slots':>5} {'util':>6} {'steady':>6} {'decided/h':>9} {'runs':>5} "
            f"{'drv/run':>8} {'all/run':>8} {'p50':>6} {'p99':>6} {'max':>7}  worst p99")
    lines = [head, "-" * len(head)]
    for r in rows:
        st = r["store"]
        steady = f"{100 * r['steady_utilisation']:5.1f}%" if r["steady_utilisation"] is not None else "   n/a"
        worst = ", ".join(f"{w['method']} {w['p99_ms']:.1f}" for w in st.get("worst_p99", [])[:2])
        lines.append(f"{r['executor']:8} {r['db']:10} {r['slots']:5d} {100 * r['utilisation']:5.1f}% {steady} "
                     f"{r['decided_per_hour']:9.0f} {r['runs']:5d} {r['driver_cpu_ms_per_run']:6.1f}ms "
                     f"{r['process_cpu_ms_per_run']:6.1f}ms "
                     f"{st.get('p50_ms', 0):5.1f}ms {st.get('p99_ms', 0):5.1f}ms {st.get('max_ms', 0):6.0f}ms  {worst}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slots", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--executor", nargs="+", default=["local", "ray"], choices=["local", "ray"])
    p.add_argument("--db", nargs="+", default=["sqlite", "postgresql"], choices=["sqlite", "postgresql"])
    p.add_argument("--stage-s", type=float, default=2.0)
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--hypotheses", type=int, default=600)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    head = None
    if "ray" in args.executor:  # one `ray start --head` node, stopped by its pids (never `ray stop`)
        from support.ray_cluster import ENV, RayCluster

        head = RayCluster(head_cpus=max(args.slots), worker_cpus=0)
        os.environ.update(ENV)  # this process drives it
    rows = []
    try:
        for ex in args.executor:
            for db in args.db:
                for slots in args.slots:
                    t = time.time()
                    r = cell(ex, db, slots, args.stage_s, args.minutes, args.hypotheses,
                             head.address if head and ex == "ray" else None)
                    rows.append(r)
                    print(table([r]).splitlines()[-1], f"({time.time() - t:.0f} s)", flush=True)
    finally:
        if head is not None:
            head.stop()
    cmd = "benchmarks/scale.py " + " ".join(sys.argv[1:])
    text = (f"$ .venv/bin/python {cmd}\n# {time.strftime('%Y-%m-%d %H:%M')} on {os.cpu_count()} cores; "
            f"stage {args.stage_s:g} s, {args.minutes:g} min per cell\n{table(rows)}\n")
    print("\n" + text)
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
