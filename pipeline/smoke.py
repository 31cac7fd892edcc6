"""The smoke run: a candidate implementation runs its whole stage DAG on a tiny dataset first.

Part of the measurement API (`pipeline.experiment.Experiment.smoke`).

Minutes of benchmark compute are not spent on code that crashes in its first second. The smoke run
uses the same stage commands, a scrubbed environment, the sealed scorer, and a throwaway copy of
the files (the baseline's tree plus the edited files), so it needs no worktree and no commit.

Stages run in a warm worker of the smoke run's own (`SmokeRunner`: the local executor with one
slot, torch and peft imported once), so a smoke run costs a second, not two interpreter start-ups.
It is not the driver's executor: that one's results are polled by the driver. If the worker cannot
be used, a stage runs in a fresh interpreter with the same sandbox (`pipeline.isolation.run_once`).
A GPU lab's smoke stages get what an executor stage gets: `[run] gpus` of this machine's GPUs, taken
from the pool the driver's slots take from (`executors.gpus.GpuPool`: a busy GPU is waited for,
never oversubscribed), their device nodes in the sandbox, and no address-space rlimit.
Where this machine has no GPU but the driver's executor does (a Ray cluster of GPU nodes), a GPU
lab's smoke stages run on that executor, ahead of its queue (`RayExecutor.run_ahead`).

What a smoke run spends is counted (`SmokeCost`: its stages' CPU seconds, their GPU-seconds as share ×
wall, and those of the harness's calls for it, its dataset's `prepare` and its `score`; the whole
run's wall time) and booked by `Experiment.smoke` in the store's `smoke_exec`, so the
books show what screening costs beside what measuring does.

The tiny dataset is the harness's smoke dataset (`Harness.prepare(..., smoke=True)`): drawn apart
from the real one, no customer or id in common. A failure's reason is what flows back to the LLM's
repair prompt, so it is `for_llm`'s view of the output: bounded, data paths as placeholders, every
number that could be a data value masked; the whole logs stay under `runs/logs/smoke/`.
"""

from __future__ import annotations

import os
import re
import tarfile
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path
from typing import Any

import git

from pipeline import isolation, safefs
from pipeline.dag import render
from pipeline.disk import read_tail
from pipeline.errors import Interrupted, MethodFailure
from pipeline.harness import Prepared
from pipeline.lab import Lab

SMOKE_CUSTOMERS = 300
TAIL_BYTES = 3000  # of a failed smoke stage's log, read for the reject reason (`for_llm` keeps less)
FEEDBACK_BYTES = 2000  # the most of a failure that flows back to the LLM; below TAIL_BYTES, so a tail cut mid-line never shows its cut first line
LINE_CHARS = 300  # each line of it, cut at its end: an exception's type and message come first
SMALL_INT_DIGITS = 3  # integers up to 999 pass (shapes, sizes, exit codes, indices); longer ones and any decimal are masked
MASK = "<n>"
SMOKE_TIMEOUT_S = 300.0  # the most a smoke stage may take on tiny data, however long the lab's `[run] timeout_s`


@dataclass
class SmokeCost:
    """What one smoke run spent: its stage attempts, their CPU seconds (with the children they waited
    for), their GPU-seconds (the share they held × their wall time), and where they ran (`here`, or the
    lending executor's name). A stage lost to the machinery (a dead worker, a CUDA OOM beside a
    neighbour) and run again counts twice, as it was spent."""

    stages: int = 0
    cpu_s: float = 0.0
    gpu_s: float = 0.0
    where: str = "here"
    gpu_from: float | None = None  # (UNIX time) the first GPU stage's start and the last one's end
    gpu_to: float | None = None

    def add(self, cpu_s: float, wall_s: float, gpus: float) -> None:
        """One stage attempt, just ended."""
        wall = max(0.0, float(wall_s or 0.0))
        self.stages += 1
        self.cpu_s += max(0.0, float(cpu_s or 0.0))
        self.gpu_s += wall * gpus
        if gpus and wall:
            end = time.time()
            self.gpu_from = min(self.gpu_from if self.gpu_from is not None else end - wall, end - wall)
            self.gpu_to = end

    def add_result(self, res: Any, gpus: float) -> None:
        """A stage's executor result: its GPU share as held (`gpu_share`: a CUDA OOM's retry held its GPU
        whole), and a first attempt lost to that OOM (`gpu_oom_retried_alone`) as an attempt of its own."""
        self.add(res.cpu_s, res.wall_s, float(res.extra.get("gpu_share", gpus)))
        lost = res.extra.get("gpu_oom_retried_alone")
        if lost:
            self.stages += 1
            self.cpu_s += float(lost["cpu_s"])
            self.gpu_s += float(lost["gpu_s"])

    def add_meter(self, meter: isolation.Meter) -> None:
        """A call of the harness (the smoke dataset's `prepare`, the `score`), not a stage."""
        self.cpu_s += meter.cpu_s
        self.gpu_s += meter.gpu_s


def smoke_timeout(lab: Lab) -> float:
    """A smoke stage's limit: the lab's `[run] timeout_s`, or `SMOKE_TIMEOUT_S` if that is smaller."""
    return min(lab.config.run.timeout_s, SMOKE_TIMEOUT_S)


def materialize(repo_git, base: str, files: dict[str, str], dst: Path) -> None:
    """The tree of `base` with `files` overwritten, written to `dst`.

    Laid out and edited without following any link (`pipeline.safefs`): a tree holding a link whose
    final target leaves it, or an edit whose path goes through a link, raises `UnsafeTree`."""
    data = repo_git.archive(base, format="tar", output_stream=None, as_process=False, stdout_as_string=False)
    safefs.extract_tar(BytesIO(data), dst, what=f"the tree of {base[:12]}")
    root_fd = safefs.open_root(dst)
    try:
        for path, text in files.items():
            safefs.write_text(root_fd, path, text)
    finally:
        os.close(root_fd)
    safefs.check_links(dst, f"the tree of {base[:12]} with the edits")


class SmokeRunner:
    """Runs smoke stages in a warm worker, started on first use; `close()` stops it."""

    def __init__(self, lab: Lab, lender: Any = None):
        self.lab = lab
        # the driver's executor, where its machines hold GPUs (`run_ahead`: a Ray cluster of GPU nodes)
        self.lender = lender if lender is not None and hasattr(lender, "run_ahead") else None
        self._executor: Any = None
        self._here: bool | None = None
        self._slot: Any = None  # the lender's slot this smoke run holds (`release` gives it back)

    @property
    def remote(self) -> bool:
        """Whether smoke stages run on the driver's executor: a GPU lab, that executor can lend a
        slot, and this machine cannot give its stages their `[run] gpus`."""
        if self._here is None:
            from pipeline.executors.gpus import capacity
            from pipeline.executors.local import visible_gpus

            share = self.lab.config.run.gpus
            self._here = not share or capacity(share, len(visible_gpus())) >= 1
        return not self._here and self.lender is not None and not self.lender.closed

    @property
    def gpus(self) -> float:
        """`[run] gpus` where this machine (or the lending executor) has them; 0 where neither does:
        the smoke run then runs on this CPU, and a stage that requires CUDA fails it."""
        return self.lab.config.run.gpus if (self.remote or self._here) else 0.0

    def executor(self) -> Any:
        if self._executor is None:
            from pipeline.executors.local import DEFAULT_PRELOAD, LocalExecutor
            from pipeline.scoring import harness_runner

            run = self.lab.config.run
            logs = self.lab.state / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            self._executor = LocalExecutor(cpus=run.cpus, gpus=self.gpus, slots=1, worker_log=logs / "smoke-worker.log",
                                           preload=DEFAULT_PRELOAD if run.preload is None else run.preload,
                                           priority=True,  # the driver's executor yields it the next free share
                                           # and `score`'s room kept, unless they run on the cluster
                                           reserve=0.0 if harness_runner(self.lender) else max(run.prepare_gpus, run.score_gpus))
        return self._executor

    def job(self, argv: list[str], cwd: Path, out: Path, log: Path, timeout_s: float, inputs: list[Path] = (),
            gpus: float | None = None) -> Any:
        """The `StageJob` of one smoke stage: an executor stage's GPUs (`gpus`, default `self.gpus`),
        sandbox and memory bound."""
        from pipeline.executors import StageJob
        from pipeline.executors.base import lab_env

        gpus = self.gpus if gpus is None else gpus
        return StageJob(job_id=uuid.uuid4().hex, argv=argv, cwd=cwd, commit="smoke", out=out, log_path=log,
                        timeout_s=timeout_s, cpus=self.lab.config.run.cpus, gpus=gpus, inputs=tuple(inputs),
                        memory_mb=isolation.once_memory_mb(self.lab, gpus=gpus),
                        sandbox=isolation.spec_for(self.lab, ro=[cwd, *inputs], out=out),
                        env=lab_env(self.lab.config.run.env))

    def run_stage(self, argv: list[str], cwd: Path, out: Path, log: Path, timeout_s: float,
                  stop: threading.Event | None, inputs: list[Path] = (),
                  cost: SmokeCost | None = None) -> tuple[int, str]:
        """(exit code, output tail) of one stage in its sandbox; raises MethodFailure on timeout or
        signal, Interrupted on stop. What it spent is added to `cost`."""
        from pipeline.executors import InfrastructureFailure

        cost = cost if cost is not None else SmokeCost()

        remote = self.remote  # decided once per stage: where it runs, with which GPUs
        if not remote and not self._here and self.lender is not None:  # the lender closed under this smoke run
            if stop is not None and stop.is_set():
                raise Interrupted("stopping: smoke run abandoned")
            raise InfrastructureFailure("the executor that runs this lab's GPU smoke stages was closed")
        job = self.job(argv, cwd, out, log, timeout_s, inputs, gpus=self.lab.config.run.gpus if remote else None)
        if remote:
            cost.where = self.lender.name
            return self._remote(job, timeout_s, stop, cost)
        try:
            ex = self.executor()
            ex.submit(job)
        except InfrastructureFailure as e:
            log.write_text(f"(smoke worker unavailable: {e}; running in a fresh interpreter)\n")
            return self._once(argv, cwd, out, log, timeout_s, inputs, cost)
        while True:
            for res in ex.poll(0.2):
                if res.job_id != job.job_id:
                    continue
                cost.add_result(res, job.gpus)
                if res.status == "infra":  # the worker died, not the candidate: run it on its own
                    return self._once(argv, cwd, out, log, timeout_s, inputs, cost)
                return _outcome(res, log, timeout_s)
            if stop is not None and stop.is_set():
                ex.cancel(job.job_id)
                for res in ex.poll(2.0):
                    if res.job_id == job.job_id:
                        cost.add_result(res, job.gpus)
                raise Interrupted("stopping: smoke run abandoned")

    def _remote(self, job: Any, timeout_s: float, stop: threading.Event | None,
                cost: SmokeCost) -> tuple[int, str]:
        """The stage on the driver's executor, ahead of its queue, on a slot that holds the lab's GPUs.
        A slot lost to the machinery is retried once; twice is the infrastructure's failure, raised
        (never the candidate's: on this machine's CPU a GPU stage would fail for want of a GPU)."""
        from pipeline.executors import InfrastructureFailure

        for attempt in (1, 2):
            started = None
            try:
                if self._slot is None:  # one slot for the whole smoke run: its stages wait behind nothing
                    self._slot = self.lender.borrow(stop)
                started = time.monotonic()  # on a slot of its own: it starts at once
                res = self.lender.run_ahead(job, stop, slot=self._slot)
            except BaseException as e:
                self._slot = None  # no longer ours (`run_ahead`)
                if started is not None:  # it held its GPU until then; its CPU time went with the node's answer
                    cost.add(0.0, time.monotonic() - started, job.gpus)
                if isinstance(e, InfrastructureFailure) and stop is not None and stop.is_set():
                    raise Interrupted("stopping: smoke run abandoned") from None
                raise
            cost.add_result(res, job.gpus)
            if res.status != "infra":
                return _outcome(res, job.log_path, timeout_s)
            self._slot = None
            if attempt == 2:
                raise InfrastructureFailure(f"smoke stage lost twice on the {self.lender.name} executor: {res.detail}")
        raise AssertionError("unreachable")

    def _once(self, argv: list[str], cwd: Path, out: Path, log: Path, timeout_s: float,
              inputs: list[Path], cost: SmokeCost) -> tuple[int, str]:
        """The stage in a fresh interpreter, with the same sandbox."""
        meter = isolation.Meter()
        try:
            with isolation.metered() as meter:  # booked even when the loop's stop ends it (`Interrupted`)
                done = isolation.run_once(self.lab, argv, cwd=cwd, log=log, timeout_s=timeout_s, ro=list(inputs),
                                          out=out, gpus=self.gpus)
        finally:
            if meter.processes:  # its process's wall: the GPU-seconds over the share (the block's wall
                wall = meter.gpu_s / self.gpus if self.gpus else meter.wall_s  # counts the wait for it too)
                cost.add(meter.cpu_s, wall, self.gpus)
        tail = read_tail(log, TAIL_BYTES)[0]
        if done.timed_out:
            raise MethodFailure(f"timed out after {timeout_s:.0f} s on tiny data:\n{tail}")
        if done.returncode is None:
            raise MethodFailure(f"killed by signal {done.signal}:\n{tail}")
        return done.returncode, tail

    def release(self) -> None:
        """Give back the lender's slot this smoke run held (at its end)."""
        if self._slot is not None:
            slot, self._slot = self._slot, None
            self.lender.give_back_lent(slot)

    def close(self) -> None:
        self.release()
        if self._executor is not None:
            self._executor.close()
            self._executor = None


def _outcome(res: Any, log: Path, timeout_s: float) -> tuple[int, str]:
    """(exit code, output tail) of a finished smoke stage; `MethodFailure` on timeout or signal,
    `Interrupted` if it was cancelled."""
    tail = read_tail(log, TAIL_BYTES)[0]
    if res.status == "timeout":
        raise MethodFailure(f"timed out after {timeout_s:.0f} s on tiny data:\n{tail}")
    if res.status == "signal":
        raise MethodFailure(f"killed by signal {res.signal}:\n{tail}")
    if res.status == "cancelled":
        raise Interrupted("stopping: smoke run abandoned")
    return int(res.exit_code or 0), tail


def smoke_run(lab: Lab, base: str, files: dict[str, str], timeout_s: float | None = None,
              stop: threading.Event | None = None, runner: SmokeRunner | None = None,
              cost: SmokeCost | None = None) -> float:
    """Run every stage once (first task, seed 0) on tiny data; return the metric or raise MethodFailure.

    Each stage sees what it will see in a real run: the files of `base` with `files` applied, of
    the editable ones only those its `inputs` declare, in the same sandbox. Each stage may take
    `timeout_s`, by default `smoke_timeout(lab)`. What the stages spend is added to `cost`.
    """
    from pipeline.scoring import harness_runner

    # its `prepare`, `score` and any stage run once end at `stop` too; given a GPU, the first two run
    # where the driver's run theirs (on a Ray cluster: the executor's share for them)
    with isolation.stopping(stop), isolation.gpu_runner(harness_runner(runner.lender) if runner else None):
        return _smoke_run(lab, base, files, timeout_s, stop, runner, cost)


def _smoke_run(lab: Lab, base: str, files: dict[str, str], timeout_s: float | None,
               stop: threading.Event | None, runner: SmokeRunner | None, cost: SmokeCost | None) -> float:
    timeout_s = smoke_timeout(lab) if timeout_s is None else timeout_s
    cost = cost if cost is not None else SmokeCost()
    bench = lab.config.benchmark
    harness = lab.harness()
    meter = isolation.Meter()
    try:
        with isolation.metered() as meter:  # made once, then reused: what the first smoke run spends on it
            prepared = harness.prepare(lab.state, bench.suite, bench.data_seed, SMOKE_CUSTOMERS, smoke=True)
    finally:
        cost.add_meter(meter)
    task = lab.tasks()[0]
    own = runner is None
    runner = runner or SmokeRunner(lab)
    try:
        isolation.require(lab)
        with tempfile.TemporaryDirectory(prefix="smoke-", dir=lab.state) as tmp:
            code, outs = Path(tmp) / "code", Path(tmp) / "out"
            # the stage logs outlive the smoke run: a rejected implementation's reason points at them
            logs = lab.state / "logs" / "smoke" / f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
            try:
                materialize(git.Repo(lab.root).git, base, files, code)
            except (tarfile.TarError, OSError, ValueError) as e:  # e.g. a chain of symlinks out of the tree
                raise MethodFailure(f"the commit's files cannot be laid out: {e}") from None
            logs.mkdir(parents=True)
            values = {"data": str(prepared.public), "task": task, "seed": "0"}
            done: dict[str, Path] = {}
            for stage in lab.stages_in_order():
                out = outs / stage.name
                out.mkdir(parents=True)
                os.chmod(out, 0o755)
                view = _stage_view(lab, stage, code, Path(tmp) / "views" / stage.name)
                argv = render(stage.run, values | {"out": str(out)})
                inputs = [prepared.public, *(done[n] for n in stage.needs)]
                try:
                    exit_code, tail = runner.run_stage(argv, view, out, logs / f"{stage.name}.log", timeout_s, stop,
                                                       inputs, cost)
                except MethodFailure as e:
                    raise MethodFailure(f"stage {stage.name} {e}") from None
                if exit_code != 0:
                    raise MethodFailure(f"stage {stage.name} exited with {exit_code}:\n{tail}")
                values[stage.name] = str(out)
                done[stage.name] = out
            meter = isolation.Meter()
            try:
                with isolation.metered() as meter:
                    value = harness.score(prepared, task, outs / lab.stages_in_order()[-1].name / "predictions.csv",
                                          bench.metric)
            except MethodFailure as e:
                raise MethodFailure(f"predictions.csv on tiny data: {e}; the last stage's output:\n{tail}") from None
            finally:
                cost.add_meter(meter)
            return value
    except MethodFailure as e:  # raised only inside the `with`: `tmp` is bound
        raise MethodFailure(for_llm(str(e), smoke_places(lab, prepared, Path(tmp)))) from None
    finally:
        if own:
            runner.close()
        else:
            runner.release()


def smoke_places(lab: Lab, prepared: Prepared, tmp: Path) -> dict[str, str]:
    """The folders a smoke stage could read or name, each with the placeholder `for_llm` shows instead:
    its code view (its files then read as the lab's relative paths), the smoke dataset as `{data}`
    and `{sealed}`, each stage's output as `{<stage>}`, the lab's other datasets and folders."""
    places = {str(tmp / "views" / s.name): "" for s in lab.stages_in_order()}
    places |= {str(tmp / "out" / s.name): f"{{{s.name}}}" for s in lab.stages_in_order()}
    places |= {str(tmp / "code"): "", str(tmp): "{tmp}", str(prepared.public): "{data}",
               str(prepared.sealed): "{sealed}", str(lab.state / "data"): "{datasets}",
               str(lab.state / "sealed"): "{sealed datasets}", str(lab.state): "{state}", str(lab.root): "{lab}"}
    return places | {os.path.realpath(path): name for path, name in places.items()}


_CONTROL = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|[\x00-\x08\x0b-\x1f\x7f]")  # terminal escapes, control bytes
# kept as they are: a traceback's `line N` and a `file.py:N[:col]` (the branch code's place, never data)
_KEEP = r"\bline \d+|(?<=\.py):\d+(?::\d+)?"
# a number: hex, a decimal or exponent form, digits grouped by commas, an integer (judged by its length)
_NUMBER = r"0[xX][0-9a-fA-F]+|(?:\d+\.\d*|\.\d+)(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+|\d{1,3}(?:,\d{3})+|\d+"
_TOKEN = re.compile(f"(?P<keep>{_KEEP})|(?P<num>{_NUMBER})")


def for_llm(text: str, places: dict[str, str]) -> str:
    """What of a run's output may flow back to the agent's LLM (a smoke failure's reason, quoted in
    the repair prompt): the first line (what failed) and the last lines that fit `FEEDBACK_BYTES`,
    each cut to `LINE_CHARS`, with every folder of `places` replaced by its placeholder and every
    number masked as `MASK` but a traceback's line numbers and integers of up to `SMALL_INT_DIGITS`
    digits. So an exception's type, its message's shape and the branch file:line pass; a value read
    from the data (a float, an id) or a data folder's path does not.

    The lines are counted in the raw text's bytes, below `TAIL_BYTES`: a log tail cut mid-line (and
    so mid-number) never shows its first line. Strings are not masked (a column name helps a repair):
    a branch that spells values out as words gets them through, which is why the smoke data shares
    nothing with the data runs are scored on (`Harness.prepare(..., smoke=True)`)."""
    head, *body = _CONTROL.sub("", text).splitlines() or [""]
    budget = FEEDBACK_BYTES - LINE_CHARS
    kept: list[str] = []
    for line in reversed(body):
        size = len(line.encode()) + 1
        if size > budget:
            if not kept:  # one long last line: its end, from a word boundary (never half a number)
                end = line[-LINE_CHARS:]
                kept.append("…" + end[end.find(" ") + 1:] if " " in end else "…")
            break
        budget -= size
        kept.append(line)
    order = sorted(places, key=len, reverse=True)
    lines = [_clean(line, order, places) for line in [head, *reversed(kept)]]
    while len("\n".join(lines).encode()) > FEEDBACK_BYTES and len(lines) > 1:  # masks can lengthen a line
        del lines[1]
    return "\n".join(lines).encode()[:FEEDBACK_BYTES].decode(errors="ignore")


def _clean(line: str, order: list[str], places: dict[str, str]) -> str:
    for path in order:
        name = places[path]
        line = line.replace(path + "/", f"{name}/" if name else "").replace(path, name or ".")
    line = _TOKEN.sub(_mask, line)
    return line if len(line) <= LINE_CHARS else line[:LINE_CHARS] + "…"


def _mask(m: re.Match) -> str:
    num = m.group("num")
    if num is None or (num.isdigit() and len(num) <= SMALL_INT_DIGITS):
        return m.group(0)
    return MASK


def _stage_view(lab: Lab, stage: Any, code: Path, view: Path) -> Path:
    """The files of `code` that `stage` may see, as it sees them (`Lab.stage_sees`, the rule the
    driver's views follow), copied into `view` (no link followed while reading or writing)."""
    safefs.copy_tree(code, view, keep=lambda rel: lab.stage_sees(stage, rel),
                     content=lambda rel, data: lab.stage_sees(stage, rel).content(data))
    safefs.chmod_dirs(view)
    return view
