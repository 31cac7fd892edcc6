"""The queue: runs queued, claimed under a token, heartbeated, finished or given back, and
reconciled after a dead driver (see `pipeline.store`)."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

from sqlalchemy import delete, func, update
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, select

from pipeline.outcomes import ResultOutcome, StageOutcome
from pipeline.store.tables import Arm, Claim, HoldoutScore, Owner, Result, Run, RunStatus, StageExec, now


class Queue:
    """The queue's methods of `Store`. Mixed into `Store`, whose `session()` each method uses."""

    def ensure_arm(self, commit: str, label: str | None = None) -> None:
        with self.session() as s:
            if s.get(Arm, commit) is None:
                s.add(Arm(commit=commit, label=label))
                try:
                    s.commit()
                except IntegrityError:  # another process added it between our read and write
                    s.rollback()

    def enqueue(self, commit: str, pairs: Iterable[tuple[str, int]], priority: int = 0) -> list[int]:
        """Queue (task, seed) runs of `commit` unless they exist; return every run id, in order.

        Idempotent: the agent may call it again after a crash without creating duplicates. A run
        that exists and is still queued has its priority raised to `priority` if that is higher
        (a baseline run a deeper look now waits for goes ahead with that look's runs); never lowered.
        One read of the commit's runs and one transaction for the new ones, whatever the count.
        """
        pairs = [(t, int(seed)) for t, seed in pairs]
        with self.session() as s:
            known = self._run_ids(s, commit)
            missing = [p for p in dict.fromkeys(pairs) if p not in known]
            if missing:
                s.add_all([Run(commit=commit, task=t, seed=seed, priority=priority) for t, seed in missing])
                try:
                    s.commit()
                except IntegrityError:  # another driver queued some of them meanwhile: theirs stand
                    s.rollback()
                    for t, seed in missing:
                        s.add(Run(commit=commit, task=t, seed=seed, priority=priority))
                        try:
                            s.commit()
                        except IntegrityError:
                            s.rollback()
                known = self._run_ids(s, commit)
            ids = [known[p] for p in pairs]
            raise_ids = [i for p, i in zip(pairs, ids) if p not in missing]
            if raise_ids and priority:
                s.exec(update(Run).where(Run.id.in_(raise_ids), Run.status == RunStatus.QUEUED,  # type: ignore[call-overload,union-attr]
                                         Run.priority < priority).values(priority=priority))  # type: ignore[operator]
                s.commit()
        return ids

    def withdraw_queued(self, commit: str, seeds: Iterable[int]) -> tuple[int, int]:
        """`commit`'s runs on `seeds` that nobody waits for any more, out of the way: those still queued
        that never ran are removed; those queued again after a crash (their stage history is kept, for
        the accounting) and those running now (given back if the driver stops before they finish) go
        to the back of the queue (priority -1; `enqueue` raises it again if a look needs one). The
        conditional DELETE races a claim like another claim does: a run claimed first is only moved
        back. Returns (removed, moved back)."""
        seeds = sorted({int(x) for x in seeds})
        if not seeds:
            return 0, 0
        mine = (Run.commit == commit, Run.seed.in_(seeds))  # type: ignore[attr-defined]
        with self.session() as s:
            try:
                res = s.exec(delete(Run).where(  # type: ignore[call-overload]
                    *mine, Run.status == RunStatus.QUEUED, Run.id.not_in(select(StageExec.run_id)),  # type: ignore[union-attr]
                    Run.id.not_in(select(Result.run_id)), Run.id.not_in(select(HoldoutScore.run_id))))  # type: ignore[union-attr]
                s.commit()
                removed = int(res.rowcount or 0)
            except IntegrityError:  # one was claimed, started a stage and was given back meanwhile (its
                s.rollback()  # history is newer than the statement's snapshot): none removed, nothing lost
                removed = 0
            res = s.exec(update(Run).where(  # type: ignore[call-overload]
                *mine, Run.status.in_((RunStatus.QUEUED, RunStatus.RUNNING)),  # type: ignore[attr-defined]
                Run.priority > -1).values(priority=-1))  # type: ignore[operator]
            s.commit()
            return removed, int(res.rowcount or 0)

    @staticmethod
    def _run_ids(s: Session, commit: str) -> dict[tuple[str, int], int]:
        rows = s.exec(select(Run.task, Run.seed, Run.id).where(Run.commit == commit)).all()  # type: ignore[call-overload]
        return {(t, int(seed)): int(i) for t, seed, i in rows}

    def claim(self, owner: Owner, limit: int = 1, commits: Iterable[str] | None = None,
              dataset_id: str | None = None) -> list[Claim]:
        """Atomically take up to `limit` queued runs (highest priority, then oldest), recording the
        dataset they will be measured on (`dataset_id`) in the same write.

        A conditional UPDATE (`WHERE status = 'queued'`) is the lock: of two drivers racing for the
        same row exactly one sees rowcount 1. Works the same on SQLite and PostgreSQL.
        """
        claims: list[Claim] = []
        with self.session() as s:
            q = select(Run.id).where(Run.status == RunStatus.QUEUED).order_by(Run.priority.desc(), Run.id)  # type: ignore[attr-defined]
            if commits is not None:
                q = q.where(Run.commit.in_(list(commits)))  # type: ignore[attr-defined]
            if s.get_bind().dialect.name == "postgresql":
                return self._claim_returning(s, q, owner, limit, dataset_id)
            candidates = list(s.exec(q.limit(limit * 4 + 4)))
            for run_id in candidates:
                if len(claims) >= limit:
                    break
                token = uuid.uuid4().hex
                t = now()
                res = s.exec(  # type: ignore[call-overload]
                    update(Run)
                    .where(Run.id == run_id, Run.status == RunStatus.QUEUED)  # type: ignore[arg-type]
                    .values(
                        status=RunStatus.RUNNING, owner_host=owner.host, owner_pid=owner.pid,
                        owner_started=owner.started, claim_token=token, heartbeat_at=t, started_at=t,
                        **({"dataset_id": dataset_id} if dataset_id is not None else {}),
                    )
                )
                s.commit()
                if res.rowcount == 1:
                    run = s.get(Run, run_id)  # not loaded in this session before: read as just updated
                    assert run is not None and run.claim_token == token
                    claims.append(Claim(run, token))
        return claims

    @staticmethod
    def _claim_returning(s: Session, q: Any, owner: Owner, limit: int, dataset_id: str | None) -> list[Claim]:
        """PostgreSQL: up to `limit` runs claimed in two statements of one transaction, whatever the
        batch: `SELECT … FOR UPDATE SKIP LOCKED` locks them (rows another driver is claiming now are
        skipped, not waited for) and one `UPDATE … RETURNING` takes them. Not one statement: as a
        subquery of the UPDATE, PostgreSQL may run the locking SELECT once per row it updates, each
        time finding the next unlocked row, and claim every queued run. One token for the batch (it
        proves this claim of each run, as one per run would)."""
        ids = list(s.exec(q.limit(limit).with_for_update(skip_locked=True)))
        if not ids:
            s.rollback()
            return []
        token, t = uuid.uuid4().hex, now()
        stmt = (update(Run).where(Run.id.in_(ids), Run.status == RunStatus.QUEUED)  # type: ignore[attr-defined]
                .values(status=RunStatus.RUNNING, owner_host=owner.host, owner_pid=owner.pid, owner_started=owner.started,
                        claim_token=token, heartbeat_at=t, started_at=t,
                        **({"dataset_id": dataset_id} if dataset_id is not None else {}))
                .returning(Run).execution_options(synchronize_session=False))
        runs = list(s.execute(stmt).scalars())
        s.commit()
        runs.sort(key=lambda r: (-r.priority, r.id))  # RETURNING's order is the table's, not the queue's
        return [Claim(r, token) for r in runs]

    def heartbeat(self, owner: Owner) -> int:
        """Refresh every claim this process holds; a driver on another host reads staleness from it."""
        with self.session() as s:
            res = s.exec(  # type: ignore[call-overload]
                update(Run)
                .where(Run.status == RunStatus.RUNNING, Run.owner_host == owner.host, Run.owner_pid == owner.pid)  # type: ignore[arg-type]
                .values(heartbeat_at=now())
            )
            s.commit()
            return int(res.rowcount)

    def set_dataset(self, run_id: int, token: str, dataset_id: str) -> None:
        with self.session() as s:
            s.exec(  # type: ignore[call-overload]
                update(Run).where(Run.id == run_id, Run.claim_token == token).values(dataset_id=dataset_id)  # type: ignore[arg-type]
            )
            s.commit()

    def note_infra_failure(self, run_id: int) -> None:
        with self.session() as s:
            s.exec(  # type: ignore[call-overload]
                update(Run).where(Run.id == run_id).values(infra_failures=Run.infra_failures + 1)  # type: ignore[arg-type]
            )
            s.commit()

    def finish(self, claim: Claim, result: Result, status: RunStatus = RunStatus.DONE) -> bool:
        """Write the run's result and close its claim in one transaction.

        Returns False (and writes nothing) when the claim is no longer ours: the run was taken back
        after our heartbeat went stale, or a result already exists. That is how a result is counted
        exactly once even if two drivers believed they owned the run.
        """
        with self.session() as s:
            res = s.exec(  # type: ignore[call-overload]
                update(Run)
                .where(Run.id == claim.run.id, Run.claim_token == claim.token, Run.status == RunStatus.RUNNING)  # type: ignore[arg-type]
                .values(status=status, finished_at=now(), claim_token=None)
            )
            if res.rowcount != 1:
                s.rollback()
                return False
            s.add(result)
            try:
                s.commit()
            except IntegrityError:
                s.rollback()
                return False
            return True

    def release(self, claim: Claim, *, count_requeue: bool) -> bool:
        """Give a claimed run back to the queue (graceful stop, or a retry after lost ownership)."""
        with self.session() as s:
            values: dict[str, Any] = dict(
                status=RunStatus.QUEUED, owner_host=None, owner_pid=None, owner_started=None, claim_token=None
            )
            if count_requeue:
                values["requeues"] = Run.requeues + 1
            res = s.exec(  # type: ignore[call-overload]
                update(Run).where(Run.id == claim.run.id, Run.claim_token == claim.token).values(**values)  # type: ignore[arg-type]
            )
            s.commit()
            return res.rowcount == 1

    def reconcile(self, stale_s: float = 120.0, *, max_requeues: int = 5, reclaim: Owner | None = None,
                  heartbeat_s: float = 5.0, gpus: float = 0.0) -> list[int]:
        """Take back runs left "running" by a dead driver: re-queue them under the same key.

        Dead means: on this host, the owner process is gone (or its pid was recycled); on another
        host, its heartbeat is older than `stale_s`. Their unfinished stage executions become
        "lost" (GPU-seconds: the share each was launched with, or `gpus`, the lab's share, where
        it was not recorded, × that time),
        counted as compute lost to infrastructure from their start to the driver's death: at
        most the first heartbeat it missed (`heartbeat_s` after its last), which is the figure kept.
        A run lost more than `max_requeues`
        times is failed as an infrastructure failure instead of looping forever (a stage that
        takes the whole machine down with it). `reclaim` names a live owner whose claims are
        known to be orphaned too: a new driver in the process of one that failed without closing.
        """
        requeued: list[int] = []
        t = now()
        with self.session() as s:
            running = list(s.exec(select(Run).where(Run.status == RunStatus.RUNNING)))
        for run in running:
            owner = Owner(run.owner_host or "", run.owner_pid or -1, run.owner_started or 0.0)
            alive = False if owner.same(reclaim) else owner.alive()
            if alive is None:
                alive = (t - (run.heartbeat_at or 0.0)) < stale_s
            if alive:
                continue
            with self.session() as s:
                lost_execs = list(
                    s.exec(select(StageExec).where(StageExec.run_id == run.id, StageExec.outcome == StageOutcome.RUNNING))
                )
                for ex in lost_execs:
                    ex.outcome = StageOutcome.LOST
                    # the driver died between its last heartbeat and the one it missed: the stage's
                    # work is lost up to then (never past now); a core kept busy all along
                    last = run.heartbeat_at or ex.started_at
                    ex.finished_at = max(ex.started_at, min(t, max(last, ex.started_at) + heartbeat_s))
                    ex.wall_s = ex.finished_at - ex.started_at
                    ex.cpu_s = ex.wall_s
                    ex.gpu_s = ex.wall_s * (ex.gpu_share if ex.gpu_share is not None else gpus)  # held all along
                    lo = max(0.0, last - ex.started_at)
                    ex.detail = (f"driver {owner.host}:{owner.pid} died: {lo:.1f}-{ex.wall_s:.1f} s of work lost "
                                 "(between its last heartbeat and the one it missed; cpu_s = the upper bound)")
                    s.add(ex)
                giving_up = run.requeues + 1 > max_requeues
                values: dict[str, Any] = dict(
                    owner_host=None, owner_pid=None, owner_started=None, claim_token=None,
                    requeues=Run.requeues + 1,
                )
                if giving_up:
                    values.update(status=RunStatus.FAILED, finished_at=t)
                else:
                    values.update(status=RunStatus.QUEUED)
                res = s.exec(  # type: ignore[call-overload]
                    update(Run)
                    .where(Run.id == run.id, Run.claim_token == run.claim_token, Run.status == RunStatus.RUNNING)  # type: ignore[arg-type]
                    .values(**values)
                )
                if res.rowcount != 1:
                    s.rollback()
                    continue
                if giving_up:
                    s.add(Result(
                        run_id=run.id, commit=run.commit, task=run.task, seed=run.seed, outcome=ResultOutcome.INFRA_FAILURE,
                        kind="lost", detail=f"driver died {run.requeues + 1} times while running it",
                        dataset_id=run.dataset_id,
                    ))
                try:
                    s.commit()
                except IntegrityError:
                    s.rollback()
                    continue
                if not giving_up:
                    requeued.append(int(run.id))  # type: ignore[arg-type]
        return requeued

    def count_unfinished(self, ids: Iterable[int]) -> int:
        """How many of these runs are still queued or running (cheap enough to ask every turn)."""
        with self.session() as s:
            q = select(func.count()).select_from(Run).where(
                Run.id.in_(list(ids)), Run.status.in_((RunStatus.QUEUED, RunStatus.RUNNING))  # type: ignore[union-attr,attr-defined]
            )
            return int(s.exec(q).one())  # type: ignore[call-overload]

    def count_queued(self) -> int:
        with self.session() as s:
            return int(s.exec(select(func.count()).select_from(Run).where(Run.status == RunStatus.QUEUED)).one())  # type: ignore[call-overload]

    def queue_counts(self) -> dict[str, int]:
        with self.session() as s:
            rows = s.exec(select(Run.status, func.count()).group_by(Run.status)).all()  # type: ignore[call-overload]
        counts = {"queued": 0, "running": 0, "done": 0, "failed": 0}
        counts.update({status: int(n) for status, n in rows})
        return counts
