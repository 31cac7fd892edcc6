"""Reads of results, comparisons, holdout scores, stage executions and goodput (smoke runs' beside), and the gate's
records (see `pipeline.store`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from sqlalchemy import case, func
from sqlalchemy.exc import IntegrityError
from sqlmodel import select

from pipeline.outcomes import EXECUTED_OUTCOMES, ResultOutcome, INFRA_OUTCOMES, METHOD_OUTCOMES, SERVED_OUTCOMES, RunStatus
from pipeline.store.tables import (
    BaselineCommit,
    Comparison,
    FdrTest,
    GateRecord,
    Goodput,
    GpuUsage,
    HarnessExec,
    StageGpu,
    HoldoutScore,
    MeasureEnv,
    Result,
    Run,
    SmokeExec,
    StageExec,
    now,
)


class Reads:
    """The reads and the gate records of `Store`. Mixed into `Store`, whose `session()` each method uses."""

    def finished_runs_by_commit(self) -> dict[str, int]:
        """{commit: its finished runs (done or failed)}, in one query."""
        with self.session() as s:
            q = (select(Run.commit, func.count()).where(Run.status.in_((RunStatus.DONE, RunStatus.FAILED)))  # type: ignore[attr-defined]
                 .group_by(Run.commit))
            return {str(c): int(n) for c, n in s.exec(q)}

    def runs(self, ids: Iterable[int] | None = None, commit: str | None = None,
             status: str | None = None) -> list[Run]:
        """Runs in id order: all, or those with these ids, of this commit, in this status."""
        with self.session() as s:
            q = select(Run).order_by(Run.id)
            if ids is not None:
                q = q.where(Run.id.in_(list(ids)))  # type: ignore[union-attr]
            if commit is not None:
                q = q.where(Run.commit == commit)
            if status is not None:
                q = q.where(Run.status == status)
            return list(s.exec(q))

    def results_for(self, commit: str, tasks: Iterable[str] | None = None) -> list[Result]:
        """Every result row of a commit (a full sha), failures with their kind and detail."""
        with self.session() as s:
            q = select(Result).where(Result.commit == commit).order_by(Result.task, Result.seed)
            if tasks is not None:
                q = q.where(Result.task.in_(list(tasks)))  # type: ignore[attr-defined]
            return list(s.exec(q))

    def results_by_task(self, commit: str, tasks: Iterable[str] | None = None) -> dict[str, dict[int, float | None]]:
        """{task: {seed: metric, or None for a method failure}} of a commit's finished runs (`by_task`)."""
        tasks = list(tasks) if tasks is not None else None
        return by_task(self.results_for(commit, tasks), tasks)

    def mark_baseline(self, commit: str) -> None:
        with self.session() as s:
            if s.get(BaselineCommit, commit) is None:
                s.add(BaselineCommit(commit=commit))
                try:
                    s.commit()
                except IntegrityError:  # another driver marked it first
                    s.rollback()

    def mark_comparison(self, challenger: str, baseline: str) -> None:
        with self.session() as s:
            if s.get(Comparison, (challenger, baseline)) is None:
                s.add(Comparison(challenger=challenger, baseline=baseline))
                try:
                    s.commit()
                except IntegrityError:  # another driver recorded it first
                    s.rollback()

    def comparisons(self, latest: int | None = None) -> list[tuple[str, str]]:
        """(challenger, baseline) of every comparison (or of the `latest` ones), oldest first."""
        return [(c, b) for c, b, _ in self.comparisons_timed(latest)]

    def comparisons_timed(self, latest: int | None = None) -> list[tuple[str, str, float]]:
        """(challenger, baseline, when it was first recorded) of every comparison (or of the `latest`
        ones), oldest first; plain tuples (a year's are 16,000)."""
        cols = (Comparison.challenger, Comparison.baseline, Comparison.created_at)
        with self.session() as s:
            if latest is None:
                return [tuple(r) for r in s.exec(select(*cols).order_by(Comparison.created_at)).all()]
            q = select(*cols).order_by(Comparison.created_at.desc()).limit(latest)  # type: ignore[attr-defined]
            return [tuple(r) for r in s.exec(q).all()][::-1]

    def result_rows(self, commits: Iterable[str], tasks: Iterable[str] | None = None) -> list[Any]:
        """The result rows of several commits, in one session, as plain tuples of what a comparison
        reads (commit, task, seed, value, outcome, dataset_id, created_at, env_id; by attribute), not ORM
        objects: the lab's histories read a year of results (380,000 rows) at a hypothesis's first
        look, more commits than one statement binds (`in_chunks`)."""
        cols = (Result.commit, Result.task, Result.seed, Result.value, Result.outcome, Result.dataset_id,
                Result.created_at, Result.env_id)
        tasks = list(tasks) if tasks is not None else None  # once: every chunk asks for them
        out: list[Any] = []
        with self.session() as s:
            for chunk in in_chunks(commits):
                q = select(*cols).where(Result.commit.in_(chunk))  # type: ignore[attr-defined]
                if tasks is not None:
                    q = q.where(Result.task.in_(tasks))  # type: ignore[attr-defined]
                out.extend(s.exec(q).all())
        return out

    def put_env(self, env: Any) -> str:
        """Record a measurement environment (`pipeline.environment.Environment`) once; its id."""
        key = env.id
        with self.session() as s:
            if s.get(MeasureEnv, key) is None:
                s.add(MeasureEnv(id=key, doc=json.dumps(env.doc(), sort_keys=True)))
                try:
                    s.commit()
                except IntegrityError:  # another process recorded it first
                    s.rollback()
        return key

    def envs(self, ids: Iterable[str]) -> dict[str, Any]:
        """{id: Environment} of the recorded measurement environments among `ids`."""
        from pipeline.environment import Environment

        out: dict[str, Any] = {}
        with self.session() as s:
            for chunk in in_chunks(sorted(set(ids))):
                for row in s.exec(select(MeasureEnv).where(MeasureEnv.id.in_(chunk))):  # type: ignore[attr-defined]
                    out[row.id] = Environment.from_doc(json.loads(row.doc))
        return out

    def is_baseline(self, commit: str) -> bool:
        with self.session() as s:
            return s.get(BaselineCommit, commit) is not None

    def holdout_put(self, run_id: int, commit: str, task: str, seed: int, value: float) -> None:
        with self.session() as s:
            if s.get(HoldoutScore, run_id) is None:
                s.add(HoldoutScore(run_id=run_id, commit=commit, task=task, seed=seed, value=value))
                s.commit()

    def holdout_scores(self, commit: str) -> dict[str, dict[int, float]]:
        """{task: {seed: holdout score}} of a commit's holdout-scored runs."""
        out: dict[str, dict[int, float]] = {}
        with self.session() as s:
            for r in s.exec(select(HoldoutScore).where(HoldoutScore.commit == commit)):
                out.setdefault(r.task, {})[r.seed] = r.value
        return out

    def holdout_scores_of(self, commits: Iterable[str]) -> dict[str, dict[str, dict[int, float]]]:
        """`holdout_scores` of several commits in one session: {commit: {task: {seed: score}}}."""
        out: dict[str, dict[str, dict[int, float]]] = {}
        with self.session() as s:
            for chunk in in_chunks(commits):
                q = select(HoldoutScore.commit, HoldoutScore.task, HoldoutScore.seed, HoldoutScore.value).where(
                    HoldoutScore.commit.in_(chunk))  # type: ignore[attr-defined]
                for commit, task, seed, value in s.exec(q):
                    out.setdefault(commit, {}).setdefault(task, {})[seed] = value
        return out

    def stage_exec(self, eid: int) -> StageExec | None:
        """One stage execution by its id (the web page's log link)."""
        with self.session() as s:
            return s.get(StageExec, eid)

    def stage_execs(self, run_ids: Iterable[int] | None = None) -> list[StageExec]:
        with self.session() as s:
            q = select(StageExec).order_by(StageExec.id)
            if run_ids is not None:
                q = q.where(StageExec.run_id.in_(list(run_ids)))  # type: ignore[attr-defined]
            return list(s.exec(q))

    def gpu_by_run(self, run_ids: Iterable[int]) -> dict[int, tuple[float, float | None]]:
        """Each run's GPU-seconds (its stages' share × wall, every attempt) and the mean utilisation
        NVML saw over its stages (None where none was sampled): runs that used no GPU are left out."""
        ids = list(run_ids)
        if not ids:
            return {}
        with self.session() as s:
            q = (select(StageExec.run_id, func.sum(StageExec.gpu_s), func.avg(StageGpu.util))  # type: ignore[call-overload]
                 .join(StageGpu, StageGpu.exec_id == StageExec.id, isouter=True)  # type: ignore[arg-type]
                 .where(StageExec.run_id.in_(ids)).group_by(StageExec.run_id))  # type: ignore[attr-defined]
            rows = s.exec(q).all()
        return {int(r): (float(g), float(u) if u is not None else None) for r, g, u in rows if g}

    def alone_retries(self, commit: str) -> tuple[int, int]:
        """(measured runs of `commit` with a stage run again alone on its GPU after a CUDA OOM beside
        another stage, measured runs of `commit`)."""
        from pipeline.gpu_accounting import OOM_ALONE_DETAIL

        measured = (Result.commit == commit, Result.outcome == ResultOutcome.OK)
        with self.session() as s:  # both of the runs measured (a result, ok): none in flight or failed
            alone = s.exec(select(func.count(func.distinct(StageExec.run_id)))  # type: ignore[call-overload]
                           .join(Result, Result.run_id == StageExec.run_id)  # type: ignore[arg-type]
                           .where(*measured, StageExec.detail == OOM_ALONE_DETAIL)).one()
            runs = s.exec(select(func.count(Result.id)).where(*measured)).one()  # type: ignore[call-overload]
        return int(alone), int(runs)

    def goodput(self, since: float | None = None) -> Goodput:
        with self.session() as s:
            q = select(StageExec.outcome, func.sum(StageExec.cpu_s), func.sum(StageExec.saved_cpu_s),  # type: ignore[call-overload]
                       func.sum(StageExec.gpu_s), func.count()).group_by(StageExec.outcome)
            if since is not None:
                q = q.where(StageExec.started_at >= since)
            rows = s.exec(q).all()
            rq = select(func.coalesce(func.sum(Run.requeues), 0), func.coalesce(func.sum(Run.infra_failures), 0))
            requeues, infra = s.exec(rq).one()  # type: ignore[call-overload]
        by: dict[str, tuple[float, float, float, int]] = {
            o: (float(c or 0), float(sv or 0), float(g or 0), int(n)) for o, c, sv, g, n in rows
        }

        def cpu(*outcomes: str) -> float:
            return sum(by.get(o, (0.0, 0.0, 0.0, 0))[0] for o in outcomes)

        def gpu(*outcomes: str) -> float:
            return sum(by.get(o, (0.0, 0.0, 0.0, 0))[2] for o in outcomes)

        with self.session() as s:
            q = select(func.coalesce(func.sum(GpuUsage.samples), 0), func.coalesce(func.sum(GpuUsage.busy), 0),
                       func.coalesce(func.sum(GpuUsage.util_sum), 0.0))
            if since is not None:
                q = q.where(GpuUsage.updated_at >= since)
            samples, busy, util_sum = s.exec(q).one()  # type: ignore[call-overload]
            q = select(func.count(), func.coalesce(func.sum(SmokeExec.cpu_s), 0.0),  # type: ignore[call-overload]
                       func.coalesce(func.sum(SmokeExec.gpu_s), 0.0), func.coalesce(func.sum(SmokeExec.wall_s), 0.0),
                       func.coalesce(func.sum(case((SmokeExec.outcome == "method", 1), else_=0)), 0))
            if since is not None:
                q = q.where(SmokeExec.started_at >= since)
            smokes, smoke_cpu, smoke_gpu, smoke_wall, smoke_rejected = s.exec(q).one()  # type: ignore[call-overload]
            q = select(func.count(), func.coalesce(func.sum(HarnessExec.cpu_s), 0.0),  # type: ignore[call-overload]
                       func.coalesce(func.sum(HarnessExec.gpu_s), 0.0))
            if since is not None:
                q = q.where(HarnessExec.started_at >= since)
            harness_calls, harness_cpu, harness_gpu = s.exec(q).one()  # type: ignore[call-overload]

        return Goodput(
            useful_cpu_s=cpu("ok"),
            method_failed_cpu_s=cpu(*METHOD_OUTCOMES),
            infra_lost_cpu_s=cpu(*INFRA_OUTCOMES),
            saved_by_cache_cpu_s=sum(by.get(o, (0.0, 0.0, 0.0, 0))[1] for o in SERVED_OUTCOMES),
            gpu_s=sum(v[2] for v in by.values()),
            stages_executed=sum(by.get(o, (0, 0, 0, 0))[3] for o in EXECUTED_OUTCOMES),
            cache_hits=sum(by.get(o, (0, 0, 0, 0))[3] for o in SERVED_OUTCOMES),
            infra_retries=int(infra),
            requeues=int(requeues),
            useful_gpu_s=gpu("ok"),
            method_failed_gpu_s=gpu(*METHOD_OUTCOMES),
            infra_lost_gpu_s=gpu(*INFRA_OUTCOMES),
            gpu_samples=int(samples),
            gpu_busy_share=int(busy) / int(samples) if samples else None,
            gpu_mean_util=float(util_sum) / int(samples) if samples else None,
            smoke_runs=int(smokes),
            smoke_rejected=int(smoke_rejected),
            smoke_cpu_s=float(smoke_cpu),
            smoke_gpu_s=float(smoke_gpu),
            smoke_wall_s=float(smoke_wall),
            harness_calls=int(harness_calls),
            harness_cpu_s=float(harness_cpu),
            harness_gpu_s=float(harness_gpu),
        )

    def smoke_spent(self, hypothesis: str) -> dict[str, float]:
        """What the smoke runs booked under `hypothesis` spent: runs, CPU seconds, GPU-seconds, wall
        seconds (all 0 where none was)."""
        with self.session() as s:
            n, cpu, gpu, wall = s.exec(select(  # type: ignore[call-overload]
                func.count(), func.coalesce(func.sum(SmokeExec.cpu_s), 0.0), func.coalesce(func.sum(SmokeExec.gpu_s), 0.0),
                func.coalesce(func.sum(SmokeExec.wall_s), 0.0)).where(SmokeExec.hypothesis == hypothesis)).one()
        return {"runs": float(n), "cpu_s": float(cpu), "gpu_s": float(gpu), "wall_s": float(wall)}

    def fdr_test(self, challenger: str, baseline: str, level: Callable[[int, int], float]) -> FdrTest:
        """The comparison's test of the lab's stream: the one recorded, else the next index with
        `level(index, discoveries so far)`, recorded now (once: a concurrent first judgement of the
        same comparison, or of another at the same index, loses on the unique keys and reads again)."""
        for _ in range(5):
            with self.session() as s:
                row = s.exec(select(FdrTest).where(FdrTest.challenger == challenger,
                                                   FdrTest.baseline == baseline)).first()
                if row is not None:
                    return row
                n = s.exec(select(func.count()).select_from(FdrTest)).one()
                d = s.exec(select(func.count()).select_from(FdrTest)
                           .where(FdrTest.discovered_at.is_not(None))).one()  # type: ignore[union-attr]
                row = FdrTest(challenger=challenger, baseline=baseline, index=int(n) + 1,
                              alpha=level(int(n) + 1, int(d)), discoveries_before=int(d))
                s.add(row)
                try:
                    s.commit()
                    return row
                except IntegrityError:
                    s.rollback()
        raise RuntimeError(f"could not record the stream test of {challenger[:12]} against {baseline[:12]}")

    def fdr_discovered(self, challenger: str, baseline: str) -> None:
        """The comparison's gate said `improvement`: a discovery of the stream (counted once)."""
        with self.session() as s:
            row = s.exec(select(FdrTest).where(FdrTest.challenger == challenger, FdrTest.baseline == baseline)).first()
            if row is not None and row.discovered_at is None:
                row.discovered_at = now()
                s.add(row)
                s.commit()

    def fdr_stream(self) -> tuple[int, int]:
        """(tests, discoveries) of the lab's stream so far."""
        with self.session() as s:
            n = s.exec(select(func.count()).select_from(FdrTest)).one()
            d = s.exec(select(func.count()).select_from(FdrTest).where(FdrTest.discovered_at.is_not(None))).one()  # type: ignore[union-attr]
        return int(n), int(d)

    def put_gate_record(self, hypothesis: str, look: int, payload: Any, kind: str = "verdict") -> GateRecord:
        """Store (or replace) the gate's record for (hypothesis, look, kind).

        `payload` may be a pydantic model (stored as its JSON form) or anything JSON-serialisable.
        Replacing keeps the call idempotent for an agent node that re-runs after a crash.
        """
        if hasattr(payload, "model_dump"):
            payload = payload.model_dump(mode="json")
        payload = json.loads(json.dumps(payload, allow_nan=False))
        with self.session() as s:
            rec = s.exec(select(GateRecord).where(
                GateRecord.hypothesis == hypothesis, GateRecord.look == look, GateRecord.kind == kind
            )).first()
            if rec is None:
                rec = GateRecord(hypothesis=hypothesis, look=look, kind=kind, payload=payload)
            else:
                rec.payload = payload
                rec.created_at = now()
            s.add(rec)
            try:
                s.commit()
            except IntegrityError:  # a concurrent writer inserted it first: overwrite theirs
                s.rollback()
                return self.put_gate_record(hypothesis, look, payload, kind)
            s.refresh(rec)
            return rec

    def move_gate_records(self, hypothesis: str, to: str, kinds: tuple[str, ...]) -> int:
        """Move the records of `kinds` from `hypothesis` to the key `to`, in one transaction (a record
        already under `to` for the same look and kind is replaced). Idempotent: a second call finds
        nothing left to move. How a re-based hypothesis's earlier comparison is kept aside."""
        with self.session() as s:
            rows = list(s.exec(select(GateRecord).where(GateRecord.hypothesis == hypothesis,
                                                        GateRecord.kind.in_(kinds))))
            return rekey(s, GateRecord, rows, to, ("look", "kind"))

    def latest_gate_records(self, kind: str, hypotheses: Iterable[str] | None = None) -> dict[str, GateRecord]:
        """Every hypothesis's (or these hypotheses') record of `kind` at its deepest look, {hypothesis:
        record}: only the deepest looks are read (a year of hypotheses has several records each)."""
        deepest = (select(GateRecord.hypothesis, func.max(GateRecord.look).label("look"))
                   .where(GateRecord.kind == kind).group_by(GateRecord.hypothesis))
        out: dict[str, GateRecord] = {}
        with self.session() as s:
            for chunk in [None] if hypotheses is None else in_chunks(hypotheses):
                q = deepest if chunk is None else deepest.where(GateRecord.hypothesis.in_(chunk))  # type: ignore[attr-defined]
                sub = q.subquery()
                rows = s.exec(select(GateRecord).join(sub, (GateRecord.hypothesis == sub.c.hypothesis)  # type: ignore[arg-type]
                                                      & (GateRecord.look == sub.c.look))
                              .where(GateRecord.kind == kind))
                out.update((r.hypothesis, r) for r in rows)
        return out

    def gate_records(self, hypothesis: str, kind: str | None = None) -> list[GateRecord]:
        with self.session() as s:
            q = select(GateRecord).where(GateRecord.hypothesis == hypothesis).order_by(GateRecord.look, GateRecord.kind)
            if kind is not None:
                q = q.where(GateRecord.kind == kind)
            return list(s.exec(q))


IN_CHUNK = 500  # values bound in one IN list: far under PostgreSQL's 65,535 and SQLite's usual 32,766


def in_chunks(values: Iterable[str], n: int = IN_CHUNK) -> Iterator[list[str]]:
    """The distinct `values`, sorted, `n` at a time: a year of commits or hypotheses is more than one
    statement binds."""
    distinct = sorted(set(values))
    for i in range(0, len(distinct), n):
        yield distinct[i:i + n]


def by_task(rows: Iterable[Result], tasks: Iterable[str] | None = None) -> dict[str, dict[int, float | None]]:
    """Result rows as {task: {seed: metric, or None for a method failure}}; infrastructure failures
    are left out (they say nothing about the method), unfinished runs are absent."""
    out: dict[str, dict[int, float | None]] = {t: {} for t in (tasks or [])}
    for r in rows:
        if ResultOutcome(r.outcome).counts():
            out.setdefault(r.task, {})[r.seed] = r.value
    return out


def rekey(s: Any, model: Any, rows: list[Any], to: str, same: tuple[str, ...]) -> int:
    """Give `rows` (of `model`, keyed by its `hypothesis` column) the key `to`, replacing the rows
    already under `to` that equal one of them on the columns `same`; committed in `s`'s transaction.
    How many moved. A re-based comparison's gate records and the agent's decisions move this way."""
    for r in rows:
        for old in s.exec(select(model).where(model.hypothesis == to,
                                              *(getattr(model, c) == getattr(r, c) for c in same))):
            s.delete(old)
    s.flush()
    for r in rows:
        r.hypothesis = to
        s.add(r)
    s.commit()
    return len(rows)
