"""How the loop's per-call costs grow over months of a busy lab running 24/7.

    nice -n 10 .venv/bin/python benchmarks/long_run.py [--runs-per-day 1000] [--days 30 365]
        [--db sqlite postgresql] [--repeat 3] [--gpu-usage-every-s 60] [--workdir DIR] [--keep]
        [--out benchmarks/results/long_run.txt]

For each `--days` (smallest first), a store as a busy lab leaves it after that many days at
`--runs-per-day` runs a day, built in a few minutes instead of months:

- a real lab made by `autoresearch init` (`agent.labinit.init_lab`, suite `small`: 8 tasks; `[run]
  gpus = 0.25`), so the lab config, the git repository and the store (`Store.for_lab`, the agent's
  tables, the ledger, the lease) are the product's own;
- every hypothesis that reached a commit is a real git commit (one `git fast-import`): a change of
  `config.toml` (and now and then of `model.py` or `train.py`) on its base, its branch
  `hyp/<id>-<slug>` and annotated tag `exp/<id>`; a promotion moves `autoresearch/baseline` and
  tags `baseline/vN`. The refs stay loose, as the loop's plumbing (`commit-tree`, `update-ref`,
  `git tag`) leaves them;
- then the rows, bulk-inserted with SQLAlchemy core `insert()` (executemany, ~50k rows a batch) into
  the real tables, shaped as the loop writes them: the LLM policy proposes (15 % rejected before any
  run: smoke_failed, compile_error, not_applying, duplicate, ...; each with its smoke run and LLM
  calls), the paired gate looks at 1, 2, 5, 10 challenger runs per task (45/35/12/8 % stop at each;
  5 % of the measured ones crash every run), about 3 % of measured hypotheses are promoted and 5 %
  of abandons refined; the lazy baseline (its noise study first), each champion's fresh runs on the
  next seed block, comparisons, baseline commits, holdout scores of baseline runs; two stage
  executions a run (`pretrain` executed, shared or a cache hit on its seed; `finetune` executed,
  some method failures, 0.3 % lost to infrastructure and retried) with `env =
  STAGE_ENV_VERSION`, their cache entries and uses (those unused for 4 days evicted), a harness
  `score` call per run (and `holdout` per baseline run); gate records (real `GateResult`s from
  `pipeline.gate.evaluate`, ~5.5 kB each) and the agent's decisions per look, a re-verification
  record per promotion; the LLM ledger (`llm_call`: propose, implement with repairs, decide per
  look, summarize; the request bodies are the policy's own renderings of this lab's prompts: the
  proposal's ~40 kB); summaries (the gate's Markdown table inside, ~4 kB); loop events; the lease
  of a live driver; one `gpu_usage` row per `--gpu-usage-every-s` of wall time over the whole span
  (default: as the driver writes them, `gpu_accounting.GPU_USAGE_ROW_S`, one a minute since a56ddb0;
  `--gpu-usage-every-s 5` is the driver before it, a row per `runner.GPU_USAGE_EVERY_S`); the last
  hypothesis in flight (its look's runs part done, part running, part queued).

Not simulated: the LangGraph checkpoints (a file of their own beside a SQLite store), notification
rows (no target configured), MLflow.

Then the hot paths, called through the project's own functions against each store, each `--repeat`
times after a first call: `ms` is the median of the repeats, `1st` the first call (cold caches:
what a fresh CLI process or a new loop pays), `MB` the process's peak RSS above its level before
the first call (sampled every 10 ms, after `gc.collect()` and `malloc_trim`). A call that takes over
20 s is not repeated. `autoresearch status --json` is also run as the CLI (a fresh process:
wall time, its own peak RSS). Then the database's size per table (SQLite: `dbstat`, indexes counted
with their table; PostgreSQL: `pg_total_relation_size`).

Every call is first made once on a 1-day store (discarded), so imports and one-time set-up are not
charged to the first size; caches kept per lab (`labrepo.generation`'s, a `Services`' effects) start
cold for each store, but a call may find them warmed by one before it in the list: the `1st` of
`write_progress` pays the champions' generations (a git process each) that `status` then reuses;
`split_progress (no generation cache: CLI)` and the CLI row show that cost cold.

One table: a row per call (ms at each size), then the rows and MB of the largest tables. On a
shared 2-core VM, building the 365-day store at 1000 runs a day took 72 s and 2.5 GB of disk
(SQLite; the LLM ledger is 1.5 GB of it), 112 s and 3.2 GB with `--gpu-usage-every-s 5` (6.3M
gpu_usage rows); timing both sizes takes another ~12 minutes (the 365-day status, chart and digest
take tens of seconds a call). A smaller `--days` or `--runs-per-day` builds proportionally faster.
SQLite gets no ANALYZE (the product never runs one); PostgreSQL is ANALYZEd after its load, as
autovacuum would have done in a year. `--db postgresql` builds each size in a fresh database on
postgresql+psycopg://postgres@127.0.0.1:5432 (psycopg 3: psycopg2 is not installed; dropped after).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import hashlib
import io
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]
CLI = ROOT / ".venv" / "bin" / "autoresearch"
PG_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
DAY = 86400.0
BATCH = 50_000  # rows per executemany
HOST = "lab-gpu-01"
MODEL = "gpt-4.1-mini"
PRICE = (0.40, 1.60)  # $ per M tokens in / out (agent/llm_prices.py)
LOOK_STOP = {1: 0.45, 2: 0.35, 5: 0.12, 10: 0.08}  # where a measured hypothesis's last look falls
P_REJECT, P_BROKEN, P_PROMOTE, P_REFINE, P_HUMAN = 0.15, 0.05, 0.03, 0.05, 0.05
REJECT_KINDS = (("smoke_failed", 0.40), ("compile_error", 0.20), ("not_applying", 0.15), ("duplicate", 0.10),
                ("llm", 0.05), ("empty", 0.05), ("paths", 0.05))
# (config key or file, weight, pretrain-side: a change re-runs pretraining)
DIRECTIONS = (("finetune.lr", 14, False), ("finetune.head_lr", 8, False), ("finetune.weight_decay", 6, False),
              ("finetune.lora_rank", 10, False), ("finetune.epochs", 6, False), ("finetune.cross_layers", 5, False),
              ("finetune.tabular", 4, False), ("model.dropout", 6, True), ("model.d_model", 5, True),
              ("model.n_layers", 4, True), ("pretrain.lr", 6, True), ("pretrain.epochs", 4, True),
              ("data.max_events", 5, True), ("data.sources", 4, True), ("model.py", 8, True), ("train.py", 5, True))
EVICT_AFTER_S = 4 * DAY
WORDS = ("adapter", "schedule", "warm-up", "cosine decay", "LoRA rank", "head", "cross network", "dropout",
         "event window", "PIX transfers", "app events", "bill payments", "bureau columns", "batch size",
         "weight decay", "pretraining epochs", "layer norm", "label smoothing", "gradient clipping",
         "merchant embedding", "time decay", "night-time share", "travel flag", "recency weighting")
SENTENCE = ("The baseline's {a} looks under-tuned for the {b} signal the tasks share, and the history shows "
            "that changes to the {a} moved {t} more than the others. ")


# ----------------------------------------------------------------------------- the plan

@dataclass
class Hyp:
    id: int
    t0: float  # abstract seconds since the start
    t1: float = 0.0
    origin: str = "llm"
    parent: int | None = None
    title: str = ""
    kind: str = "measured"  # reject | measured | inflight
    reject_kind: str | None = None
    gen: int = 0  # promotions before it: its baseline's generation
    base: int = 0  # mark of its base commit (0: the lab's first commit)
    mark: int | None = None  # its commit's mark (None: rejected before a commit)
    direction: list[str] = field(default_factory=list)
    pretrain_side: bool = False
    scenario: str = "null"  # null | good | harm | broken
    final: int = 1
    promote: bool = False
    refine: bool = False
    tag: str | None = None
    new_base_seeds: list[int] = field(default_factory=list)  # baseline seeds first needed by this one, per look
    base_by_look: dict[int, list[int]] = field(default_factory=dict)
    runs: int = 0


def pick(rng: random.Random, pairs: Any) -> Any:
    u, acc = rng.random(), 0.0
    for v, w in pairs:
        acc += w
        if u < acc:
            return v
    return pairs[-1][0]


def title_of(rng: random.Random, direction: list[str]) -> str:
    a, b = rng.sample(WORDS, 2)
    verb = rng.choice(("Raise", "Lower", "Tune", "Rework", "Try", "Widen", "Shrink", "Regularise"))
    return f"{verb} the {a} ({' + '.join(direction)}) to read the {b} better"[:118]


def plan(rng: random.Random, runs_target: int, tasks: int, looks: list[int], baseline_runs: int,
         noise_runs: int, min_base: int) -> tuple[list[Hyp], float]:
    """Hypothesis by hypothesis, in abstract time (a run ≈ 1 unit, overheads in units), until the runs
    reach `runs_target`; the last one is left in flight. Times are rescaled onto the days later."""
    hyps: list[Hyp] = []
    t, runs, gen, champion = 0.0, 0, 0, 0
    base_done = {0: 0}
    pending_refine: int | None = None
    n_noise = noise_runs
    hid = 0
    weights = [(d, w / sum(x[1] for x in DIRECTIONS)) for d, w, _ in DIRECTIONS]
    side = {d: p for d, _, p in DIRECTIONS}
    while runs < runs_target:
        hid += 1
        h = Hyp(hid, t, gen=gen, base=champion)
        if pending_refine is not None:
            h.parent, pending_refine = pending_refine, None
        elif rng.random() < P_HUMAN:
            h.origin = "human"
        first = pick(rng, weights)
        h.direction = sorted({first} | ({pick(rng, weights)} if rng.random() < 0.25 else set()))
        h.pretrain_side = any(side[d] for d in h.direction)
        h.title = title_of(rng, h.direction)
        overhead = 2.0  # propose, implement, smoke, decide, summarize: about two runs' time
        if rng.random() < P_REJECT:
            h.kind, h.reject_kind = "reject", pick(rng, REJECT_KINDS)
            h.t1 = t + overhead
            t = h.t1
            hyps.append(h)
            continue
        h.mark = hid
        h.scenario = ("broken" if rng.random() < P_BROKEN else "good" if rng.random() < P_PROMOTE * 1.6 else
                      "harm" if rng.random() < 0.08 else "null")
        if h.scenario == "broken":
            h.final = 1
        elif h.scenario == "good":
            h.final = rng.choice([2, 5, 5, 10])
            h.promote = rng.random() < 0.62  # the rest end inconclusive or single_task
        else:
            h.final = pick(rng, list(LOOK_STOP.items()))
        h.refine = not h.promote and rng.random() < P_REFINE
        n = 0
        prev = 0
        if gen == 0 and base_done[0] == 0 and n_noise:  # the lab's first comparison waits for the noise study
            h.base_by_look.setdefault(looks[0], []).extend(range(n_noise))
            base_done[0] = n_noise
        for look in [x for x in looks if x <= h.final]:
            need = min(max(look, min_base), baseline_runs)
            if need > base_done[gen]:
                h.base_by_look.setdefault(look, []).extend(range(base_done[gen], need))
                base_done[gen] = need
            n += tasks * (look - prev)
            prev = look
        n += tasks * sum(len(v) for v in h.base_by_look.values())
        if h.promote:
            gen += 1
            champion = h.mark
            base_done[gen] = 2  # the champion's fresh runs: its first look's lazy baseline seeds
            h.tag = f"baseline/v{gen}"
            n += tasks * 2
        if h.refine:
            pending_refine = h.id
        h.runs = n
        h.t1 = t + overhead + n
        t = h.t1
        runs += n
        hyps.append(h)
    last = hyps[-1]
    if last.kind == "measured" and not last.promote:
        last.kind = "inflight"
    return hyps, t


# ----------------------------------------------------------------------------- git

def set_toml(text: str, key: str, value: str) -> str:
    section, name = key.split(".", 1)
    m = re.search(rf"(?ms)^\[{re.escape(section)}\]\n(.*?)(?=^\[|\Z)", text)
    assert m, key
    body = re.sub(rf"(?m)^{re.escape(name)}\s*=[^#\n]*", f"{name} = {value}  ", m.group(1), count=1)
    return text[:m.start(1)] + body + text[m.end(1):]


def toml_value(key: str, hid: int, rng: random.Random) -> str:
    f = 1 + ((hid * 2654435761) % 10007 + 1) / 12000
    if key == "data.sources":
        return json.dumps(rng.choice([["card", "pix"], ["card", "pix", "app"], ["card", "app"], ["card", "bill"]]))
    if key == "finetune.tabular":
        return '"all"'
    ints = {"finetune.lora_rank": 4, "finetune.epochs": 3, "finetune.cross_layers": 2, "model.d_model": 48,
            "model.n_layers": 2, "pretrain.epochs": 3, "data.max_events": 24}
    if key in ints:
        return str(int(ints[key] * (1 + (hid % 5) / 2)) + hid % 3)
    base = {"finetune.lr": 3e-4, "finetune.head_lr": 2e-3, "finetune.weight_decay": 0.01, "model.dropout": 0.1,
            "pretrain.lr": 1e-3}[key]
    return f"{base * f:.6g}"


def build_git(lab: Path, hyps: list[Hyp], start: float, scale: float, rng: random.Random) -> dict[int, str]:
    """Every hypothesis's commit, branch and tag, the baseline's moves and tags, in one fast-import;
    {mark: sha} (mark 0: the lab's first commit)."""
    import git

    from agent.workspace import slugify

    repo = git.Repo(lab)
    first = repo.commit("autoresearch/baseline")
    texts = {0: {p: (lab / p).read_text() for p in ("config.toml", "model.py", "train.py")}}
    who = "autoresearch <autoresearch@localhost>"
    out: list[str] = []
    seen: set[tuple[int, str]] = set()

    def data(s: str) -> str:
        b = s.encode()
        return f"data {len(b)}\n{s}\n"

    for h in hyps:
        if h.mark is None:
            continue
        files = dict(texts[h.base])
        changed = {}
        for d in h.direction:
            if d.endswith(".py"):
                changed[d] = files[d] + f"\n# hyp {h.id}: {h.title[:60]}\nVARIANT_{h.id} = {h.id % 7}\n"
            else:
                changed["config.toml"] = set_toml(changed.get("config.toml", files["config.toml"]), d,
                                                  toml_value(d, h.id, rng))
        key = (h.base, json.dumps(changed, sort_keys=True))
        while key in seen:  # two identical trees would be a duplicate the loop refuses
            changed["config.toml"] = set_toml(changed.get("config.toml", files["config.toml"]), "finetune.weight_decay",
                                              f"{0.01 * (1 + rng.random()):.8f}")
            key = (h.base, json.dumps(changed, sort_keys=True))
        seen.add(key)
        if h.promote:
            texts[h.mark] = {**files, **changed}
        when = int(start + scale * h.t0 + 120)
        msg = f"hyp {h.id}: {h.title}\n\nRationale of hypothesis {h.id}.\n\nExpected: a better AUC on most tasks"
        out.append(f"commit refs/heads/hyp/{h.id}-{slugify(h.title)}\nmark :{h.id}\n"
                   f"committer {who} {when} +0000\n{data(msg)}from {f':{h.base}' if h.base else first.hexsha}\n")
        for path, text in changed.items():
            out.append(f"M 100644 inline {path}\n{data(text)}")
        out.append("\n")
        out.append(f"tag exp/{h.id}\nfrom :{h.id}\ntagger {who} {when} +0000\n{data(f'experiment {h.id}: {h.title}')}")
        if h.promote:
            pwhen = int(start + scale * h.t1)
            out.append(f"tag {h.tag}\nfrom :{h.id}\ntagger {who} {pwhen} +0000\n"
                       f"{data(f'promote hyp {h.id}: {h.title}')}")
    champion = max((h.mark for h in hyps if h.promote), default=None)
    if champion:
        out.append(f"reset refs/heads/autoresearch/baseline\nfrom :{champion}\n\n")
    marks = lab.parent / f"{lab.name}.marks"
    subprocess.run(["git", "fast-import", "--quiet", f"--export-marks={marks}"], cwd=lab, input="".join(out).encode(),
                   check=True)
    shas = {0: first.hexsha}
    for line in marks.read_text().splitlines():
        m, sha = line.split()
        shas[int(m[1:])] = sha
    marks.unlink()
    return shas


# ----------------------------------------------------------------------------- what the rows carry

class Capture:
    """An LLM client that records what the real policy would send (`LLMClient._body`'s shape)."""

    def __init__(self) -> None:
        self.bodies: dict[str, str] = {}
        self.answers = {
            "propose": {"title": "Raise the LoRA rank", "rationale": "r" * 600, "expected_effect": "+0.004 AUC",
                        "tasks_expected": [], "change": "finetune.lora_rank = 8"},
            "implement": {"edits": [{"path": "config.toml", "search": "lora_rank = 4", "replace": "lora_rank = 8",
                                     "content": None}], "notes": "one value"},
            "decide": {"decision": "abandon", "rationale": "the gate found no effect", "follow_up": ""},
        }

    def complete_json(self, purpose: str, msgs: Any, schema: Any, name: str, hypothesis_id: str | None = None) -> Any:
        tokens = {"propose": 2000, "implement": 8000, "decide": 1000}.get(purpose, 2000)
        body = {"model": MODEL, "messages": msgs, "max_completion_tokens": tokens, "stream": True,
                "stream_options": {"include_usage": True},
                "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": dict(schema),
                                                                            "strict": True}}}
        self.bodies[purpose] = json.dumps(body, ensure_ascii=False)
        return self.answers[purpose]


def gate_pool(lab: Any, rng: random.Random) -> dict[tuple[int, str], list[dict]]:
    """Real gate records (`pipeline.gate.evaluate`) of this lab's 8 tasks at each look, by (look, verdict)
    and (look, scenario): the payloads the rows reuse."""
    import numpy as np

    from pipeline.gate import evaluate

    cfg = lab.config.gate.model_dump()
    tasks = lab.tasks()
    looks = list(cfg["looks"])
    nrng = np.random.default_rng(rng.randrange(1 << 30))
    pool: dict[tuple[int, str], list[dict]] = {}
    effects = {"null": 0.0, "good": 0.03, "harm": -0.025, "broken": None}
    for look in looks:
        for scenario, eff in effects.items():
            for _ in range(2 if scenario != "null" else 3):
                nb = min(max(look, 2), 10)
                rows = []
                for t in tasks:
                    base = list(0.70 + 0.01 * nrng.standard_normal(nb))
                    chal = ([None] * look if eff is None else
                            [b + eff + 0.004 * nrng.standard_normal() for b in base[:look]])
                    rows.append({"task": t, "baseline": base, "challenger": chal,
                                 "history": list(0.70 + 0.01 * nrng.standard_normal(10))})
                r = evaluate({"config": cfg, "tasks": rows, "looks_done": [n for n in looks if n < look],
                              "at_look": True})
                payload = r.model_dump(mode="json")
                v = payload["verdict"] or "escalate"
                pool.setdefault((look, v), []).append(payload)
                pool.setdefault((look, "s:" + scenario), []).append(payload)
    return pool


def choose(pool: dict, look: int, scenario: str, final: bool, promote: bool, rng: random.Random) -> dict:
    if not final:
        return rng.choice(pool.get((look, "escalate")) or pool[(look, "s:null")])
    if promote:
        return rng.choice(pool.get((look, "improvement")) or pool[(look, "s:good")])
    terminal = [p for p in pool[(look, "s:" + scenario)] if p["verdict"] not in (None, "escalate", "improvement")]
    if not terminal:
        terminal = [p for k, v in pool.items() if k[0] == look and not k[1].startswith("s:")
                    and k[1] not in ("escalate", "improvement") for p in v]
    return rng.choice(terminal)


def texts(rng: random.Random, n: int, lo: int, hi: int) -> list[str]:
    out = []
    for _ in range(n):
        s = ""
        target = rng.randint(lo, hi)
        while len(s) < target:
            a, b = rng.sample(WORDS, 2)
            s += SENTENCE.format(a=a, b=b, t=rng.choice(("default_90d", "churn_60d", "fraud_alert")))
        out.append(s[:target])
    return out


# ----------------------------------------------------------------------------- the rows

class Loader:
    """Rows by table, written with `insert()` executemany in batches, in foreign-key order."""

    ORDER = ("arm", "baseline_commit", "comparison", "run", "result", "stage_exec", "holdout_score", "harness_exec",
             "cache_entry", "cache_use", "smoke_exec", "gate_record", "hypothesis", "agent_decision", "llm_call",
             "loop_event", "review_comment", "gpu_usage", "lease")

    def __init__(self, engine: Any):
        from sqlmodel import SQLModel

        self.engine = engine
        self.tables = SQLModel.metadata.tables
        self.rows: dict[str, list[dict]] = {k: [] for k in self.ORDER}
        self.counts: dict[str, int] = {k: 0 for k in self.ORDER}
        self.pending = 0

    def add(self, table: str, row: dict) -> None:
        self.rows[table].append(row)
        self.pending += 1

    def maybe_flush(self) -> None:
        """Write the batch once it is big enough: called between whole runs and hypotheses only (a run's row
        is completed after its stages')."""
        if self.pending >= BATCH:
            self.flush()

    def flush(self) -> None:
        from sqlalchemy import insert

        with self.engine.begin() as conn:
            if self.engine.dialect.name == "sqlite":
                conn.exec_driver_sql("PRAGMA synchronous=OFF")
            for name in self.ORDER:
                rows = self.rows[name]
                if rows:
                    conn.execute(insert(self.tables[name]), rows)
                    self.counts[name] += len(rows)
                    self.rows[name] = []
        self.pending = 0


def key_of(*parts: Any) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def build_rows(loader: Loader, lab: Any, hyps: list[Hyp], shas: dict[int, str], start: float, scale: float,
               end: float, pool: dict, llm: dict[str, list[str]], args: argparse.Namespace, rng: random.Random) -> None:
    from agent.workspace import slugify
    from pipeline.executors.base import STAGE_ENV_VERSION
    from pipeline.gate.report import GateResult, render_markdown

    tasks = lab.tasks()
    looks = list(lab.config.gate.looks)
    share = float(lab.config.run.gpus or 0.0)
    logs = lab.state / "logs"
    dataset = f"transactions-v2-small-d{lab.config.benchmark.data_seed}-n6000"
    run_id = exec_id = 0
    cache_used: dict[str, tuple[float, int, str, str, float, float]] = {}  # key -> (last use, size, stage, commit, cpu, wall)
    arms: set[str] = set()
    spacing = scale  # seconds of one abstract run unit
    rationale = texts(rng, 40, 350, 900)
    short = texts(rng, 40, 120, 320)
    reasons = texts(rng, 20, 300, 1600)
    evidence: dict[int, str] = {}
    level = {0: 0.700}
    task_off = {t: 0.02 * i for i, t in enumerate(tasks)}
    driver_pid = [4242]

    def arm(commit: str, label: str | None, t: float) -> None:
        if commit not in arms:
            arms.add(commit)
            loader.add("arm", {"commit": commit, "label": label, "created_at": t})

    def stage(rid: int, name: str, key: str, outcome: str, t: float, cpu: float, wall: float, *, detail: str | None,
              saved: float = 0.0, executed: bool = True) -> None:
        nonlocal exec_id
        exec_id += 1
        job = uuid.uuid4().hex[:8]
        loader.add("stage_exec", {
            "id": exec_id, "run_id": rid, "stage": name, "key": key, "outcome": outcome, "executor": "local", "host": HOST,
            "cpu_s": cpu if executed else 0.0, "gpu_s": share * wall if executed else 0.0,
            "wall_s": wall if executed else 0.0, "saved_cpu_s": saved, "exit_code": (1 if outcome == "method" else
                                                                                  0 if executed else None),
            "signal": 9 if outcome == "infra" else None, "detail": detail,
            "log_path": str(logs / f"{name}-{key[:12]}-{job}.log") if executed else None,
            "started_at": t, "finished_at": t + (wall if executed else 0.0),
            "env": STAGE_ENV_VERSION if executed else None})

    def one_run(commit: str, task: str, seed: int, t: float, pre_key: str, batch_lead: set[str], value: float | None,
                broken: bool, baseline: bool, priority: int) -> None:
        nonlocal run_id
        run_id += 1
        rid = run_id
        infra = 1 if rng.random() < 0.003 else 0
        wall_pre, wall_ft = rng.uniform(40, 70), rng.uniform(25, 45)
        t_start = t
        run_row = {"id": rid, "commit": commit, "task": task, "seed": seed, "status": "done", "priority": priority,
                   "infra_failures": infra, "requeues": 0, "owner_host": HOST, "owner_pid": driver_pid[0],
                   "owner_started": start, "claim_token": None, "queued_at": t_start - 30, "started_at": t_start,
                   "dataset_id": dataset}
        loader.add("run", run_row)  # before its stages: a batch may be written between them
        # pretrain: executed once per key, shared by the other tasks of its seed in the batch, else a hit
        if pre_key not in cache_used:
            stage(rid, "pretrain", pre_key, "ok", t, wall_pre * 0.97, wall_pre, detail=None)
            cache_used[pre_key] = (t + wall_pre, 48 << 20, "pretrain", commit, wall_pre * 0.97, wall_pre)
            loader.add("cache_entry", {"key": pre_key, "stage": "pretrain", "commit": commit, "cpu_s": wall_pre * 0.97,
                                       "wall_s": wall_pre, "created_at": t + wall_pre})
            batch_lead.add(pre_key)
            t += wall_pre
        else:
            c = cache_used[pre_key]
            stage(rid, "pretrain", pre_key, "shared" if pre_key in batch_lead else "cache_hit", t, 0, 0,
                  detail=None, saved=c[4], executed=False)
            cache_used[pre_key] = (t, *c[1:])
        ft_key = key_of("finetune", commit, task, seed)
        if infra:
            stage(rid, "finetune", ft_key, "infra", t, wall_ft * 0.4, wall_ft * 0.4,
                  detail=f"infra (signal 9); log {logs}/finetune-{ft_key[:12]}-{uuid.uuid4().hex[:8]}.log")
            t += wall_ft * 0.4
        if broken:
            kind = "timeout" if rng.random() < 0.2 else "crash"
            outcome = "timeout" if kind == "timeout" else "method"
            detail = (f"{kind} (exit code 1); log {logs}/finetune-{ft_key[:12]}-{uuid.uuid4().hex[:8]}.log")
            stage(rid, "finetune", ft_key, outcome, t, wall_ft * 0.3, wall_ft * 0.3, detail=detail)
            t += wall_ft * 0.3
            res = {"outcome": "method_failure", "value": None, "kind": kind, "detail": f"finetune: {detail}"}
        else:
            stage(rid, "finetune", ft_key, "ok", t, wall_ft * 0.95, wall_ft, detail=None)
            cache_used[ft_key] = (t + wall_ft, 6 << 20, "finetune", commit, wall_ft * 0.95, wall_ft)
            loader.add("cache_entry", {"key": ft_key, "stage": "finetune", "commit": commit, "cpu_s": wall_ft * 0.95,
                                       "wall_s": wall_ft, "created_at": t + wall_ft})
            t += wall_ft
            res = {"outcome": "ok", "value": value, "kind": None, "detail": None}
        run_row.update(heartbeat_at=t, finished_at=t)
        loader.maybe_flush()
        loader.add("result", {"run_id": rid, "commit": commit, "task": task, "seed": seed, "dataset_id": dataset,
                              "cpu_s": wall_pre * 0.97 + wall_ft, "created_at": t, **res})
        loader.add("harness_exec", {"kind": "score", "run_id": rid, "outcome": "ok", "cpu_s": 1.2, "gpu_s": 0.0,
                                    "wall_s": 1.6, "started_at": t})
        if baseline and value is not None:
            loader.add("holdout_score", {"run_id": rid, "commit": commit, "task": task, "seed": seed,
                                         "value": value + rng.gauss(0, 0.004), "created_at": t + 2})
            loader.add("harness_exec", {"kind": "holdout", "run_id": rid, "outcome": "ok", "cpu_s": 0.9, "gpu_s": 0.0,
                                        "wall_s": 1.2, "started_at": t + 2})

    def batch(commit: str, seeds: list[int], gen: int, t: float, t_end: float, pre_side: bool, effect: float,
              broken: bool, baseline: bool, priority: int) -> None:
        """The runs of one commit on `seeds` × every task, spread over [t, t_end)."""
        n = len(seeds) * len(tasks)
        if not n:
            return
        step = (t_end - t) / n
        lead: set[str] = set()
        i = 0
        for seed in seeds:
            pre = key_of("pretrain", commit if pre_side else f"gen{gen}", seed)
            for task in tasks:
                v = level.get(gen, 0.7) + task_off[task] + effect + rng.gauss(0, 0.01)
                one_run(commit, task, seed, t + i * step, pre, lead, v, broken, baseline, priority)
                i += 1

    loader.add("baseline_commit", {"commit": shas[0], "marked_at": start})
    arm(shas[0], "baseline", start)
    base_commit = {0: shas[0]}
    promotions = 0
    prompts = {k: v for k, v in llm.items()}

    def llm_call(purpose: str, hid: int | None, ts: float, attempt: int = 1) -> None:
        body = rng.choice(prompts[purpose])
        completion = {"propose": 420, "implement": 900, "decide": 160, "summarize": 600}[purpose]
        answer = json.dumps({"id": f"chatcmpl-{uuid.uuid4().hex[:20]}", "object": "chat.completion", "model": MODEL,
                             "choices": [{"index": 0, "finish_reason": "stop", "message": {
                                 "role": "assistant", "content": rng.choice(rationale)[:completion * 3]}}],
                             "usage": {"prompt_tokens": len(body) // 4, "completion_tokens": completion}})
        pt = len(body) // 4
        loader.add("llm_call", {"ts": ts, "purpose": purpose, "hypothesis_id": None if purpose == "propose" else str(hid),
                                "model": MODEL, "mode": "json_schema", "attempt": attempt, "request_json": body,
                                "response_text": answer, "status_code": 200, "prompt_tokens": pt,
                                "completion_tokens": completion,
                                "usd": (pt * PRICE[0] + completion * PRICE[1]) / 1e6,
                                "latency_s": rng.uniform(3, 25), "error": None, "first_token_s": rng.uniform(0.4, 2.0),
                                "finish_reason": "stop"})

    for h in hyps:
        loader.maybe_flush()
        t0 = start + scale * h.t0
        t1 = start + scale * h.t1
        commit = shas.get(h.mark) if h.mark is not None else None
        base = base_commit[h.gen]
        llm_call("propose", None, t0 + 5)
        repairs = 1 + (rng.random() < 0.3) + (h.kind == "reject" and h.reject_kind in ("compile_error", "not_applying"))
        for k in range(repairs):
            llm_call("implement", h.id, t0 + 40 + 20 * k)
        row = {"id": h.id, "title": h.title, "rationale": rng.choice(rationale),
               "expected_effect": rng.choice(short)[:200], "expected_tasks": tasks[:rng.randint(2, 8)],
               "origin": h.origin, "priority": 5 if h.origin == "human" else 0,
               "seed_text": rng.choice(rationale) if h.origin == "human" else None, "seed_branch": None,
               "parent_id": h.parent, "plan": None, "change": None, "status": "done", "branch": None,
               "base_commit": base, "commit": None, "look": None, "verdict": None, "decision": None,
               "rationale_decision": None, "follow_up": None, "reject_kind": None, "reject_reason": None,
               "promoted_tag": None, "review": "pending", "summary_md": None, "summary_author": "llm",
               "created_at": t0, "updated_at": t1, "finished_at": t1, "direction": None}
        smoke_start = t0 + 80
        if h.kind == "reject":
            row.update(decision="reject", reject_kind=h.reject_kind, reject_reason=rng.choice(reasons),
                       summary_md=f"# Hypothesis {h.id}: {h.title}\n\n- **Decision:** rejected ({h.reject_kind})\n\n"
                                  + rng.choice(reasons) + "\n\n" + rng.choice(rationale))
            if h.reject_kind == "smoke_failed":
                loader.add("smoke_exec", {"hypothesis": str(h.id), "base": base, "outcome": "method", "executor": "here",
                                          "stages": 2, "cpu_s": 14.0, "gpu_s": share * 18, "wall_s": 21.0,
                                          "started_at": smoke_start, "gpu_from": smoke_start + 2,
                                          "gpu_to": smoke_start + 19})
            llm_call("summarize", h.id, t1 - 10)
            loader.add("hypothesis", row)
            continue
        loader.add("smoke_exec", {"hypothesis": str(h.id), "base": base, "outcome": "ok", "executor": "here",
                                  "stages": 2, "cpu_s": 25.0, "gpu_s": share * 36, "wall_s": 41.0,
                                  "started_at": smoke_start, "gpu_from": smoke_start + 2, "gpu_to": smoke_start + 38})
        arm(commit, f"hyp/{h.id}", t0 + 130)
        loader.add("comparison", {"challenger": commit, "baseline": base, "created_at": t0 + 131})
        effect = {"null": 0.0, "good": 0.012, "harm": -0.012, "broken": 0.0}[h.scenario]
        t_runs0 = t0 + 2 * spacing * 0.6
        t_runs1 = t1 - spacing * 0.4 - (2 * len(tasks) * spacing if h.promote else 0)
        my_looks = [x for x in looks if x <= h.final]
        per_look = []
        for look in my_looks:
            prev = max([x for x in my_looks if x < look], default=0)
            per_look.append((look, list(range(prev, look)), h.base_by_look.get(look, [])))
        total = sum(len(c) + len(b) for _, c, b in per_look) or 1
        t = t_runs0
        prio = 0
        for i, (look, cseeds, bseeds) in enumerate(per_look):
            width = (t_runs1 - t_runs0) * (len(cseeds) + len(bseeds)) / total
            prio = 1 + (i + 1) * 100
            inflight_look = h.kind == "inflight" and look == my_looks[-1]
            if bseeds:
                seeds = [s + 1000 * (h.gen % 1000) for s in bseeds]
                batch(base, seeds, h.gen, t, t + width * len(bseeds) / (len(bseeds) + len(cseeds)), False, 0.0, False,
                      True, prio)
                if h.gen == 0 and look == my_looks[0] and not promotions:
                    loader.add("loop_event", {"kind": "noise", "message": "noise study: 5 baseline runs per task",
                                              "created_at": t})
            tc = t + width * len(bseeds) / (len(bseeds) + len(cseeds))
            seeds = [s + 1000 * (h.gen % 1000) for s in cseeds]
            if inflight_look:  # the look under way: a third done, a few running, the rest queued
                done = len(seeds) * len(tasks) // 3
                k = 0
                for seed in seeds:
                    for task in tasks:
                        k += 1
                        if k <= done:
                            pre = key_of("pretrain", commit if h.pretrain_side else f"gen{h.gen}", seed)
                            one_run(commit, task, seed, tc + k, pre, set(), level.get(h.gen, 0.7) + task_off[task],
                                    False, False, prio)
                            continue
                        run_state = "running" if k <= done + 4 else "queued"
                        run_id += 1
                        loader.add("run", {"id": run_id, "commit": commit, "task": task, "seed": seed,
                                           "status": run_state, "priority": prio, "infra_failures": 0, "requeues": 0,
                                           "owner_host": HOST if run_state == "running" else None,
                                           "owner_pid": driver_pid[0] if run_state == "running" else None,
                                           "owner_started": start if run_state == "running" else None,
                                           "claim_token": uuid.uuid4().hex if run_state == "running" else None,
                                           "heartbeat_at": end - 2 if run_state == "running" else None,
                                           "queued_at": tc, "started_at": end - 30 if run_state == "running" else None,
                                           "finished_at": None, "dataset_id": dataset})
                break
            batch(commit, seeds, h.gen, tc, t + width, h.pretrain_side, effect, h.scenario == "broken", False, prio)
            t += width
            last = look == my_looks[-1]
            payload = choose(pool, look, h.scenario, last, h.promote and last, rng)
            loader.add("gate_record", {"hypothesis": str(h.id), "look": look, "kind": "verdict", "payload": payload,
                                       "created_at": t})
            verdict = payload["verdict"] or "escalate"
            if last:
                decision = "promote" if h.promote else "refine" if h.refine else "abandon"
            else:
                decision = "escalate"
            allowed = (["promote", "abandon"] if verdict == "improvement" else
                       ["escalate", "abandon"] if verdict == "escalate" else ["abandon", "refine"])
            loader.add("agent_decision", {"hypothesis": str(h.id), "look": look, "decision": decision,
                                          "rationale": rng.choice(short), "follow_up": rng.choice(short) if
                                          decision == "refine" else "", "allowed": allowed, "verdict": verdict,
                                          "policy": "llm", "created_at": t + 20})
            llm_call("decide", h.id, t + 10)
            row.update(look=look, verdict=verdict, decision=decision)
        row.update(branch=f"hyp/{h.id}-{slugify(h.title)}", commit=commit, direction=list(h.direction),
                   rationale_decision=rng.choice(short), follow_up=rng.choice(short) if h.refine else None)
        if h.kind == "inflight":
            row.update(status="measuring", look=my_looks[-1], decision="escalate" if len(my_looks) > 1 else None,
                       finished_at=None, review="none", verdict="escalate" if len(my_looks) > 1 else None)
            loader.add("hypothesis", row)
            continue
        if h.promote:
            promotions += 1
            gen = h.gen + 1
            level[gen] = level[h.gen] + 0.008
            base_commit[gen] = commit
            loader.add("baseline_commit", {"commit": commit, "marked_at": t1 - 2 * len(tasks) * spacing})
            seeds = [s + 1000 * (gen % 1000) for s in (0, 1)]
            batch(commit, seeds, gen, t1 - 2 * len(tasks) * spacing, t1 - 30, True, 0.0, False, True, 0)
            loader.add("gate_record", {"hypothesis": str(h.id), "look": h.final, "kind": "reverify", "created_at": t1,
                                       "payload": {"tag": h.tag, "tasks": [
                                           {"task": x, "fresh": 0.7 + task_off[x], "selected": 0.71 + task_off[x],
                                            "fresh_runs": 2} for x in tasks], "fresh_mean": 0.77, "selected_mean": 0.78,
                                           "shrinkage": -0.01, "tasks_worse": 5, "fresh_seeds": seeds}})
            loader.add("loop_event", {"kind": "promote", "message": f"#{h.id} promoted as {h.tag}", "created_at": t1})
            if rng.random() < 0.5:
                loader.add("review_comment", {"hypothesis_id": h.id, "action": "approve",
                                              "text": rng.choice(short), "created_at": t1 + 3600})
            row.update(promoted_tag=h.tag, review=rng.choice(("approved", "pending")))
        if row["verdict"] not in evidence:
            evidence[row["verdict"]] = render_markdown(GateResult.from_dict(payload))
        row["summary_md"] = (f"# Hypothesis {h.id}: {h.title}\n\n- **Decision:** {row['decision']} "
                             f"({row['verdict']})\n- **Origin:** {h.origin} · branch `hyp/{h.id}` · commit "
                             f"`{commit[:10]}`\n\n## What was tried\n\n{rng.choice(rationale)}\n\n## Evidence\n\n"
                             f"{evidence[row['verdict']]}\n\n## Interpretation\n\n{rng.choice(rationale)}\n\n"
                             f"## Decision\n\n{row['rationale_decision']}\n")
        llm_call("summarize", h.id, t1 - 10)
        loader.add("hypothesis", row)
        if rng.random() < 0.02:
            loader.add("loop_event", {"kind": "llm_down", "message": "LLM unreachable: 502 Bad Gateway", "created_at": t1})
            loader.add("loop_event", {"kind": "llm_up", "message": "LLM reachable again after 40 s",
                                      "created_at": t1 + 40})
    # the cache's rows: each key's size and last use; the ones unused for a few days were evicted
    for key, (used, size, _stage, _commit, _cpu, _wall) in cache_used.items():
        loader.add("cache_use", {"key": key, "size_bytes": size, "used_at": used,
                                 "evicted_at": used + EVICT_AFTER_S if used < end - EVICT_AFTER_S else None})
        loader.maybe_flush()
    # the GPU sampler's rows: one per interval over the whole span, a driver restart every 3 days
    every = args.gpu_usage_every_s
    t = start
    holder = ""
    while t < end:
        if not holder or int((t - start) // (3 * DAY)) != int((t - every - start) // (3 * DAY)):
            driver_pid[0] += 17
            holder = f"{HOST}:{driver_pid[0]}:{t:.0f}"
        busy = rng.randint(6, 10)
        loader.add("gpu_usage", {"holder": holder, "gpus": "0,1,2,3", "started_at": t, "updated_at": t + every,
                                 "samples": int(2 * every), "busy": int(busy * every / 5),
                                 "util_sum": busy * every / 5 * 68.0})
        t += every
        loader.maybe_flush()
    loader.add("lease", {"key": "driver", "host": HOST, "pid": driver_pid[0], "started": end - 3 * DAY,
                         "acquired_at": end - 3 * DAY, "heartbeat_at": end - 1})
    loader.flush()


# ----------------------------------------------------------------------------- a store

def fresh_pg() -> str:
    import sqlalchemy

    name = f"longrun_{uuid.uuid4().hex[:8]}"
    eng = sqlalchemy.create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with eng.connect() as c:
        c.execute(sqlalchemy.text(f"CREATE DATABASE {name}"))
    eng.dispose()
    return PG_ADMIN.rsplit("/", 1)[0] + "/" + name


def drop_pg(url: str) -> None:
    import sqlalchemy

    eng = sqlalchemy.create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with eng.connect() as c:
        c.execute(sqlalchemy.text(f"DROP DATABASE IF EXISTS {url.rsplit('/', 1)[1]} WITH (FORCE)"))
    eng.dispose()


def prompt_bodies(lab: Any, store: Any, pool: dict, rng: random.Random) -> dict[str, list[str]]:
    """The request bodies the LLM policy sends for this lab (`agent.policy_llm.LLMPolicy` rendering
    `prompts/`), with a long lab's history and directions in the proposal's: a few variants each."""
    from agent.graph import Services, build_context
    from agent.policy_llm import LLMPolicy
    from agent.records import Hypothesis, Records
    from agent.workspace import Workspace
    from pipeline.gate.report import GateResult, render_markdown

    cap = Capture()
    svc = Services(lab, store, Records(store), Workspace(lab), LLMPolicy(cap), smoke=False)
    ctx = build_context(svc)
    out: dict[str, list[str]] = {"propose": [], "implement": [], "decide": [], "summarize": []}
    for i in range(6):
        ctx.history = [{"id": 1000 + j, "title": title_of(rng, [DIRECTIONS[j % len(DIRECTIONS)][0]]), "status": "done",
                        "verdict": rng.choice(("futile", "inconclusive", "harm", "improvement")),
                        "decision": rng.choice(("abandon", "abandon", "refine", "promote")),
                        "mean_delta": f"{rng.gauss(0, 0.004):+.4f}", "improved": f"{rng.randint(0, 8)}/8"}
                       for j in range(60 + rng.randint(0, 30))]
        ctx.history_left_out = {"abandon": 3000 + i, "reject": 600, "refine": 150, "promote": 70}
        ctx.directions = [f"{d}: {rng.randint(50, 900)} hypotheses (410 abandon, 9 promote, 80 reject), banked "
                          f"{rng.uniform(0, 3):+.3f}σ in 9 promotions, {rng.randint(900, 9000)} runs"
                          for d, _, _ in DIRECTIONS][:20]
        ctx.plateau = 40 if i % 2 else None
        svc.policy.propose(ctx)
        out["propose"].append(cap.bodies["propose"])
        hyp = Hypothesis(id=1000 + i, title=title_of(rng, ["finetune.lr"]), rationale=texts(rng, 1, 400, 900)[0],
                         expected_effect="+0.004 AUC on most tasks", expected_tasks=lab.tasks())
        svc.policy.implement(ctx, hyp, None)
        out["implement"].append(cap.bodies["implement"])
        payload = rng.choice([p for k, v in pool.items() if not k[1].startswith("s:") for p in v])
        evidence = render_markdown(GateResult.from_dict(payload))
        svc.policy.decide(ctx, hyp, payload["verdict"] or "escalate", evidence, ["escalate", "abandon"],
                          "look 2 of 1, 2, 5, 10")
        out["decide"].append(cap.bodies["decide"])
        diff = "\n".join(f"-lr = 3e-4\n+lr = {3e-4 * (1 + k / 100):.6g}" for k in range(40))
        out["summarize"].append(cap.bodies["decide"].replace("\\n## ", "\\n" + json.dumps(diff)[1:-1] + "\\n## ", 1))
    svc.workspace.repo.close()
    return out


@dataclass
class Built:
    days: int
    db: str
    root: Path
    url: str | None
    seconds: dict[str, float]
    facts: dict[str, Any]
    counts: dict[str, int]


def build_store(days: int, db: str, work: Path, args: argparse.Namespace, pool: dict, name: str | None = None) -> Built:
    import agent.ledger
    import agent.records
    import pipeline.lease
    from agent.config import open_lab
    from agent.labinit import init_lab
    from agent.records import Records
    from pipeline.store import Store

    rng = random.Random(args.seed * 1000 + days)
    t_all = time.perf_counter()
    root = work / (name or f"lab-{db}-{days}d")
    init_lab(root, suite="small", gpus=args.gpus)
    lab = open_lab(root)
    url = fresh_pg() if db == "postgresql" else None
    store = Store.for_lab(lab, url)
    Records(store)
    agent.ledger.Ledger(store.engine)
    pipeline.lease.holder(store)
    llm = prompt_bodies(lab, store, pool, rng)
    tasks = len(lab.tasks())
    g = lab.config.gate
    from pipeline.gate.protocol import get_protocol

    min_base = get_protocol(g.protocol).baseline_runs_at(1, g.baseline_runs)
    hyps, units = plan(rng, args.runs_per_day * days, tasks, list(g.looks), g.baseline_runs, g.noise_runs, min_base)
    end = time.time() - 60
    start = end - days * DAY
    scale = (days * DAY - 600) / units
    t = time.perf_counter()
    shas = build_git(root, hyps, start, scale, rng)
    t_git = time.perf_counter() - t
    t = time.perf_counter()
    loader = Loader(store.engine)
    build_rows(loader, lab, hyps, shas, start, scale, end, pool, llm, args, rng)
    if store.engine.dialect.name == "postgresql":
        from sqlalchemy import text

        with store.engine.begin() as c:  # explicit ids were inserted: the sequences move past them
            for tbl in ("run", "stage_exec", "hypothesis"):
                c.execute(text(f"SELECT setval(pg_get_serial_sequence('\"{tbl}\"', 'id'), "
                               f"(SELECT max(id) FROM \"{tbl}\"))"))
        with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
            c.execute(text("ANALYZE"))
    else:
        with store.engine.connect() as c:
            c.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    t_rows = time.perf_counter() - t
    store.dispose()
    facts = {"hypotheses": len(hyps), "measured": sum(h.kind != "reject" for h in hyps),
             "promotions": sum(h.promote for h in hyps), "runs": loader.counts["run"],
             "runs_per_day": loader.counts["run"] / days}
    return Built(days, db, root, url, {"git": t_git, "rows": t_rows, "total": time.perf_counter() - t_all}, facts,
                 dict(loader.counts))


def table_sizes(root: Path, url: str | None) -> dict[str, tuple[int, float]]:
    """{table: (rows, MB with its indexes)}."""
    import sqlalchemy

    from agent.config import open_lab
    from pipeline.store import default_url

    eng = sqlalchemy.create_engine(url or default_url(open_lab(root)))
    out: dict[str, tuple[int, float]] = {}
    with eng.connect() as c:
        names = [r[0] for r in c.execute(sqlalchemy.text(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public'" if url else
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"))]
        if url:
            sizes = {n: float(c.execute(sqlalchemy.text(f"SELECT pg_total_relation_size('\"{n}\"')")).scalar())
                     for n in names}
        else:
            owner = {n: t for n, t in c.execute(sqlalchemy.text("SELECT name, tbl_name FROM sqlite_master"))}
            sizes = {}
            for n, b in c.execute(sqlalchemy.text("SELECT name, SUM(pgsize) FROM dbstat GROUP BY name")):
                sizes[owner.get(n, n)] = sizes.get(owner.get(n, n), 0.0) + float(b)
        for n in names:
            rows = c.execute(sqlalchemy.text(f'SELECT count(*) FROM "{n}"')).scalar()
            out[n] = (int(rows or 0), sizes.get(n, 0.0) / (1 << 20))
    eng.dispose()
    return out


# ----------------------------------------------------------------------------- timing

PAGE = os.sysconf("SC_PAGE_SIZE")
EMPTY_TREE = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"
REPEAT_LIMIT_S = 20.0


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


@dataclass
class Timing:
    median_ms: float | None
    first_ms: float | None
    rss_mb: float | None
    note: str = ""


def measure(fn: Callable[[], Any], repeat: int, after: Callable[[Any], None] | None = None) -> Timing:
    trim()
    before, peak, stop = rss(), [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            stop.wait(0.01)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        t = time.perf_counter()
        out = fn()
        first = time.perf_counter() - t
    except Exception as e:  # noqa: BLE001 (said in the table, the traceback on stderr)
        import traceback

        stop.set()
        traceback.print_exc()
        return Timing(None, None, None, f"{type(e).__name__}: {str(e)[:60]}")
    finally:
        stop.set()
        th.join()
    if after is not None:
        after(out)
    grown = max(peak[0], rss()) - before
    times = []
    spent = first
    for _ in range(repeat):
        if spent > REPEAT_LIMIT_S:
            break
        t = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t
        if after is not None:
            after(out)
        times.append(dt)
        spent += dt
    return Timing(1000 * statistics.median(times) if times else 1000 * first, 1000 * first, grown / (1 << 20))


def cli_status(root: Path, url: str | None, repeat: int) -> Timing:
    """`autoresearch status --json` as a user runs it: a fresh process each time (wall, its own peak RSS)."""
    cmd = [str(CLI), "--repo", str(root), *(["--db", url] if url else []), "status", "--json"]
    # started from a small launcher: a child forked from this process (hundreds of MB after the
    # build) has this process's pages in its peak RSS until it execs, whatever it does itself
    launcher = ("import json, resource, subprocess, sys, time\n"
                "t = time.perf_counter()\n"
                "p = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)\n"
                "print(json.dumps([p.returncode, time.perf_counter() - t,"
                " resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, p.stderr.decode()[-80:]]))\n")
    walls, peaks = [], []
    for _ in range(1 + repeat):
        out = subprocess.run([sys.executable, "-c", launcher, *cmd], capture_output=True, text=True, check=True)
        code, wall, peak, err = json.loads(out.stdout)
        walls.append(wall)
        peaks.append(peak)
        if code:
            return Timing(None, None, None, f"exit {code}: {err}")
        if walls[-1] > REPEAT_LIMIT_S:
            break
    return Timing(1000 * statistics.median(walls[1:] or walls), 1000 * walls[0], max(peaks))


def time_calls(b: Built, repeat: int) -> tuple[dict[str, Timing], dict[str, float]]:
    """Every hot path against the store `b`, through the project's own functions."""
    from sqlmodel import select

    from agent import commands, pictures
    from agent.directions import group_directions
    from agent.graph import Services, build_context, proposal_context
    from agent.graph.implement import check_not_measured
    from agent.ledger import Ledger
    from agent.loop.guards import Guards
    from agent.policy_llm import LLMPolicy
    from agent.progress import split_progress
    from agent.records import Hypothesis, Records
    from agent.views import print_status
    from agent.workspace import Workspace
    from pipeline import labrepo
    from pipeline.api import Experiment, LabRepo, disk_usage, lab_pairing, lease
    from pipeline.store import Result, StageExec

    lab, store, rec = commands.open_lab_store(b.root, b.url)
    cap = Capture()
    svc = Services(lab, store, rec, Workspace(lab), LLMPolicy(cap), smoke=False)
    tasks = lab.tasks()
    with store.session() as s:
        last = s.exec(select(Hypothesis).where(Hypothesis.status == "done", Hypothesis.commit.is_not(None))
                      .order_by(Hypothesis.id.desc()).limit(1)).one()
        promoted = s.exec(select(Hypothesis.id).where(Hypothesis.decision == "promote")
                          .order_by(Hypothesis.id.desc()).limit(1)).first() or last.id
        failed = s.exec(select(Result.run_id).where(Result.outcome == "method_failure")
                        .order_by(Result.id.desc()).limit(1)).first()
        keys = list(s.exec(select(StageExec.key).where(StageExec.run_id == failed))) if failed else []
    sha, base = last.commit, last.base_commit

    class LoopGuards(Guards):  # the loop's guard state, as a fresh `Loop` starts with it
        def __init__(self) -> None:
            self.svc, self.records, self.policy, self.lab = svc, rec, svc.policy, lab
            self.backoff_until, self.llm_retry_at, self._budget_said = 0.0, 0.0, False
            self.stop = threading.Event()

        def say(self, msg: str) -> None:
            pass

    guards = LoopGuards()

    def baseline_tag(repo: Any) -> Any:
        return repo.baseline_tag(repo.baseline_head())
    st_holder: dict[str, Any] = {}

    def status_of() -> Any:
        st_holder["st"] = commands.status_of(lab, store, rec)
        return st_holder["st"]

    def propose() -> None:
        svc.policy.propose(proposal_context(svc))

    def print_st() -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            print_status(st_holder["st"])

    from starlette.testclient import TestClient

    from agent.web import make_app

    token = "t" * 32
    client = TestClient(make_app(b.root, b.url, token), base_url="http://127.0.0.1")

    def page(path: str) -> Callable[[], Any]:
        def get() -> Any:
            r = client.get(path)
            if r.status_code != 200:
                raise RuntimeError(f"GET {path}: {r.status_code}")
            return r
        return get

    now = time.time()
    calls: list[tuple[str, Callable[[], Any], Callable[[Any], None] | None]] = [
        ("proposal: build_context", lambda: build_context(svc), None),
        ("proposal: group_directions", lambda: group_directions(svc.workspace, store, rec), None),
        ("proposal: proposal_context + propose prompt", propose, None),
        ("loop: Guards.guard", guards.guard, None),
        ("loop: Records.since_promotion", rec.since_promotion, None),
        ("loop: Guards.next_hypothesis (opens one)", lambda: LoopGuards().next_hypothesis(),
         lambda h: h is not None and rec.delete(h.id)),
        ("implement: check_not_measured", lambda: check_not_measured(svc, Hypothesis(id=0), EMPTY_TREE), None),
        ("look: Experiment.histories (1st look)",
         lambda: Experiment(lab, store).histories(tasks, exclude=(sha, base)), None),
        ("look: Experiment.judge_look(look 1)", lambda: Experiment(lab, store).judge_look(base, sha, 1), None),
        ("driver: Store.method_failures(run keys)", lambda: store.method_failures(keys), None),
        ("summary: pictures.write_progress", lambda: pictures.write_progress(lab, store, rec), None),
        ("summary: progress_points+split_progress",
         lambda: (pictures.progress_points(store, rec), split_progress(lab, store, rec)), None),
        ("status: commands.status (the CLI's)", lambda: commands.status(b.root, b.url), None),
        ("status: status_of (store open)", status_of, None),
        ("status --json: json.dumps", lambda: json.dumps(st_holder["st"], sort_keys=True, indent=2, default=str),
         None),
        ("status: print_status (rich)", print_st, None),
        ("  Records(store) (open)", lambda: Records(store), None),
        ("  Records.all", rec.all, None),
        ("  Store.queue_counts", store.queue_counts, None),
        ("  Store.goodput()", store.goodput, None),
        ("  Store.goodput(since 24h) (digest)", lambda: store.goodput(since=now - DAY), None),
        ("  lab_pairing", lambda: lab_pairing(lab, store), None),
        ("  split_progress", lambda: split_progress(lab, store, rec), None),
        ("  split_progress (no generation cache: CLI)", lambda: (labrepo._generations.clear(),
                                                                 split_progress(lab, store, rec)), None),
        ("  disk_usage", lambda: disk_usage(lab, store), None),
        ("  llm_use (ledger)", lambda: commands.llm_use(lab, Ledger(store.engine)), None),
        ("  lease.holder", lambda: lease.holder(store), None),
        ("  LabRepo.baseline_tag(head)", lambda: baseline_tag(LabRepo(lab.root)), None),
        ("web: GET / (overview)", page("/"), None),
        ("web: GET /hypotheses", page("/hypotheses"), None),
        ("web: GET /hypotheses/{id}", page(f"/hypotheses/{promoted}"), None),
        ("web: GET /directions", page("/directions"), None),
        ("web: GET /timeline", page("/timeline"), None),
        ("digest --since 24h", lambda: commands.digest(b.root, b.url, "24h"), None),
    ]
    client.get(f"/files/none.png?token={token}")  # the token's cookie
    out: dict[str, Timing] = {}
    values: dict[str, float] = {}
    for name, fn, after in calls:
        print(f"  {name} ...", end="", flush=True)
        out[name] = measure(fn, repeat, after)
        t = out[name]
        print(f" {t.median_ms or 0:.1f} ms (first {t.first_ms or 0:.1f}, +{t.rss_mb or 0:.0f} MB) {t.note}", flush=True)
        if name.startswith("proposal: proposal_context"):
            values["proposal prompt (kB)"] = len(cap.bodies.get("propose", "")) / 1024
    print("  autoresearch status --json (a fresh process) ...", end="", flush=True)
    out["CLI: autoresearch status --json"] = cli_status(b.root, b.url, repeat)
    t = out["CLI: autoresearch status --json"]
    print(f" {t.median_ms or 0:.0f} ms (first {t.first_ms or 0:.0f}, peak {t.rss_mb or 0:.0f} MB) {t.note}", flush=True)
    values["status --json output (kB)"] = len(json.dumps(st_holder.get("st", {}), sort_keys=True, indent=2,
                                                         default=str)) / 1024
    client.close()
    svc.workspace.repo.close()
    store.dispose()
    return out, values


# ----------------------------------------------------------------------------- the table

def render(built: list[Built], timings: dict[tuple[str, int], dict[str, Timing]],
           values: dict[tuple[str, int], dict[str, float]], sizes: dict[tuple[str, int], dict[str, tuple[int, float]]],
           top: int) -> str:
    cols = [(b.db, b.days) for b in built]
    w = 44
    head = f"{'call':{w}}" + "".join(f" | {f'{db} {d}d':^24}" for db, d in cols)
    sub = f"{'':{w}}" + "".join(f" | {'ms':>8} {'1st':>8} {'MB':>5}" for _ in cols)
    lines = [head, sub, "-" * len(sub)]
    names = list(timings[cols[0]])
    for name in names:
        cells = []
        for c in cols:
            t = timings[c].get(name)
            if t is None or t.median_ms is None:
                cells.append(f" | {(t.note if t else '-')[:24]:>24}")
            else:
                cells.append(f" | {t.median_ms:8.1f} {t.first_ms:8.1f} {t.rss_mb:5.0f}")
        lines.append(f"{name[:w]:{w}}" + "".join(cells))
    for name in values[cols[0]]:
        lines.append(f"{name[:w]:{w}}" + "".join(f" | {values[c].get(name, 0):8.1f} {'':8} {'':5}" for c in cols))
    lines.append("-" * len(sub))
    lines.append(f"{'table (rows; MB with its indexes)':{w}}" + "".join(f" | {'rows':>12} {'MB':>10}" for _ in cols))
    last = sizes[cols[-1]]
    biggest = sorted(last, key=lambda n: -last[n][1])[:top]
    for n in biggest:
        lines.append(f"{n:{w}}" + "".join(f" | {sizes[c].get(n, (0, 0))[0]:12d} {sizes[c].get(n, (0, 0))[1]:10.1f}"
                                          for c in cols))
    lines.append(f"{'all tables':{w}}" + "".join(
        f" | {sum(r for r, _ in sizes[c].values()):12d} {sum(m for _, m in sizes[c].values()):10.1f}" for c in cols))
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs-per-day", type=int, default=1000)
    p.add_argument("--days", type=int, nargs="+", default=[30, 365])
    p.add_argument("--db", nargs="+", default=["sqlite"], choices=["sqlite", "postgresql"])
    p.add_argument("--repeat", type=int, default=3, help="calls after the first (median reported)")
    p.add_argument("--gpu-usage-every-s", type=float, default=None,
                   help="one gpu_usage row per this many seconds of wall time (default: as the driver writes them: "
                        "gpu_accounting.GPU_USAGE_ROW_S where it has one, else runner.GPU_USAGE_EVERY_S)")
    p.add_argument("--gpus", type=float, default=0.25, help="the lab's [run] gpus (each stage's share)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workdir", type=Path, default=None, help="where the labs go (default: a fresh temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the labs and stores")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.gpu_usage_every_s is None:
        from pipeline import gpu_accounting, runner

        args.gpu_usage_every_s = float(getattr(gpu_accounting, "GPU_USAGE_ROW_S", runner.GPU_USAGE_EVERY_S))
    import logging

    logging.basicConfig(level=logging.ERROR, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.pop("OPENAI_API_KEY", None)
    os.environ.pop("OPENAI_BASE_URL", None)
    # the code measured: the tree as this process imports it, now (a file changed later is not what ran)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=False).stdout.strip()
    dirty = [line[3:] for line in subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                                 capture_output=True, text=True, check=False).stdout.splitlines()]
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="longrun-", dir=args.workdir))
    from agent.config import open_lab
    from agent.labinit import init_lab

    rng = random.Random(args.seed)
    t = time.perf_counter()
    init_lab(work / "pool-lab", suite="small", gpus=args.gpus)
    pool = gate_pool(open_lab(work / "pool-lab"), rng)
    print(f"gate records: {sum(len(v) for k, v in pool.items() if not k[1].startswith('s:'))} real ones "
          f"({', '.join(sorted({k[1] for k in pool if not k[1].startswith('s:')}))}) in {time.perf_counter() - t:.0f} s",
          flush=True)
    built: list[Built] = []
    timings, values, sizes = {}, {}, {}
    # every call once on a small store first: imports and one-time set-up are not charged to the first size
    warm = argparse.Namespace(**{**vars(args), "runs_per_day": 200})
    t = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        time_calls(build_store(1, "sqlite", work, warm, pool, "warm-up-lab"), 0)
    print(f"warm-up on a 1-day store: {time.perf_counter() - t:.0f} s", flush=True)
    try:
        for db in args.db:
            for days in sorted(args.days):
                print(f"building {db} {days} days at {args.runs_per_day} runs/day ...", flush=True)
                b = build_store(days, db, work, args, pool)
                built.append(b)
                print(f"  built in {b.seconds['total']:.0f} s (git {b.seconds['git']:.0f} s, rows "
                      f"{b.seconds['rows']:.0f} s): {b.facts['hypotheses']} hypotheses ({b.facts['measured']} measured, "
                      f"{b.facts['promotions']} promoted), {b.facts['runs']} runs ({b.facts['runs_per_day']:.0f}/day)",
                      flush=True)
                sizes[db, days] = table_sizes(b.root, b.url)
                print(f"  {sum(m for _, m in sizes[db, days].values()):.0f} MB in the store; timing ...", flush=True)
                timings[db, days], values[db, days] = time_calls(b, args.repeat)
    finally:
        if not args.keep:
            for b in built:
                if b.url:
                    drop_pg(b.url)
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept: {work}")
    cmd = "benchmarks/long_run.py " + " ".join(sys.argv[1:])
    builds = "; ".join(f"{b.db} {b.days}d: built in {b.seconds['total']:.0f} s (git {b.seconds['git']:.0f} s, rows "
                       f"{b.seconds['rows']:.0f} s), {b.facts['hypotheses']} hypotheses, {b.facts['promotions']} "
                       f"promoted, {b.facts['runs']} runs" for b in built)
    text = (f"$ .venv/bin/python {cmd}\n# {time.strftime('%Y-%m-%d %H:%M')} at {head}"
            f"{' with ' + ', '.join(dirty) + ' modified' if dirty else ''}, on {os.cpu_count()} cores; "
            f"{args.runs_per_day} runs/day, gpu_usage every {args.gpu_usage_every_s:g} s; ms: median of "
            f"{args.repeat} calls after the first; 1st: the first call; MB: peak RSS above the start of the first call "
            f"(CLI: the process's own peak)\n# {builds}\n"
            f"{render(built, timings, values, sizes, top=12)}\n")
    print("\n" + text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps({
            "builds": [{"db": b.db, "days": b.days, "seconds": b.seconds, "facts": b.facts, "counts": b.counts}
                       for b in built],
            "timings": {f"{db} {d}": {k: t.__dict__ for k, t in v.items()} for (db, d), v in timings.items()},
            "values": {f"{db} {d}": v for (db, d), v in values.items()},
            "sizes": {f"{db} {d}": v for (db, d), v in sizes.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
