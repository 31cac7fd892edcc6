"""The smoke run: a candidate implementation runs its whole stage DAG on a tiny dataset first.

Minutes of benchmark compute are not spent on code that crashes in its first second. The smoke run
uses the same stage commands, a scrubbed environment, the sealed scorer, and a throwaway copy of
the files (the baseline's tree plus the edited files), so it needs no worktree and no commit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

from pipeline.dag import render
from pipeline.executors.base import scrub_env
from pipeline.harness import PredictionsError, get_harness
from pipeline.lab import Lab

SMOKE_CUSTOMERS = 300


class SmokeFailed(Exception):
    """The candidate's pipeline failed on tiny data; the message is fed back to the implementer."""


def materialize(repo_git, base: str, files: dict[str, str], dst: Path) -> None:
    """The tree of `base` with `files` overwritten, written to `dst`."""
    data = repo_git.archive(base, format="tar", output_stream=None, as_process=False, stdout_as_string=False)
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(dst, filter="data")
    for path, text in files.items():
        target = dst / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)


def smoke_run(lab: Lab, repo_git, base: str, files: dict[str, str], timeout_s: float = 300.0) -> float:
    """Run every stage once (first task, seed 0) on tiny data; return the metric or raise SmokeFailed."""
    bench = lab.config.benchmark
    harness = get_harness(bench.harness)
    prepared = harness.prepare(lab.state, bench.suite, bench.data_seed, SMOKE_CUSTOMERS)
    task = lab.tasks()[0]
    env = scrub_env(os.environ) | {"OMP_NUM_THREADS": str(lab.config.run.cpus), "PYTHONHASHSEED": "0"}
    with tempfile.TemporaryDirectory(prefix="smoke-", dir=lab.state) as tmp:
        code, outs = Path(tmp) / "code", Path(tmp) / "out"
        materialize(repo_git, base, files, code)
        values = {"data": str(prepared.public), "task": task, "seed": "0"}
        for stage in lab.stages_in_order():
            out = outs / stage.name
            out.mkdir(parents=True)
            argv = render(stage.run, values | {"out": str(out)})
            if argv and argv[0] in ("python", "python3"):
                argv[0] = sys.executable
            try:
                proc = subprocess.run(argv, cwd=code, env=env, capture_output=True, text=True, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise SmokeFailed(f"stage {stage.name} timed out after {timeout_s:.0f} s on tiny data") from None
            except OSError as e:
                raise SmokeFailed(f"stage {stage.name} could not start: {e}") from None
            if proc.returncode != 0:
                raise SmokeFailed(f"stage {stage.name} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
            values[stage.name] = str(out)
        try:
            return harness.score(prepared, task, outs / lab.stages_in_order()[-1].name / "predictions.csv")
        except PredictionsError as e:
            raise SmokeFailed(f"predictions.csv on tiny data: {e}") from None
