"""Harness "command": a team's own data preparation and scorer, run from the lab's trusted commit.

The lab names its harness files in `[benchmark] trusted` (globs: `prepare.py`, `score.py`, the data
they read). They are taken from the **trusted commit** — the tag `autoresearch/trusted`, set to the
baseline's head at the first run and moved only by a human (`autoresearch trust REV`) — never from
a challenger, whose diff may not touch them anyway. Both commands run in the sandbox, with the
address-space bound a local stage gets (`[run] memory_mb`, else its default: `isolation.once_memory_mb`):

- `prepare` once per (trusted commit, data_seed), with `{data}` (what stages see) and `{sealed}`
  (what only the scorer sees) as its only writable folders; the smoke run's dataset is prepared
  with `{data_seed}` = `smoke_seed(data_seed)` (2**31 + data_seed, never a real data seed: those
  are refused from 2**31 on) and `{smoke}` = 1 (0 for a real dataset), which the team's prepare
  draws a small dataset from (or, reading real data, writes a small sample with ids of its own
  for): a smoke run's stages train on it, on the lab's GPU if it has one;
- `score` once per run, reading only `{predictions}` (a regular file the stage wrote) and
  `{sealed}`; its last line of stdout is `{"value": x}`. A missing or non-finite value is a method
  failure of the run. A command that names `{split}` has a holdout (README, "The bundled benchmark"): it is called with
  `gate` for every run, and with `holdout` for a baseline's own runs only (champions).
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.disk import read_tail
from pipeline.errors import (
    InfrastructureFailure,
    LabConfigError,
    UserError,
)
from pipeline.harness.base import (
    GATE_SPLIT,
    HOLDOUT_SPLIT,
    SMOKE_SEED_BASE,
    Harness,
    MethodFailure,
    Prepared,
    check_regular,
    smoke_seed,
)
from pipeline.labnames import BASELINE_BRANCH, PLACEHOLDER

if TYPE_CHECKING:
    from pipeline.lab import Lab, ResearchConfig

TRUSTED_TAG = "autoresearch/trusted"
TASK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
PREPARE_PLACEHOLDERS = {"data_seed", "data", "sealed", "smoke"}
SCORE_PLACEHOLDERS = {"task", "predictions", "sealed", "split"}
SCORE_TIMEOUT_S = 300.0


class CommandHarness(Harness):
    name = "command"

    def __init__(self, lab: "Lab | None" = None):
        self.lab = lab

    def bind(self, lab: "Lab") -> "CommandHarness":
        return CommandHarness(lab)

    # --- the contract -------------------------------------------------------------------------

    def validate(self, config: "ResearchConfig", path: Path) -> None:

        b = config.benchmark
        if not b.tasks:
            raise LabConfigError(path, "benchmark.tasks", f'{"missing" if b.tasks is None else "empty"}; '
                                 'expected the list of task names, e.g. tasks = ["default", "churn"]')
        for t in b.tasks:
            if not TASK_NAME.match(t):
                raise LabConfigError(path, "benchmark.tasks", f"task {t!r}: expected letters, digits, '_', '.', '-'")
        if len(set(b.tasks)) != len(b.tasks):
            raise LabConfigError(path, "benchmark.tasks", "expected each task once")
        if b.data_seed >= SMOKE_SEED_BASE:
            raise LabConfigError(path, "benchmark.data_seed", f"{b.data_seed}: expected below {SMOKE_SEED_BASE}; "
                                 "the seeds from there on are the smoke run's")
        if not b.trusted:
            raise LabConfigError(path, "benchmark.trusted", 'missing; expected globs of the harness files, e.g. ["prepare.py", "score.py"]')
        for key, command, allowed, required in (
            ("prepare", b.prepare, PREPARE_PLACEHOLDERS, ("data", "sealed")),
            ("score", b.score, SCORE_PLACEHOLDERS, ("predictions",)),
        ):
            if not command:
                raise LabConfigError(path, f"benchmark.{key}", f"missing; expected a command line using {{{'}, {'.join(required)}}}")
            used = set(PLACEHOLDER.findall(command))
            for name in required:
                if name not in used:
                    raise LabConfigError(path, f"benchmark.{key}", f"expected the placeholder {{{name}}} in {command!r}")
            for name in sorted(used - allowed):
                raise LabConfigError(path, f"benchmark.{key}",
                                     f"unknown placeholder {{{name}}}; expected only {', '.join('{%s}' % a for a in sorted(allowed))}")

    def tasks(self, suite: str, subset: list[str] | None = None) -> list[str]:
        known = list(self.lab.config.benchmark.tasks or []) if self.lab is not None else []
        if subset is None:
            return known
        for t in subset:
            if t not in known:
                raise UserError(f"unknown task {t!r}; expected one of {known} ([benchmark] tasks)")
        return list(subset)

    # --- the trusted commit -------------------------------------------------------------------

    def trusted_view(self) -> Path:
        """The harness files (and every other non-editable file) as of the trusted commit."""
        from pipeline.worktrees import Worktrees

        lab = self._lab()
        sha = trusted_commit(lab)
        return Worktrees(lab.root, lab.state).view(sha, lambda p: lab.is_trusted(p) or not lab.is_editable(p),
                                                   collectable=False)  # the trusted files: never collected

    def _lab(self) -> "Lab":
        if self.lab is None:
            raise RuntimeError("CommandHarness used without a lab; call bind(lab) first")
        return self.lab

    # --- prepare and score --------------------------------------------------------------------

    def prepare(self, state_dir: Path, suite: str, data_seed: int, customers: int | None = None, *,
                smoke: bool = False) -> Prepared:
        """Run the lab's `prepare` once per (trusted commit, data seed); later calls reuse it. A smoke
        dataset is the one of `smoke_seed(data_seed)`: the ids are the team's prepare's to keep apart."""
        from pipeline.dag import render
        from pipeline.isolation import run_once

        lab = self._lab()
        data_seed = smoke_seed(data_seed) if smoke else data_seed
        state_dir = Path(state_dir)
        sha = trusted_commit(lab)
        did = f"command-{sha[:12]}-d{data_seed}"
        prepared = Prepared(did, state_dir / "data" / did, state_dir / "sealed" / did)
        if (prepared.public / ".prepared").is_file() and prepared.sealed.is_dir():
            return prepared
        (state_dir / "data").mkdir(parents=True, exist_ok=True)
        (state_dir / "sealed").mkdir(parents=True, exist_ok=True)
        os.chmod(state_dir / "sealed", 0o700)
        logs = state_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with open(state_dir / "data" / f".{did}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if (prepared.public / ".prepared").is_file():
                return prepared
            view = self.trusted_view()
            pub = Path(tempfile.mkdtemp(dir=state_dir / "data", prefix=f".{did}-"))
            seal = Path(tempfile.mkdtemp(dir=state_dir / "sealed", prefix=f".{did}-"))
            for d in (pub, seal):  # the sandboxed prepare runs as an unprivileged uid
                os.chmod(d, 0o777)
            log = logs / f"prepare-{did}.log"
            argv = render(lab.config.benchmark.prepare or "", {"data_seed": str(data_seed), "data": str(pub),
                                                               "sealed": str(seal), "smoke": "1" if smoke else "0"})
            try:
                done = run_once(lab, argv, cwd=view, log=log, timeout_s=lab.config.run.timeout_s, ro=[],
                                rw=[pub, seal], gpus=lab.config.run.prepare_gpus, reserved=True)
            except BaseException:  # e.g. `Interrupted`: the loop stops; nothing half-made is left
                shutil.rmtree(pub, ignore_errors=True)
                shutil.rmtree(seal, ignore_errors=True)
                raise
            if done.returncode != 0:
                shutil.rmtree(pub, ignore_errors=True)
                shutil.rmtree(seal, ignore_errors=True)
                how = "timed out" if done.timed_out else (
                    f"exited with {done.returncode}" if done.returncode is not None else f"killed by signal {done.signal}")
                last = _last_line(log)
                msg = f"[benchmark] prepare {how}{f' ({last})' if last else ''}; see {log}"
                if done.returncode is None and not done.timed_out:  # the OOM killer, a node going down:
                    raise InfrastructureFailure(msg)  # infrastructure, retried; an exit or a timeout is the lab's to fix
                raise LabConfigError(None, None, msg)
            for d, mode in ((pub, 0o755), (seal, 0o755)):  # the seal's parent (0700) keeps it private
                _own(d, mode)
            (pub / ".prepared").write_text(json.dumps({"trusted": sha, "data_seed": data_seed}))
            for tmp, final in ((seal, prepared.sealed), (pub, prepared.public)):
                shutil.rmtree(final, ignore_errors=True)
                os.replace(tmp, final)
        return prepared

    def has_holdout(self, prepared: Prepared | None = None) -> bool:
        """The lab's scorer takes `{split}`: it can score the holdout."""

        return "split" in PLACEHOLDER.findall(self._lab().config.benchmark.score or "")

    def score(self, prepared: Prepared, task: str, predictions: Path, metric: str = "",
              split: str = GATE_SPLIT) -> float:
        """Run the lab's `score` in the sandbox; its last line of stdout is {"value": x}."""
        if split not in (GATE_SPLIT, HOLDOUT_SPLIT) or (split == HOLDOUT_SPLIT and not self.has_holdout()):
            raise ValueError(f"no split {split!r}: [benchmark] score does not take {{split}}")
        from pipeline.dag import render
        from pipeline.isolation import run_once

        lab = self._lab()
        predictions = Path(predictions)
        check_regular(predictions)
        argv = render(lab.config.benchmark.score or "", {"task": task, "predictions": str(predictions),
                                                         "sealed": str(prepared.sealed), "split": split})
        logs = lab.state / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=logs, prefix=".score-") as tmp:
            log, out = Path(tmp) / "score.log", Path(tmp) / "stdout"
            done = run_once(lab, argv, cwd=self.trusted_view(), log=log, stdout=out, timeout_s=SCORE_TIMEOUT_S,
                            ro=[predictions, prepared.sealed], gpus=lab.config.run.score_gpus, reserved=True)
            text = read_tail(out, 64 << 10)[0]  # its last line is all that is read of it
            err = read_tail(log, 500)[0].strip()
        if done.returncode != 0:
            how = "timed out" if done.timed_out else f"exited with {done.returncode}"
            raise MethodFailure(f"score {how}: {err or text[-300:]}")
        return parse_value(text)


def _last_line(log: Path) -> str:
    """The last line a harness command wrote to its log (e.g. `MemoryError`), at most 300 characters."""
    lines = [ln.strip() for ln in read_tail(log, 4096)[0].splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def parse_value(stdout: str) -> float:
    """The metric from the scorer's last line of stdout, `{"value": x}`."""
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    if not lines:
        raise MethodFailure('score printed nothing; expected {"value": x} as its last line')
    try:
        doc = json.loads(lines[-1])
        value = float(doc["value"])
    except (ValueError, TypeError, KeyError):
        raise MethodFailure(f'score printed {lines[-1][:200]!r} last; expected {{"value": x}}') from None
    if not math.isfinite(value):
        raise MethodFailure(f"score value is {value}")
    return value


def trusted_commit(lab: "Lab", *, create: bool = True) -> str:
    """The sha of the tag `autoresearch/trusted`; created at the baseline's head on first use."""
    import git


    repo = git.Repo(lab.root)
    try:
        return repo.commit(TRUSTED_TAG).hexsha
    except (git.BadName, ValueError):
        if not create:
            raise UserError(f"no trusted commit yet (tag {TRUSTED_TAG}); `autoresearch trust REV` sets it") from None
    try:
        base = repo.commit(BASELINE_BRANCH)
    except (git.BadName, ValueError):
        base = repo.head.commit
    try:
        repo.create_tag(TRUSTED_TAG, ref=base, message="autoresearch: the commit the harness files come from")
    except git.GitCommandError:  # another driver tagged it first
        pass
    return repo.commit(TRUSTED_TAG).hexsha


def set_trusted(lab: "Lab", rev: str) -> str:
    """Move the trusted commit to `rev` (a human's decision: the harness files change with it)."""
    import git

    repo = git.Repo(lab.root)
    try:
        sha = repo.commit(rev).hexsha
    except (git.BadName, ValueError, git.GitCommandError):
        raise UserError(f"{rev!r} is not a commit of {lab.root}") from None
    repo.create_tag(TRUSTED_TAG, ref=sha, force=True, message=f"autoresearch: trusted harness files from {sha[:12]}")
    return sha


def _own(folder: Path, mode: int) -> None:
    """Hand what a sandboxed process wrote back to us: our owner, no write for others."""
    uid, gid = os.getuid(), os.getgid()
    for root, dirs, files in os.walk(folder):
        os.chown(root, uid, gid, follow_symlinks=False)
        os.chmod(root, mode)
        for name in files:
            p = os.path.join(root, name)
            os.chown(p, uid, gid, follow_symlinks=False)
            if not os.path.islink(p):
                os.chmod(p, 0o644)
