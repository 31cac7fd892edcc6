"""The sealed scorer's side of the driver: a run's `predictions.csv` scored in the driver's process
(branch code never sees the test labels or the metric), a baseline's also on the holdout split,
and a rejected predictions file told "nan" from malformed without reading it whole. Every call of
the harness (these, and `prepare`) is booked with what it spent (`HarnessExec`)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from pipeline.disk import open_regular
from pipeline.errors import InfrastructureFailure, Interrupted
from pipeline.harness import MethodFailure
from pipeline.harness.base import HOLDOUT_SPLIT
from pipeline.outcomes import ResultOutcome

log = logging.getLogger("autoresearch.runner")
T = TypeVar("T")
FOUND_MADE_CPU_S = 0.05  # a `prepare` that ran no process and took less CPU than this found its dataset made


class Scoring:
    """`pipeline.runner.Driver`'s scoring (its `active` runs, `harness`, `store`, `_finish`, `_harness_books`)."""

    def _booked(self, kind: str, run_id: int | None, call: Callable[[], T]) -> T:
        """`call()`, a call of the harness, booked with what it spent (`isolation.metered`): kept here
        and written with the driver's other periodic books (`_write_harness_books`), not a transaction
        per run. A `prepare` that found its dataset made (no process, no CPU to speak of) is not booked."""
        from pipeline.isolation import gpu_runner, metered

        started, ok, stopped = time.time(), False, False
        try:
            with metered() as meter, gpu_runner(harness_runner(self.executor)):
                value = call()
            ok = True
            return value
        except Interrupted:
            stopped = True
            raise
        finally:
            found_made = ok and kind == "prepare" and not meter.processes and meter.cpu_s < FOUND_MADE_CPU_S
            if not found_made and not (stopped and not meter.processes):  # stopped before it started: nothing ran
                self._harness_books.append(dict(
                    kind=kind, run_id=run_id, ok=ok, cpu_s=meter.cpu_s, gpu_s=meter.gpu_s, wall_s=meter.wall_s,
                    started_at=started))

    def _write_harness_books(self) -> None:
        """Write the harness calls booked since the last time, in one transaction."""
        rows, self._harness_books = self._harness_books, []
        if not rows:
            return
        try:
            self.store.harness_finished(rows)
        except Exception as e:  # the books must not stop the driver: kept for the next try
            self._harness_books = rows + self._harness_books
            log.warning("%d harness calls not booked yet: %s: %s", len(rows), type(e).__name__, e)

    def _score(self, run_id: int) -> None:
        """The sealed scorer, in the driver: branch code never sees the test labels or the metric."""
        a = self.active[run_id]
        run = a.claim.run
        predictions = a.done[a.final.name] / "predictions.csv"
        try:
            prepared = self.prepared()  # made when the run started (`_activate`): here, only read
            value = self._booked("score", run.id, lambda: self.harness.score(
                prepared, run.task, predictions, self.lab.config.benchmark.metric))
        except MethodFailure as e:
            kind = "nan" if _has_nonfinite(predictions) else "predictions"
            self._finish(run_id, ResultOutcome.METHOD_FAILURE, None, kind, str(e))
            return
        except Interrupted:  # the driver stops: the run waits to be scored again, or goes back to the queue
            self.to_score.insert(0, run_id)
            raise
        except InfrastructureFailure as e:  # the machinery's (a node lost, no GPU came free): scored again
            a.infra_failures += 1
            retries = self.lab.config.run.retries
            if a.infra_failures <= retries:
                log.warning("scoring run %s again: %s", run_id, e)
                self.to_score.append(run_id)
                return
            self._finish(run_id, ResultOutcome.INFRA_FAILURE, None, "scorer", f"{e}; {retries} retries exhausted")
            return
        except Exception as e:  # a scorer bug is not the method's failure; retrying would not help
            log.exception("scorer failed for run %s", run_id)
            self._finish(run_id, ResultOutcome.INFRA_FAILURE, None, "scorer", f"{type(e).__name__}: {e}")
            return
        if not math.isfinite(value):
            self._finish(run_id, ResultOutcome.METHOD_FAILURE, None, "nan", f"metric is {value}")
            return
        if self._is_baseline(run):
            self._score_holdout(run, predictions)
        self._finish(run_id, ResultOutcome.OK, float(value), None, None)

    def _is_baseline(self, run: Any) -> bool:
        """Whether the run's commit is a baseline (its runs are also scored on the holdout). A commit
        is marked a baseline before its baseline runs are queued (`Experiment.queue_champion`), so
        an answer `no` holds for every run queued before it was asked."""
        if run.commit in self._baselines:
            return True
        asked = self._not_baseline_at.get(run.commit)
        if asked is not None and run.queued_at is not None and run.queued_at < asked:
            return False
        t = time.time()
        if self.store.is_baseline(run.commit):
            self._baselines.add(run.commit)
            return True
        self._not_baseline_at[run.commit] = t
        return False

    def _score_holdout(self, run: Any, predictions: Path) -> None:
        """A baseline's run (the first baseline's, a champion's) is also scored on the sealed holdout
        split, into a table nothing that decides reads; a challenger's never is (the holdout measures
        test-set reuse, so nothing that chooses may see it)."""
        try:
            prepared = self.prepared()
            if not self.harness.has_holdout(prepared):
                return
            value = self._booked("holdout", run.id, lambda: self.harness.score(
                prepared, run.task, predictions, self.lab.config.benchmark.metric, split=HOLDOUT_SPLIT))
            if math.isfinite(value):
                self.store.holdout_put(run.id, run.commit, run.task, run.seed, float(value))
        except Interrupted:  # the driver stops: the run is scored again by the next one
            raise
        except Exception as e:  # the holdout is a report: its failure never fails the run
            log.warning("holdout not scored for run %s: %s: %s", run.id, type(e).__name__, e)


def harness_runner(executor: Any) -> Any:
    """Where a harness command given a GPU runs: the executor's `run_harness` if it holds a GPU share
    for it (Ray: on the cluster), else None (on this machine, from its GPU pool)."""
    return executor.run_harness if getattr(executor, "harness_gpus", 0) else None


NONFINITE_SCAN_BYTES = 16 << 20  # how much of a rejected predictions file is read to tell "nan" from "predictions"
_NONFINITE = (b"nan", b"inf", b"-inf", b"+inf", b"infinity", b"-infinity")


def _has_nonfinite(path: Path, limit: int = NONFINITE_SCAN_BYTES) -> bool:
    """Whether a rejected predictions file (branch-written) holds a non-finite score in its first
    `limit` bytes: opened without following a link, read line by line (a line at most 4 KB a read),
    never whole, so a 4 GB file costs the driver no memory."""
    fh = open_regular(path)
    if fh is None:
        return False
    with fh:
        fh.readline(4096)  # the header
        seen = 0
        while seen < limit:
            line = fh.readline(4096)
            if not line:
                return False
            seen += len(line)
            if line.rsplit(b",", 1)[-1].strip().lower() in _NONFINITE:
                return True
    return False
