"""The stage cache's, stage executions' and smoke runs' rows: what ran, what a cached output cost, what was
used last (see `pipeline.store`)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterable
from typing import Any

from sqlalchemy import func, update
from sqlalchemy.exc import IntegrityError
from sqlmodel import select

from pipeline.errors import InfrastructureFailure
from pipeline.executors.base import STAGE_ENV_VERSION
from pipeline.store.reads import in_chunks
from pipeline.store.tables import (METHOD_OUTCOMES, SMOKE_OUTCOMES, CacheEntry, CacheUse, GpuUsage, Run, RunStatus,
                                   HarnessExec, SmokeExec, StageExec, StageGpu, StageOutcome, now)


class CacheRows:
    """The cache's and stage executions' methods of `Store`. Mixed into `Store`, whose `session()` each method uses."""

    def stage_started(self, run_id: int, stage: str, key: str, *, executor: str, log_path: str | None,
                      gpu_share: float | None = None) -> int:
        with self.session() as s:
            ex = StageExec(run_id=run_id, stage=stage, key=key, executor=executor, host=socket.gethostname(),
                           log_path=log_path, env=STAGE_ENV_VERSION, gpu_share=gpu_share)
            s.add(ex)
            s.commit()
            return int(ex.id)  # type: ignore[arg-type]

    def stage_finished(self, exec_id: int, outcome: StageOutcome, **fields: Any) -> None:
        with self.session() as s:
            ex = s.get(StageExec, exec_id)
            if ex is None:
                raise InfrastructureFailure(f"stage execution {exec_id} does not exist")
            ex.outcome = outcome
            ex.finished_at = now()
            for k, v in fields.items():
                setattr(ex, k, v)
            s.add(ex)
            s.commit()

    def stage_gpu_used(self, exec_id: int, util: float, samples: int) -> None:
        """The mean GPU utilisation NVML saw while stage execution `exec_id` held its GPUs."""
        with self.session() as s:
            s.merge(StageGpu(exec_id=exec_id, util=util, samples=samples))
            s.commit()

    def gpu_usage_add(self, holder: str, gpus: list[str], started_at: float, samples: int, busy: int,
                      util_sum: float, extend: int | None = None) -> int:
        """One interval of a process's GPU sampler (`GpuUsage`): the samples it took since `started_at`,
        a row of its own, or added to the row `extend` (its end moved to now); the row's id."""
        with self.session() as s:
            if extend is not None:
                done = s.exec(update(GpuUsage).where(GpuUsage.id == extend)  # type: ignore[call-overload,arg-type]
                              .values(samples=GpuUsage.samples + samples, busy=GpuUsage.busy + busy,
                                      util_sum=GpuUsage.util_sum + util_sum, updated_at=time.time()))
                if done.rowcount == 1:  # type: ignore[attr-defined]
                    s.commit()
                    return extend
            row = GpuUsage(holder=holder, gpus=",".join(gpus), started_at=started_at, samples=samples, busy=busy,
                           util_sum=util_sum)
            s.add(row)
            s.commit()
            assert row.id is not None
            return row.id

    def smoke_finished(self, base: str, outcome: str, *, hypothesis: str | None, executor: str, stages: int,
                       cpu_s: float, gpu_s: float, wall_s: float, started_at: float,
                       gpu_from: float | None = None, gpu_to: float | None = None) -> None:
        """Book one smoke run (`SmokeExec`)."""
        if outcome not in SMOKE_OUTCOMES:
            raise ValueError(f"a smoke run ends {' | '.join(SMOKE_OUTCOMES)}, not {outcome!r}")
        with self.session() as s:
            s.add(SmokeExec(hypothesis=hypothesis, base=base, outcome=outcome, executor=executor, stages=stages,
                            cpu_s=cpu_s, gpu_s=gpu_s, wall_s=wall_s, started_at=started_at, gpu_from=gpu_from,
                            gpu_to=gpu_to))
            s.commit()

    def harness_finished(self, calls: list[dict[str, Any]]) -> None:
        """Book calls of the harness by a driver (`HarnessExec`), in one transaction: each a dict of
        kind, run_id, ok, cpu_s, gpu_s, wall_s, started_at."""
        from sqlalchemy import insert

        rows = [{"kind": c["kind"], "run_id": c["run_id"], "outcome": "ok" if c["ok"] else "failed", "cpu_s": c["cpu_s"],
                 "gpu_s": c["gpu_s"], "wall_s": c["wall_s"], "started_at": c["started_at"]} for c in calls]
        with self.session() as s:
            s.execute(insert(HarnessExec), rows)  # one executemany, not an ORM object per row
            s.commit()

    def stage_served(self, run_id: int, stage: str, key: str, outcome: StageOutcome, *, executor: str,
                     saved_cpu_s: float = 0.0, detail: str | None = None) -> None:
        """Record a stage that did not execute for this run: a cache hit, shared, or upstream failure."""
        with self.session() as s:
            t = now()
            s.add(StageExec(run_id=run_id, stage=stage, key=key, outcome=outcome, executor=executor,
                            host=socket.gethostname(), saved_cpu_s=saved_cpu_s, detail=detail,
                            started_at=t, finished_at=t))
            s.commit()

    def cache_published(self, key: str, stage: str, commit: str, cpu_s: float, wall_s: float,
                        size_bytes: int | None = None, env_id: str | None = None) -> None:
        """A stage output entered the cache: what it cost, where it was made (`env_id`, a
        MeasureEnv), and (with `size_bytes`) its first use and size for the LRU bound, in one transaction."""
        with self.session() as s:
            if s.get(CacheEntry, key) is None:
                s.add(CacheEntry(key=key, stage=stage, commit=commit, cpu_s=cpu_s, wall_s=wall_s, env_id=env_id))
                if size_bytes is not None:  # both rows in one commit, the usual case
                    s.add(self._use(s, key, size_bytes, now()))
                try:
                    s.commit()
                    return
                except IntegrityError:  # another driver published it first: only its use is ours
                    s.rollback()
            if size_bytes is not None:
                self._touch(s, key, size_bytes, now())

    def cache_touch(self, key: str, size_bytes: int | None = None, used_at: float | None = None) -> None:
        """Note a use of a cache entry (a hit, or its publication with its size)."""
        t = used_at if used_at is not None else now()
        with self.session() as s:
            self._touch(s, key, size_bytes, t)

    @staticmethod
    def _use(s: Any, key: str, size_bytes: int | None, t: float) -> CacheUse:
        row = s.get(CacheUse, key)
        if row is None:
            return CacheUse(key=key, size_bytes=size_bytes or 0, used_at=t)
        row.used_at = max(row.used_at, t)
        if size_bytes is not None:
            row.size_bytes, row.evicted_at = size_bytes, None
        return row

    def _touch(self, s: Any, key: str, size_bytes: int | None, t: float) -> None:
        s.add(self._use(s, key, size_bytes, t))
        try:
            s.commit()
        except IntegrityError:
            s.rollback()

    def cache_uses(self) -> list[CacheUse]:
        """The entries on disk, least recently used first."""
        with self.session() as s:
            return list(s.exec(select(CacheUse).where(CacheUse.evicted_at.is_(None))  # type: ignore[union-attr]
                               .order_by(CacheUse.used_at)))

    def cache_bytes(self) -> int:
        """The size of the entries on disk (one aggregate: checked after every publication)."""
        with self.session() as s:
            q = select(func.coalesce(func.sum(CacheUse.size_bytes), 0)).where(
                CacheUse.evicted_at.is_(None))  # type: ignore[union-attr]
            return int(s.exec(q).one())

    def cache_evicted(self, key: str) -> None:
        with self.session() as s:
            row = s.get(CacheUse, key)
            if row is not None:
                row.evicted_at = now()
                s.add(row)
                s.commit()

    def keys_of(self, commits: Iterable[str]) -> set[str]:
        """Every stage key the runs of these commits used (executed, shared or served)."""
        commits = list(commits)
        if not commits:
            return set()
        with self.session() as s:
            q = select(StageExec.key).join(Run, Run.id == StageExec.run_id).where(  # type: ignore[arg-type]
                Run.commit.in_(commits))  # type: ignore[attr-defined]
            return set(s.exec(q))

    def commits_in_flight(self) -> set[str]:
        """Commits with runs queued or running."""
        with self.session() as s:
            q = select(Run.commit).where(Run.status.in_((RunStatus.QUEUED, RunStatus.RUNNING))).distinct()  # type: ignore[attr-defined]
            return set(s.exec(q))

    def cache_hit_facts(self, key: str) -> tuple[float, str | None]:
        """A cache entry's compute and the measurement environment it was made in (None: unknown)."""
        with self.session() as s:
            entry = s.get(CacheEntry, key)
            return (entry.cpu_s, entry.env_id) if entry else (0.0, None)

    def method_failures(self, keys: list[str]) -> dict[str, tuple[str, str]]:
        """Of these stage keys, those with a method failure recorded in this stage environment
        (`STAGE_ENV_VERSION`: one an older version of the tool recorded may have been its own
        doing): key → (outcome, detail) of its first."""
        out: dict[str, tuple[str, str]] = {}
        with self.session() as s:
            for chunk in in_chunks(keys):
                q = (select(StageExec.key, StageExec.outcome, StageExec.detail)
                     .where(StageExec.key.in_(chunk),  # type: ignore[attr-defined]
                            StageExec.outcome.in_(METHOD_OUTCOMES),  # type: ignore[attr-defined]
                            StageExec.env == STAGE_ENV_VERSION)
                     .order_by(StageExec.id))
                for key, outcome, detail in s.exec(q):
                    out.setdefault(key, (outcome, detail or outcome))
        return out

