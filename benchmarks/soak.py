"""24/7 soak: the loop under chaos, measured in one run.

    .venv/bin/python benchmarks/soak.py --minutes 60 [--kill-every 90] [--outage-every 900] [--json]

The tests' tiny lab (the bundled benchmark, shrunk), the LLM policy against a flaky local
OpenAI-compatible server (`FlakyModel`: a scripted "model" that proposes and implements real
config.toml changes, answering with random 5xx, timeouts past the client's bound and garbage, and
going away entirely — the port closed, connections refused — for 30-120 s every `--outage-every`
seconds), the store on PostgreSQL (a fresh database on 127.0.0.1:5432), the cache capped low
enough to evict. `autoresearch run --forever` runs as a real process; a chaos thread kill -9s the
driver or one of its workers (the warm worker, a stage) every ~`--kill-every` seconds, and the
supervisor here restarts the driver whenever it is gone, like systemd would.

Reports: hypotheses decided, kills, LLM outages, runs lost (given up as infrastructure failures)
and duplicated (two results for one run, or one run queued twice), resume time after each driver
kill (until the new driver holds the lab's lease and every run of the dead one is back in the
queue), the driver's RSS growth over lifetimes of 5 minutes or more (from 2 minutes in, after the
lazy imports; with kills every ~90 s no lifetime is that long: `--kill-every 100000` measures it), disk use over time against the cap, goodput and the
compute lost to infrastructure. Targets (issue 14): 0 lost, 0 duplicated, resume ≤ 10 s, RSS growth
< 50 MB, disk within `cache_max_gb` (beyond it only what the baseline and runs in flight need),
lost work > 0 s in goodput. `tests/test_soak.py` runs a 5-minute version.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from support.lab import DUMMY_KEY, SUMMARY, asked_name, cli_env, copy_lab, free_port, make_template  # noqa: E402
from support.fake_openai import FakeOpenAI, Step, content, garbage, server_error, stall  # noqa: E402

PG_ADMIN = os.environ.get("AUTORESEARCH_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
REQUEST_TIMEOUT_S = 4
CACHE_MAX_GB = 0.0004  # ~0.4 MB: the lab's entries are tens of kB, so this evicts
KNOBS = {"lr": ["1e-4", "2e-4", "4e-4", "5e-4", "7e-4", "1e-3", "1.5e-3", "2e-3", "3e-3", "5e-3"],
         "lora_rank": ["2", "6", "8", "12", "16", "32"], "cross_layers": ["1", "3", "4"],
         "head_lr": ["5e-4", "1e-3", "3e-3", "5e-3"], "weight_decay": ["0.0", "0.001", "0.05", "0.1"],
         "batch_size": ["64", "96", "256"]}
CUSTOMERS = 1200  # the tests' lab has 300: stages of a few seconds, so that kills land mid-stage


class FlakyModel(FakeOpenAI):
    """A "model" that proposes one [finetune] change at a time and implements it against the file it
    is shown, behind an unreliable endpoint. `outage()` closes the port for a while."""

    def __init__(self, port: int, rng: random.Random, p_error: float = 0.08, p_timeout: float = 0.04,
                 p_garbage: float = 0.06):
        super().__init__(api_key=DUMMY_KEY)
        self.port, self.rng = port, rng
        self.p = (p_error, p_timeout, p_garbage)
        self.faults = {"5xx": 0, "timeout": 0, "garbage": 0}
        self.outages: list[tuple[float, float]] = []

    def start(self) -> FlakyModel:  # on a fixed port, so that the driver finds it again after an outage
        from http.server import ThreadingHTTPServer

        from support.fake_openai import _Handler

        ThreadingHTTPServer.allow_reuse_address = True
        server = ThreadingHTTPServer(("127.0.0.1", self.port), _Handler)
        server.daemon_threads = True
        server.fake = self  # type: ignore[attr-defined]
        self._server = server
        self._stopping.clear()
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def outage(self, seconds: float) -> None:
        t0 = time.time()
        self.stop()  # connections refused from now on
        time.sleep(seconds)
        self.start()
        self.outages.append((t0, time.time()))

    def _next_step(self, body: dict[str, Any]) -> Step:
        r = self.rng.random()
        e, t, g = self.p
        if r < e:
            self.faults["5xx"] += 1
            return server_error(self.rng.choice([500, 502, 503]))
        if r < e + t:
            self.faults["timeout"] += 1
            return stall(REQUEST_TIMEOUT_S + 2)
        if r < e + t + g:
            self.faults["garbage"] += 1
            return garbage()
        name = asked_name(body)
        text = "\n".join(m.get("content") or "" for m in body.get("messages", []) if isinstance(m.get("content"), str))
        if name == "hypothesis":
            key = self.rng.choice(sorted(KNOBS))
            value = self.rng.choice(KNOBS[key])
            return content({"title": f"Fine-tune with {key} = {value}", "rationale": "Soak test proposal.",
                            "expected_effect": "+0.002 AUC on every task", "tasks_expected": [],
                            "change": f"CHANGE finetune.{key} = {value}"})
        if name == "edits":
            return content(self._edits(text))
        if name == "decision":
            schema = (body.get("response_format") or {}).get("json_schema", {}).get("schema") or \
                ((body.get("tools") or [{}])[0].get("function", {}).get("parameters") or {})
            allowed = schema.get("properties", {}).get("decision", {}).get("enum", ["abandon"])
            pick = next((d for d in ("promote", "escalate", "abandon") if d in allowed), allowed[0])
            return content({"decision": pick, "rationale": "As the gate says.", "follow_up": ""})
        if name == "summary":
            return content(SUMMARY)
        return server_error(400)

    @staticmethod
    def _edits(text: str) -> dict[str, Any]:
        m = re.search(r"CHANGE finetune\.(\w+) = (\S+)", text)
        block = re.search(r"### config\.toml\n\n```\n(.*?)\n```", text, re.DOTALL)
        if not m or not block:
            return {"edits": [], "notes": "nothing to do"}
        key, value = m.groups()
        section = re.search(r"(?ms)^\[finetune\]\n.*?(?=^\[|\Z)", block.group(1))
        if section is None:
            return {"edits": [], "notes": "no [finetune]"}
        old = section.group(0)
        new = re.sub(rf"(?m)^{key} = \S+", f"{key} = {value}", old, count=1)
        return {"edits": [{"path": "config.toml", "search": old, "replace": new, "content": None}],
                "notes": f"finetune.{key} = {value}"}




def fresh_database() -> tuple[str, Any]:
    import psycopg

    admin = psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=5)
    name = "ar_soak_" + uuid.uuid4().hex[:10]
    admin.execute(f"create database {name}")
    return "postgresql+psycopg://" + PG_ADMIN.split("://", 1)[1].rsplit("/", 1)[0] + "/" + name, (admin, name)


def make_lab(tmp: Path) -> Path:
    template = make_template(tmp / "template" / "lab")
    lab = copy_lab(template, tmp / "soak" / "lab")
    research = (lab / "research.toml").read_text()
    research = research.replace("max_in_flight = 1", "max_in_flight = 2")
    research = research.replace("customers = 300", f"customers = {CUSTOMERS}")
    research = research.replace('model = "gpt-4.1-mini"', f'model = "gpt-4.1-mini"\nrequest_timeout_s = {REQUEST_TIMEOUT_S}'
                                f"\nrequest_attempts = 3")
    research = research.replace("[run]\n", f"[run]\ncache_max_gb = {CACHE_MAX_GB}\n")
    (lab / "research.toml").write_text(research)
    subprocess.run(["git", "-C", str(lab), "commit", "-qam", "soak settings"], check=True)
    subprocess.run(["git", "-C", str(lab), "branch", "-f", "autoresearch/baseline", "HEAD"], check=True)
    return lab


class Soak:
    def __init__(self, lab: Path, db: str, model: FlakyModel, minutes: float, kill_every: float, outage_every: float,
                 rng: random.Random):
        self.lab, self.db, self.model, self.rng = lab, db, model, rng
        self.deadline = time.monotonic() + minutes * 60
        self.kill_every, self.outage_every = kill_every, outage_every
        self.env = cli_env(OPENAI_BASE_URL=f"http://127.0.0.1:{model.port}/v1", OPENAI_API_KEY=DUMMY_KEY)
        self.proc: subprocess.Popen[bytes] | None = None
        self.lock = threading.Lock()
        self.kills: list[dict[str, Any]] = []
        self.resumes: list[float] = []
        self.lifetimes: list[dict[str, Any]] = []
        self.disk: list[tuple[float, float]] = []
        self.stop = threading.Event()
        self.log = open(lab.parent / "driver.log", "ab")

    # the driver and its supervisor ---------------------------------------------------------------

    def start_driver(self, after_kill_of: int | None) -> None:
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agent.cli", "--repo", str(self.lab), "--db", self.db, "run", "--forever"],
            cwd=REPO, env=self.env, stdout=self.log, stderr=self.log, start_new_session=True)
        self.lifetimes.append({"pid": self.proc.pid, "started": time.time(), "rss": []})
        if after_kill_of is not None:
            self.resumes.append(self._resumed(self.proc.pid, after_kill_of, t0))

    def _resumed(self, pid: int, dead: int, t0: float) -> float:
        """Seconds until the new driver holds the lease and no run of the dead one is 'running'."""
        from pipeline.lease import Lease
        from pipeline.store import Run, Store
        from sqlmodel import select

        store = Store(self.db, create=False)
        try:
            while time.monotonic() - t0 < 120:
                with store.session() as s:
                    lease = s.get(Lease, "driver")
                    orphans = s.exec(select(Run).where(Run.status == "running", Run.owner_pid == dead)).all()
                if lease is not None and lease.pid == pid and not orphans:
                    return time.monotonic() - t0
                if self.proc is None or self.proc.poll() is not None:
                    return time.monotonic() - t0  # killed again before it resumed: counted as it stood
                time.sleep(0.1)
            return time.monotonic() - t0
        finally:
            store.dispose()

    def supervise(self) -> None:
        self.start_driver(None)
        while time.monotonic() < self.deadline:
            time.sleep(0.2)
            with self.lock:
                if self.proc is not None and self.proc.poll() is not None:
                    dead = self.proc.pid
                    self.start_driver(dead)
        self.stop.set()

    # chaos ---------------------------------------------------------------------------------------

    def chaos(self) -> None:
        import psutil

        while not self.stop.wait(self.rng.uniform(0.4, 1.6) * self.kill_every):
            with self.lock:
                if self.proc is None or self.proc.poll() is not None:
                    continue
                driver = psutil.Process(self.proc.pid)
                stage: int | None = None
                workers = [p for p in driver.children(recursive=True) if p.is_running()]
                # the worst moment: stages of this driver mid-flight. Until one such kill has landed,
                # every kill is a driver kill that waits for a running stage (as long as the soak
                # lasts), so a short soak has one for certain
                owed = not any(k["mid_stage"] for k in self.kills)
                if workers and not owed and self.rng.random() < 0.4:
                    warm = [p for p in workers if "zygote" in " ".join(_cmd(p))]
                    target = self.rng.choice(warm or workers)
                    what = "warm worker" if warm else "worker"
                else:
                    target, what = driver, "driver"
                    if owed or self.rng.random() < 0.5:
                        stage = self._wait_for_stage(driver.pid, self._left() if owed else 15)
                        if stage is None and owed:
                            continue  # the soak ended (or the driver died) before a stage ran
                try:
                    target.send_signal(signal.SIGKILL)
                except psutil.Error:
                    continue
                mid_stage = False
                if what == "driver":
                    self.proc.wait()
                    try:  # its warm worker dies with it (PDEATHSIG); make sure no stage of it goes on
                        os.killpg(self.proc.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                    # landed mid-stage for certain: a stage of the dead driver is still recorded
                    # running (the next driver reconciles it only after this lock is released)
                    mid_stage = self._still_running(target.pid)
                self.kills.append({"at": time.time(), "what": what, "pid": target.pid, "mid_stage": mid_stage})

    def _wait_for_stage(self, pid: int, timeout: float) -> int | None:
        """The id of a stage execution of driver `pid` that is running now, waiting up to `timeout`."""
        from sqlmodel import select

        from pipeline.store import Run, StageExec, Store

        store = Store(self.db, create=False)
        try:
            t0 = time.monotonic()
            while time.monotonic() - t0 < timeout and not self.stop.is_set() and self.proc is not None \
                    and self.proc.pid == pid and self.proc.poll() is None:
                with store.session() as s:
                    q = select(StageExec.id).join(Run, Run.id == StageExec.run_id).where(
                        StageExec.outcome == "running", Run.owner_pid == pid)
                    found = s.exec(q).first()
                if found is not None:
                    return int(found)
                time.sleep(0.2)
            return None
        finally:
            store.dispose()

    def _left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def _still_running(self, pid: int) -> bool:
        """Whether a stage execution of (dead) driver `pid` is still recorded running."""
        from sqlmodel import select

        from pipeline.store import Run, StageExec, Store

        store = Store(self.db, create=False)
        try:
            with store.session() as s:
                q = select(StageExec.id).join(Run, Run.id == StageExec.run_id).where(
                    StageExec.outcome == "running", Run.owner_pid == pid)
                return s.exec(q).first() is not None
        finally:
            store.dispose()

    def outages(self) -> None:
        while not self.stop.wait(self.rng.uniform(0.7, 1.3) * self.outage_every):
            if time.monotonic() + 40 > self.deadline:
                return
            self.model.outage(self.rng.uniform(30, 120) if self.outage_every >= 300 else 30)

    def sample(self) -> None:
        import psutil

        from pipeline.disk import tree_bytes

        while not self.stop.wait(5):
            with self.lock:
                proc, life = self.proc, self.lifetimes[-1] if self.lifetimes else None
            if proc is not None and proc.poll() is None and life is not None:
                try:
                    life["rss"].append((time.time() - life["started"], psutil.Process(proc.pid).memory_info().rss))
                except psutil.Error:
                    pass
            if len(self.disk) == 0 or time.time() - self.disk[-1][0] > 30:
                self.disk.append((time.time(), tree_bytes(self.lab / "runs" / "cache") / 2**20))

    def run(self) -> dict[str, Any]:
        threads = [threading.Thread(target=f, daemon=True) for f in (self.chaos, self.outages, self.sample)]
        t0 = time.time()
        for t in threads:
            t.start()
        self.supervise()
        with self.lock:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
        for t in threads:
            t.join(timeout=150)
        return self.report(time.time() - t0)

    # the report ----------------------------------------------------------------------------------

    def report(self, wall_s: float) -> dict[str, Any]:
        from sqlmodel import func, select

        from pipeline.store import Result, Run, Store

        status = json.loads(subprocess.run(
            [sys.executable, "-m", "agent.cli", "--repo", str(self.lab), "--db", self.db, "status", "--json"],
            cwd=REPO, env=self.env, capture_output=True, text=True, timeout=300).stdout)
        store = Store(self.db, create=False)
        with store.session() as s:
            dup_results = s.exec(select(Result.commit, Result.task, Result.seed, func.count()).group_by(
                Result.commit, Result.task, Result.seed).having(func.count() > 1)).all()
            dup_runs = s.exec(select(Run.commit, Run.task, Run.seed, func.count()).group_by(
                Run.commit, Run.task, Run.seed).having(func.count() > 1)).all()
            lost = s.exec(select(func.count()).select_from(Result).where(Result.outcome == "infra_failure")).one()
            requeues = s.exec(select(func.coalesce(func.sum(Run.requeues), 0))).one()
            from agent.records import Hypothesis, LoopEvent

            errors = [h.reject_reason for h in s.exec(select(Hypothesis).where(Hypothesis.reject_kind == "internal_error"))]
            errors += [e.message for e in s.exec(select(LoopEvent).where(LoopEvent.kind == "error"))]
        store.dispose()
        growth = []
        for life in self.lifetimes:
            # from 2 minutes in (the lazy imports — gate statistics, matplotlib for the pictures, the
            # LLM client — are done by then) to the end of a lifetime of at least 5 minutes: a leak
            rss = [r for t, r in life["rss"] if t >= 120]
            if life["rss"] and life["rss"][-1][0] >= 300 and len(rss) >= 2:
                growth.append((rss[-1] - rss[0]) / 2**20)
        startup = [(max(r for _, r in life["rss"]) - life["rss"][0][1]) / 2**20 for life in self.lifetimes
                   if len(life["rss"]) >= 2]
        hyps = status["hypotheses"]
        compute = status["compute"]
        return {
            "minutes": round(wall_s / 60, 1),
            "hypotheses_decided": sum(h["status"] == "done" for h in hyps),
            "promotions": sum(bool(h["promoted_tag"]) for h in hyps),
            "rejected": status["rejected"],
            "kills": {"total": len(self.kills), **{w: sum(k["what"] == w for k in self.kills)
                                                    for w in ("driver", "warm worker", "worker")},
                      "mid_stage": sum(k["mid_stage"] for k in self.kills)},
            "llm_outages": len(self.model.outages),
            "llm_faults": self.model.faults,
            "runs_lost": int(lost),
            "runs_duplicated": len(dup_results) + len(dup_runs),
            "runs_requeued": int(requeues),
            "resume_s": {"max": round(max(self.resumes), 2) if self.resumes else None,
                         "median": round(sorted(self.resumes)[len(self.resumes) // 2], 2) if self.resumes else None,
                         "n": len(self.resumes)},
            "driver_rss_growth_mb": {"max": round(max(growth), 1) if growth else None, "lifetimes": len(growth),
                                     "note": "from 2 min in to the end, lifetimes of 5 min or more"},
            "driver_rss_startup_mb": {"max": round(max(startup), 1) if startup else None,
                                      "note": "first sample to peak, any lifetime: lazy imports included"},
            "driver_rss_mb_last": round(self.lifetimes[-1]["rss"][-1][1] / 2**20, 1)
            if self.lifetimes and self.lifetimes[-1]["rss"] else None,
            "disk_cache_mb": {"max": round(max(d for _, d in self.disk), 3) if self.disk else None,
                              "cap_mb": CACHE_MAX_GB * 1024, "series": [round(d, 3) for _, d in self.disk]},
            "disk": status.get("disk"),
            "errors": errors[:20],
            "goodput": round(compute["goodput"], 4),
            "infra_lost_cpu_s": round(compute["infra_lost_cpu_s"], 1),
            "useful_cpu_s": round(compute["useful_cpu_s"], 1),
        }


def _cmd(p: Any) -> list[str]:
    try:
        return p.cmdline()
    except Exception:  # psutil.Error: it just exited
        return []


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=60)
    ap.add_argument("--kill-every", type=float, default=90, help="mean seconds between kills")
    ap.add_argument("--outage-every", type=float, default=900, help="mean seconds between LLM outages")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    db, (admin, name) = fresh_database()
    model = FlakyModel(free_port(), rng).start()
    try:
        with tempfile.TemporaryDirectory(prefix="ar-soak-") as tmp:
            lab = make_lab(Path(tmp))
            out = Soak(lab, db, model, args.minutes, args.kill_every, args.outage_every, rng).run()
    finally:
        model.stop()
        admin.execute(f"drop database {name} with (force)")
        admin.close()
    if args.json:
        print(json.dumps(out, indent=2))
        return
    for k, v in out.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
