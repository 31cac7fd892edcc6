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
"""

from __future__ import annotations

import os
import tarfile
import tempfile
import threading
import time
import uuid
from io import BytesIO
from pathlib import Path
from typing import Any

import git

from pipeline import isolation, safefs
from pipeline.dag import render
from pipeline.disk import read_tail
from pipeline.errors import Interrupted, SmokeFailed
from pipeline.harness import PredictionsError
from pipeline.lab import Lab

SMOKE_CUSTOMERS = 300
TAIL_BYTES = 3000  # of a failed smoke stage's log, quoted in the reject reason
SMOKE_TIMEOUT_S = 300.0  # the most a smoke stage may take on tiny data, however long the lab's `[run] timeout_s`


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

    def __init__(self, lab: Lab):
        self.lab = lab
        self._executor: Any = None
        self._gpus: float | None = None

    @property
    def gpus(self) -> float:
        """`[run] gpus` where this machine has them; 0 where it has none (a Ray driver's machine:
        the smoke run then runs on its CPU, and a stage that requires CUDA fails it)."""
        if self._gpus is None:
            from pipeline.executors.gpus import capacity
            from pipeline.executors.local import visible_gpus

            share = self.lab.config.run.gpus
            self._gpus = share if share and capacity(share, len(visible_gpus())) >= 1 else 0.0
        return self._gpus

    def executor(self) -> Any:
        if self._executor is None:
            from pipeline.executors.local import DEFAULT_PRELOAD, LocalExecutor

            run = self.lab.config.run
            logs = self.lab.state / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            self._executor = LocalExecutor(cpus=run.cpus, gpus=self.gpus, slots=1, worker_log=logs / "smoke-worker.log",
                                           preload=DEFAULT_PRELOAD if run.preload is None else run.preload)
        return self._executor

    def job(self, argv: list[str], cwd: Path, out: Path, log: Path, timeout_s: float, inputs: list[Path] = ()) -> Any:
        """The `StageJob` of one smoke stage: an executor stage's GPUs, sandbox and memory bound."""
        from pipeline.executors import StageJob
        from pipeline.executors.base import lab_env

        return StageJob(job_id=uuid.uuid4().hex, argv=argv, cwd=cwd, commit="smoke", out=out, log_path=log,
                        timeout_s=timeout_s, cpus=self.lab.config.run.cpus, gpus=self.gpus,
                        memory_mb=isolation.once_memory_mb(self.lab, gpus=self.gpus),
                        sandbox=isolation.spec_for(self.lab, ro=[cwd, *inputs], out=out),
                        env=lab_env(self.lab.config.run.env))

    def run_stage(self, argv: list[str], cwd: Path, out: Path, log: Path, timeout_s: float,
                  stop: threading.Event | None, inputs: list[Path] = ()) -> tuple[int, str]:
        """(exit code, output tail) of one stage in its sandbox; raises SmokeFailed on timeout or
        signal, Interrupted on stop."""
        from pipeline.executors import ExecutorError

        job = self.job(argv, cwd, out, log, timeout_s, inputs)
        try:
            ex = self.executor()
            ex.submit(job)
        except ExecutorError as e:
            log.write_text(f"(smoke worker unavailable: {e}; running in a fresh interpreter)\n")
            return self._once(argv, cwd, out, log, timeout_s, inputs)
        while True:
            for res in ex.poll(0.2):
                if res.job_id != job.job_id:
                    continue
                tail = read_tail(log, TAIL_BYTES)[0]
                if res.status == "timeout":
                    raise SmokeFailed(f"timed out after {timeout_s:.0f} s on tiny data:\n{tail}")
                if res.status == "signal":
                    raise SmokeFailed(f"killed by signal {res.signal}:\n{tail}")
                if res.status == "cancelled":
                    raise Interrupted("stopping: smoke run abandoned")
                if res.status == "infra":  # the worker died, not the candidate: run it on its own
                    return self._once(argv, cwd, out, log, timeout_s, inputs)
                return int(res.exit_code or 0), tail
            if stop is not None and stop.is_set():
                ex.cancel(job.job_id)
                ex.poll(2.0)
                raise Interrupted("stopping: smoke run abandoned")

    def _once(self, argv: list[str], cwd: Path, out: Path, log: Path, timeout_s: float,
              inputs: list[Path]) -> tuple[int, str]:
        """The stage in a fresh interpreter, with the same sandbox."""
        done = isolation.run_once(self.lab, argv, cwd=cwd, log=log, timeout_s=timeout_s, ro=list(inputs), out=out,
                                  gpus=self.gpus)
        tail = read_tail(log, TAIL_BYTES)[0]
        if done.timed_out:
            raise SmokeFailed(f"timed out after {timeout_s:.0f} s on tiny data:\n{tail}")
        if done.returncode is None:
            raise SmokeFailed(f"killed by signal {done.signal}:\n{tail}")
        return done.returncode, tail

    def close(self) -> None:
        if self._executor is not None:
            self._executor.close()
            self._executor = None


def smoke_run(lab: Lab, base: str, files: dict[str, str], timeout_s: float | None = None,
              stop: threading.Event | None = None, runner: SmokeRunner | None = None) -> float:
    """Run every stage once (first task, seed 0) on tiny data; return the metric or raise SmokeFailed.

    Each stage sees what it will see in a real run: the files of `base` with `files` applied, of
    the editable ones only those its `inputs` declare, in the same sandbox. Each stage may take
    `timeout_s`, by default `smoke_timeout(lab)`.
    """
    timeout_s = smoke_timeout(lab) if timeout_s is None else timeout_s
    bench = lab.config.benchmark
    harness = lab.harness()
    prepared = harness.prepare(lab.state, bench.suite, bench.data_seed, SMOKE_CUSTOMERS)
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
                raise SmokeFailed(f"the commit's files cannot be laid out: {e}") from None
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
                                                       inputs)
                except SmokeFailed as e:
                    raise SmokeFailed(f"stage {stage.name} {e}") from None
                if exit_code != 0:
                    raise SmokeFailed(f"stage {stage.name} exited with {exit_code}:\n{tail}")
                values[stage.name] = str(out)
                done[stage.name] = out
            try:
                return harness.score(prepared, task, outs / lab.stages_in_order()[-1].name / "predictions.csv",
                                     bench.metric)
            except PredictionsError as e:
                raise SmokeFailed(f"predictions.csv on tiny data: {e}; the last stage's output:\n{tail}") from None
    finally:
        if own:
            runner.close()


def _stage_view(lab: Lab, stage: Any, code: Path, view: Path) -> Path:
    """The files of `code` that `stage` may see, as it sees them (`Lab.stage_sees`, the rule the
    driver's views follow), copied into `view` (no link followed while reading or writing)."""
    safefs.copy_tree(code, view, keep=lambda rel: lab.stage_sees(stage, rel),
                     content=lambda rel, data: lab.stage_sees(stage, rel).content(data))
    safefs.chmod_dirs(view)
    return view
