"""The harness interface and the sealed scorer shared by every harness."""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from pipeline.errors import LabConfigError, MethodFailure, UserError


class ConfigView(Protocol):
    """What a harness reads of a lab's `research.toml` (`pipeline.lab.ResearchConfig` has it): its
    `[benchmark]`. Named here, so the harnesses, which the lab's loading calls, need not import it."""

    benchmark: Any


class LabView(Protocol):
    """What a harness reads of a lab (`pipeline.lab.Lab` has it)."""

    root: Path
    config: Any


@dataclass(frozen=True)
class Prepared:
    """A prepared dataset. `public` is what stages see as {data}; `sealed` only the scorer reads."""

    dataset_id: str
    public: Path
    sealed: Path


GATE_SPLIT, HOLDOUT_SPLIT = "gate", "holdout"
SMOKE_SEED_BASE = 1 << 31  # smoke seeds lie at or above it, real data seeds below (still < 2**32: any seeder takes it)


def smoke_seed(data_seed: int) -> int:
    """The data seed a smoke run prepares with where a harness can only be given a seed (a team's own
    `prepare`): never a real data seed, which stays below `SMOKE_SEED_BASE`."""
    return SMOKE_SEED_BASE + data_seed


class Harness:
    """A benchmark: tasks, data preparation and the sealed scorer.

    A harness may seal two test splits: `gate`, what every run is scored on and the
    gate decides with, and `holdout`, scored only for a baseline's own runs (champions), never shown
    to the gate, the agent or its prompts. Runs predict every test id; which ids are holdout is
    sealed, so branch code cannot treat them differently.
    """

    name: str = ""
    suites: dict[str, list[str]] = {}
    metrics: set[str] = {"auc"}

    def bind(self, lab: LabView) -> "Harness":
        """This harness for one lab (a harness that reads the lab's own files keeps it)."""
        return self

    def validate(self, config: ConfigView, path: Path) -> None:
        """Raise `LabConfigError` for a `[benchmark]` this harness cannot serve."""
        bench = config.benchmark
        for key in ("prepare", "score", "trusted"):
            if getattr(bench, key):
                raise LabConfigError(path, f"benchmark.{key}", f'only for harness = "command"; '
                                     f"harness {self.name!r} has its own sealed scorer")
        if bench.suite not in self.suites:
            raise LabConfigError(path, "benchmark.suite", f"unknown suite {bench.suite!r}; expected one of {sorted(self.suites)}")
        if bench.metric not in self.metrics:
            raise LabConfigError(path, "benchmark.metric", f"unknown metric {bench.metric!r}; expected one of {sorted(self.metrics)}")
        if bench.tasks is not None:
            known = self.tasks(bench.suite)
            for t in bench.tasks:
                if t not in known:
                    raise LabConfigError(path, "benchmark.tasks", f"unknown task {t!r} in suite {bench.suite!r}; expected one of {known}")

    def tasks(self, suite: str, subset: list[str] | None = None) -> list[str]:
        known = self.suites[suite]
        if subset is None:
            return list(known)
        for t in subset:
            if t not in known:
                raise UserError(f"unknown task {t!r} in suite {suite!r}; expected one of {known}")
        return list(subset)

    def prepare(self, state_dir: Path, suite: str, data_seed: int, customers: int | None = None, *,
                smoke: bool = False) -> Prepared:  # pragma: no cover
        """The dataset of `data_seed` (`customers` of them where the harness can size it), prepared
        once and reused.

        `smoke=True` is the smoke run's dataset (`pipeline.smoke`): it must share nothing with the
        real one a run scores on — drawn from a stream no real data seed draws from (a salt, or
        `smoke_seed`), with ids disjoint from the real ids, under a dataset id of its own — because
        what a failing smoke stage prints flows back to the LLM's repair prompt."""
        raise NotImplementedError

    def test_ids(self, prepared: Prepared) -> np.ndarray:  # pragma: no cover
        raise NotImplementedError

    def test_labels(self, prepared: Prepared, task: str) -> np.ndarray:  # pragma: no cover
        raise NotImplementedError

    def holdout_mask(self, prepared: Prepared) -> np.ndarray | None:
        """Which of `test_ids` are the sealed holdout split (None: this harness has no holdout)."""
        return None

    def has_holdout(self, prepared: Prepared) -> bool:
        return self.holdout_mask(prepared) is not None

    def score(self, prepared: Prepared, task: str, predictions: Path, metric: str = "auc",
              split: str = GATE_SPLIT) -> float:
        """Score a run's predictions.csv (columns id,score, every test id) on one sealed split."""
        mask = self.holdout_mask(prepared)
        if split not in (GATE_SPLIT, HOLDOUT_SPLIT) or (split == HOLDOUT_SPLIT and mask is None):
            raise ValueError(f"no split {split!r} in {prepared.dataset_id}")
        if metric != "auc":
            raise ValueError(f"unknown metric {metric!r}")
        ids = self.test_ids(prepared)
        labels = self.test_labels(prepared, task)
        scores = read_predictions(predictions, ids)
        if mask is not None:
            keep = mask if split == HOLDOUT_SPLIT else ~mask
            labels, scores = labels[keep], scores[keep]
        return auc(labels, scores)


MAX_ROW_BYTES = 256  # a predictions row "id,score\n" is far shorter: the file's size bound per test id


def read_predictions(path: Path, ids: np.ndarray) -> np.ndarray:
    """Return scores aligned with `ids`; raise MethodFailure for anything but one finite score per id.

    The file is branch output: opened without following a link, refused above MAX_ROW_BYTES per
    test id before anything is read, and parsed as a stream that stops at the first bad row or at a
    row past the test ids, so what the driver holds is bounded by the test set, not by the file."""
    path = Path(path)
    st = check_regular(path)
    limit = (len(ids) + 1) * MAX_ROW_BYTES
    if st.st_size > limit:
        raise MethodFailure(f"{path.name}: {st.st_size} bytes, more than {limit} for {len(ids)} test ids")
    got: dict[int, float] = {}
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, newline="") as fh:
            rows = csv.reader(fh)
            header = next(rows, None)
            if header is None or [c.strip().lower() for c in header] != ["id", "score"]:
                raise MethodFailure(f"{path.name}: expected header 'id,score'")
            for n, row in enumerate(rows, start=2):
                if len(got) == len(ids):
                    raise MethodFailure(f"{path.name}:{n}: more rows than the {len(ids)} test ids")
                got[_id_of(path, n, row, got)] = _score_of(path, n, row)
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise MethodFailure(f"{path.name} unreadable: {e}") from None
    missing = [int(i) for i in ids if int(i) not in got]
    if missing:
        raise MethodFailure(f"{path.name}: {len(missing)} test ids missing (first {missing[0]})")
    return np.array([got[int(i)] for i in ids], dtype=np.float64)


def _id_of(path: Path, n: int, row: list[str], got: dict[int, float]) -> int:
    if len(row) != 2:
        raise MethodFailure(f"{path.name}:{n}: expected 2 columns, got {len(row)}")
    try:
        i = int(row[0])
    except ValueError:
        raise MethodFailure(f"{path.name}:{n}: expected an integer id and a number") from None
    if i in got:
        raise MethodFailure(f"{path.name}:{n}: duplicate id {i}")
    return i


def _score_of(path: Path, n: int, row: list[str]) -> float:
    try:
        s = float(row[1])
    except ValueError:
        raise MethodFailure(f"{path.name}:{n}: expected an integer id and a number") from None
    if not math.isfinite(s):
        raise MethodFailure(f"{path.name}:{n}: score is not finite ({row[1]})")
    return s


def check_regular(path: Path) -> os.stat_result:
    """The scorer reads only a regular file the stage wrote: never a symlink or a hard link. Its stat."""
    import stat

    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise MethodFailure(f"{path.name} not found") from None
    if stat.S_ISLNK(st.st_mode):
        raise MethodFailure(f"{path.name} is a symlink; expected a regular file the stage wrote")
    if not stat.S_ISREG(st.st_mode):
        raise MethodFailure(f"{path.name} is not a regular file")
    if st.st_nlink != 1:
        raise MethodFailure(f"{path.name} is a hard link ({st.st_nlink} names); expected a file the stage wrote")
    return st


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC by the rank statistic (Mann-Whitney U), ties counted as one half."""
    from scipy.stats import rankdata

    labels = np.asarray(labels).astype(bool)
    n_pos, n_neg = int(labels.sum()), int((~labels).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError("AUC needs both classes in the labels")
    ranks = rankdata(scores)
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))
