"""The measurement protocol: which runs measure an arm, and what the gate says about them.

The agent hands in commits and gets back run ids, gate results and re-verifications; it never
picks a seed, builds a gate input or touches an executor. One object per lab and store:

    exp = Experiment(lab, store)
    ids = exp.queue_look(base, commit, look, rank=r)  # the runs a look needs of both arms, idempotent
    if exp.finished(ids):                             # the gate's answer, recorded under the key
        result = exp.judge_look(base, commit, look, record_as="12")  # pipeline.gate.GateResult
    exp.queue_replication(base, commit)               # a granted promotion's replication on fresh seeds
    exp.replication(base, commit, record_as="12")     # its verdict (None until its runs are in)
    exp.queue_champion(commit, tag)                   # a promoted champion's fresh baseline runs
    exp.reverification(tag, commit, base, look)       # how it held up on them (None until all are in)
    exp.smoke(base, files)                            # the whole pipeline on tiny data, sandboxed
    exp.release(commit)                               # a decided challenger's worktree goes
    exp.close()

    driver = exp.driver(ExecutorOptions(workers=8))   # the execution layer: works the queue
    driver.start(); driver.drive(until=...); driver.close()

Seeds. A baseline that has had g promotions owns the seed block g * SEED_BLOCK, g * SEED_BLOCK + 1,
...: its own runs and its challengers' use the first seeds of it. So a challenger and its baseline
share seed k, and with it every seed-scoped stage (pretraining) through the cache whenever the
challenger does not change that stage, and the fine-tuning seed: the arms are common random
numbers, and the default protocol (`paired`) tests the differences of seed k. With it the
baseline is lazy: its seed k is run only when a challenger first reaches seed k (at least 2
seeds, for a task's σ), and serves every challenger of its generation. A promoted champion
re-verifies on the next block, seeds it was not selected on: the first seeds of that block are
its re-verification and its own challengers' first baseline runs at once; they never replay the
lucky seeds it was selected on (with deterministic training a no-op of the champion reproduces the
champion's runs exactly: Δ = 0, never promoted). With `[gate] replicate_runs` a promotion is first
replicated on the first seeds of the next block (both arms): the champion's runs there are its
replication's, which it passed, so its first challengers pair with seeds it was selected on (a bias
against them: conservative), and it re-verifies on the seeds after those. Every (challenger,
baseline) pair is recorded
(`Comparison`): their paired differences are the lab's history, the prior of the paired test's
variance. The two-sample protocols (`sequential`, `fixed`) run every baseline seed up front and
ignore the pairing (conservative where the arms share a shock).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypedDict

from pipeline import runner
from pipeline.executors import Executor, ExecutorOptions
from pipeline.lab import SEED_BLOCK, SEED_BLOCKS, Lab
from pipeline.labrepo import (
    generation,  # noqa: F401 (re-exported: a baseline's generation)
    generations,
    resolve_commit,
    resolve_commits,
)
from pipeline.errors import UserError
from pipeline.labnames import BASELINE_BRANCH
from pipeline.outcomes import ResultOutcome, RunStatus
from pipeline.store import Store
from pipeline.store.reads import by_task

if TYPE_CHECKING:
    from pipeline.gate.replication import Replication
    from pipeline.gate.report import GateResult
    from pipeline.lease import Heartbeat
    from pipeline.smoke import SmokeRunner
    from pipeline.store.tables import FdrTest, Goodput

log = logging.getLogger(__name__)

LOOK_RANK = 100  # queue priority: a look's place in the schedule outranks the caller's rank (0-99)
FROZEN_HISTORIES = 256  # frozen histories kept per Experiment (a few per hypothesis in flight)
HISTORY_COMPARISONS = 1000  # `histories` reads the lab's latest comparisons


ALONE_HOLD_MIN = 2  # runs re-run alone after a CUDA OOM before a gain is held for it (`Experiment.ran_alone`)


class TaskReverification(TypedDict):
    task: str
    fresh: float  # the champion's mean on its fresh seeds
    selected: float  # its challenger's mean on the runs it was selected on
    fresh_runs: int


class Reverification(TypedDict):
    """How a champion held up on fresh seeds (`Experiment.reverification`); stored as a gate record
    of kind `reverify`."""

    tag: str
    tasks: list[TaskReverification]
    fresh_mean: float
    selected_mean: float
    shrinkage: float  # fresh − selected: the winner's curse, measured
    tasks_worse: int  # by the metric's direction
    fresh_seeds: list[int]


def seed_block(generation: int) -> range:
    """The seeds owned by a baseline with `generation` promotions: its own runs and its challengers'."""
    start = (generation % SEED_BLOCKS) * SEED_BLOCK
    return range(start, start + SEED_BLOCK)


def baseline_seeds(n: int, generation: int = 0) -> range:
    """The seeds of the first `n` own runs of a baseline with `generation` promotions."""
    return seed_block(generation)[:n]


def challenger_seeds(n_runs: int, generation: int = 0) -> range:
    """The seeds of the first `n_runs` runs of a challenger of a baseline with `generation` promotions
    (the same block as the baseline's: seed k of one arm pairs with seed k of the other)."""
    return seed_block(generation)[:n_runs]


def _one_dataset(rows: list[Any]) -> str | None:
    """The dataset the result rows of a comparison were all measured on (None: unrecorded), or
    `LabConfigError` (one line; the look waits at its checkpoint)."""
    from pipeline.errors import LabConfigError

    seen = {r.dataset_id for r in rows if r.dataset_id and ResultOutcome(r.outcome).counts()}
    if len(seen) > 1:
        raise LabConfigError(None, None,
            f"the runs of this comparison were measured on different datasets ({', '.join(sorted(seen))}): the data "
            "changed under this store (a new generator version, data_seed, size or trusted commit); "
            "use a fresh store (--db, or move runs/autoresearch.db aside) to measure on the new data")
    return next(iter(seen), None)


def open_store(lab: Lab, url: str | None = None) -> Store:
    """The lab's store: `url` (any SQLAlchemy URL) or SQLite at `runs/autoresearch.db`."""
    return Store.for_lab(lab, url)


def ensure_runs(store: Store, lab: Lab, commit: str, tasks: Iterable[str], seeds: Iterable[int], *,
                priority: int = 0, label: str | None = None, harness: Any = None) -> list[int]:
    """Queue runs of `commit` (sha, branch or tag) for every (task, seed) not queued yet; idempotent
    (a run is unique per commit, task and seed: called again after a crash, it creates nothing).

    Returns the ids of all the requested runs, in task-major order (the order they are claimed,
    which interleaves seeds so that seed-scoped stages of different seeds start together). An
    unknown task is a `UserError` naming the suite's tasks.
    """
    sha = resolve_commit(lab, commit)
    tasks = list(tasks)
    (harness or lab.harness()).tasks(lab.config.benchmark.suite, tasks)  # raises UserError
    store.ensure_arm(sha, label or (commit if commit != sha else None))
    return store.enqueue(sha, [(t, int(s)) for t in tasks for s in seeds], priority=priority)


def results(store: Store, lab: Lab | None, commit: str, tasks: Iterable[str] | None = None) -> dict[str, dict[int, float | None]]:
    """{task: {seed: metric, or None for a method failure}} of the finished runs of a commit (a
    revision of `lab`, or a full sha with `lab` None). Infrastructure failures are left out;
    unfinished runs are absent."""
    sha = resolve_commit(lab, commit) if lab is not None else commit
    return store.results_by_task(sha, tasks)


def harness_suites(name: str) -> dict[str, Any] | None:
    """The suites of the harness `name` (`autoresearch init`), or None if no harness has that name."""
    from pipeline.harness import HARNESSES, get_harness

    return dict(get_harness(name).suites or {}) if name in HARNESSES else None


class Experiment:
    """The measurement protocol of one lab, over one store, and the execution layer behind it."""

    def __init__(self, lab: Lab, store: Store):
        self.lab = lab
        self.store = store
        self._smoke_runner: SmokeRunner | None = None
        self._lender: Any = None  # the last driver's executor, if it can run a smoke stage ahead of its queue
        self._frozen: dict[tuple[Any, ...], Any] = {}  # histories frozen at a recorded comparison (`histories`)

    # --- the execution layer -------------------------------------------------------------------

    def driver(self, executor: ExecutorOptions | None = None, *, heartbeat: Heartbeat | None = None) -> runner.Driver:
        """The one thing that executes runs: a `Driver` working this lab's queue in this store on the
        named executor's slots (`driver.slots`). `drive` it in one thread; `close` it in the same.
        `heartbeat`: the process's `pipeline.lease.Heartbeat` (the loop's, with its lease); without
        one the driver beats for its runs itself."""
        ex = self._executor(executor)
        # a GPU lab's smoke stages may run there (`SmokeRunner.remote`): this driver's, not an older one's
        self._lender = ex if hasattr(ex, "run_ahead") else None
        if self._smoke_runner is not None and self._smoke_runner.lender is not self._lender:
            self._smoke_runner.close()
            self._smoke_runner = None
        try:
            prefer = self._baseline_environment_or_none() if hasattr(ex, "environments") else None
            return runner.Driver(self.lab, self.store, ex, heartbeat=heartbeat, prefer_env=prefer)
        except BaseException:  # its warm workers (a cluster's actors) go with it
            self._lender = None
            ex.close()
            raise

    def _baseline_environment_or_none(self) -> str | None:
        try:
            return self.baseline_environment()[1]
        except UserError:  # no baseline branch yet
            return None

    def _executor(self, opts: ExecutorOptions | None) -> Executor:
        return runner.make_executor(opts or ExecutorOptions(), self.lab)

    def results(self, commit: str, tasks: list[str] | None = None) -> dict[str, dict[int, float | None]]:
        """{task: {seed: metric, or None for a method failure}} of a commit's finished runs (a full sha)."""
        return results(self.store, None, commit, tasks)

    def goodput(self, since: float | None = None) -> Goodput:
        """Where the compute went (`runner.Goodput`), since a time or ever."""
        return self.store.goodput(since)

    def trust(self, rev: str | None = None) -> tuple[str, str]:
        """The trusted commit the harness files come from (`harness = "command"`): moved to `rev`
        (a human's decision) if given. Its tag and its sha."""
        from pipeline.errors import UserError
        from pipeline.harness.command import TRUSTED_TAG, set_trusted, trusted_commit

        if not self.lab.config.benchmark.trusted:
            raise UserError(f"harness {self.lab.config.benchmark.harness!r} has no trusted files; "
                            'only a lab with harness = "command" has a trusted commit')
        return TRUSTED_TAG, set_trusted(self.lab, rev) if rev is not None else trusted_commit(self.lab, create=False)

    # --- seeds ---------------------------------------------------------------------------------

    def generation(self, commit: str) -> int:
        return generation(str(self.lab.root), commit)

    def baseline_seeds(self, base_commit: str, n: int | None = None, *, gen: int | None = None) -> range:
        """A baseline's own seeds (`baseline_runs` of them unless `n`)."""
        g = self.generation(base_commit) if gen is None else gen
        return baseline_seeds(self.lab.config.gate.baseline_runs if n is None else n, g)

    def challenger_seeds(self, base_commit: str, look: int) -> range:
        return challenger_seeds(look, self.generation(base_commit))

    # --- looks ---------------------------------------------------------------------------------

    def protocol(self) -> Any:
        """The lab's gate protocol (`pipeline.gate.protocol.base.GateProtocol`)."""
        from pipeline.gate.protocol import get_protocol

        return get_protocol(self.lab.config.gate.protocol)

    def look_baseline_seeds(self, base_commit: str, look: int, *, gen: int | None = None) -> range:
        """The baseline seeds a look needs, as the protocol says (`GateProtocol.baseline_runs_at`: the
        paired protocol's lazy baseline grows with the deepest look asked of it; the two-sample ones
        run all `baseline_runs` up front)."""
        n = self.protocol().baseline_runs_at(look, self.lab.config.gate.baseline_runs)
        return self.baseline_seeds(base_commit, n, gen=gen)

    def run_priority(self, look: int, rank: int = 0) -> int:
        """The queue priority of a look's runs (both arms): the look's place in `[gate] looks` first
        (a deeper look is nearer a decision, and a decision frees its slots for a new hypothesis),
        then the caller's `rank` (0-99: the agent ranks human seeds first). Always above 0, the
        priority of runs nothing waits for (variance studies, a champion's runs until a look asks)."""
        looks = self.lab.config.gate.looks
        place = sum(1 for n in looks if n <= look)
        return 1 + place * LOOK_RANK + min(max(int(rank), 0), LOOK_RANK - 1)

    def queue_look(self, base_commit: str, commit: str, look: int, label: str | None = None, *,
                   rank: int = 0) -> list[int]:
        """Queue (idempotently) the baseline's runs and the challenger's runs for a look, at the
        look's priority (`run_priority`): a baseline run already queued for a shallower look is
        raised to it, so a look never waits behind the runs of looks further from a decision."""
        tasks = self.lab.tasks()
        g = self.generation(base_commit)
        base_sha, sha = resolve_commit(self.lab, base_commit), resolve_commit(self.lab, commit)
        self.store.mark_baseline(base_sha)
        priority = self.run_priority(look, rank)
        ids = ensure_runs(self.store, self.lab, base_commit, tasks, self.look_baseline_seeds(base_commit, look, gen=g),
                                 label="baseline", priority=priority)
        ids += ensure_runs(self.store, self.lab, commit, tasks, challenger_seeds(look, g), label=label,
                                  priority=priority)
        if sha != base_sha:
            self.store.mark_comparison(sha, base_sha)
        return ids

    def noise_study(self, base_commit: str, *, rank: int = 0) -> list[int]:
        """The baseline runs a lab's first comparison waits for before it is recorded (`[gate]
        noise_runs` per task, the baseline's own seeds, queued idempotently at the first look's
        priority): finished before the comparison begins, they are the measured noise its first looks
        stand on (`looks.with_baseline_arm`), where one pair's variance has 1 df and a large gain
        waited for look 5. Empty once the lab has any comparison (a resumed one never waits again),
        with `noise_runs = 0`, or for a protocol that reads no lab history (the two-sample ones run
        every baseline seed at their first look). Runs a variance study already made are reused."""
        if not self.wants_noise_study():
            return []
        n = self.lab.config.gate.noise_runs
        self.store.mark_baseline(resolve_commit(self.lab, base_commit))
        return ensure_runs(self.store, self.lab, base_commit, self.lab.tasks(), self.baseline_seeds(base_commit, n),
                           label="noise study", priority=self.run_priority(self.lab.config.gate.looks[0], rank))

    def wants_noise_study(self) -> bool:
        """Whether the lab's next comparison waits for a noise study (`noise_study`), without queueing
        one: a thread that waits on one the lab no longer asks for (`noise_runs = 0` since, or a
        comparison recorded by another driver) goes on."""
        return bool(self.lab.config.gate.noise_runs and self.protocol().reads_lab_history()
                    and not self.store.comparisons_timed(latest=1))

    # --- the replication step ------------------------------------------------------------------

    def wants_replication(self) -> bool:
        """Whether a promotion waits for its replication (`[gate] replicate_runs`, paired only)."""
        return bool(self.lab.config.gate.replicate_runs and self.protocol().reads_lab_history())

    def replication_seeds(self, base_commit: str, *, gen: int | None = None) -> range:
        """The fresh seeds a promotion of a challenger of `base_commit` is replicated on: the first of
        the block the challenger would own as champion (never a seed either arm was selected on; the
        challenger's runs there are the new champion's first baseline runs when it passes)."""
        g = self.generation(base_commit) if gen is None else gen
        return seed_block(g + 1)[: self.lab.config.gate.replicate_runs if self.wants_replication() else 0]

    def queue_replication(self, base_commit: str, commit: str, label: str | None = None, *,
                          rank: int = 0) -> list[int]:
        """Queue (idempotently) the replication's runs of both arms, at a priority above every look
        (a promotion waits on them, and the old baseline's serve every challenger of it that gets
        this far). Empty when the lab asks for no replication."""
        seeds = self.replication_seeds(base_commit)
        if not seeds:
            return []
        tasks = self.lab.tasks()
        priority = 1 + (len(self.lab.config.gate.looks) + 1) * LOOK_RANK + min(max(int(rank), 0), LOOK_RANK - 1)
        ids = ensure_runs(self.store, self.lab, base_commit, tasks, seeds, label="baseline", priority=priority)
        return ids + ensure_runs(self.store, self.lab, commit, tasks, seeds, label=label, priority=priority)

    def withdraw_replication(self, base_commit: str, commits: list[str]) -> tuple[int, int]:
        """Replication runs not started yet, removed from the queue: those of `commits` (a challenger
        whose promotion was given up before they ran; the baseline `base_commit` itself once it is no
        longer the head, when no challenger of it can be promoted any more). The seeds: the block
        after the base's, whatever `replicate_runs` says now (it may have been lowered since they were
        queued); there a commit that is not the champion of that block has replication runs only (the
        caller keeps a champion's: those seeds are its own baseline runs). Removed if they never ran,
        moved to the back of the queue if running now or given back by a crash (`Store.withdraw_queued`):
        returns (removed, moved back)."""
        seeds = seed_block(self.generation(base_commit) + 1)
        counts = [self.store.withdraw_queued(c, seeds) for c in dict.fromkeys(commits)]
        return sum(c[0] for c in counts), sum(c[1] for c in counts)

    def replication(self, base_commit: str, commit: str, *, record_as: str | None = None,
                    look: int = 0) -> Replication | None:
        """The replication's verdict (`pipeline.gate.replication`) once both arms' fresh runs are
        finished (None before, and None when the lab asks for none): the fresh seeds' per-seed
        horizontal paired values (trimmed mean over tasks of Δ / σ_task) tested against 0 at
        `replicate_alpha`, on the spread of this hypothesis's own per-seed values, those of its
        decisive `look` (the gate's) pooled with the fresh ones. σ_task is the baseline's spread on
        its own block, from runs finished before the replication was queued (no challenger's). With
        `record_as`, it is recorded as that key's gate record of kind `replicate` at `look` (replaced
        if judged again)."""
        import numpy as np

        from pipeline.gate.replication import own_spread_test, record, untested
        from pipeline.gate.stats import paired_horizontal

        g = self.generation(base_commit)
        seeds = list(self.replication_seeds(base_commit, gen=g))
        if not seeds:
            return None
        cfg = self.lab.config
        tasks = self.lab.tasks()
        base_sha, sha = resolve_commit(self.lab, base_commit), resolve_commit(self.lab, commit)
        wanted = {(c, t, s) for c in (base_sha, sha) for t in tasks for s in seeds}
        runs = [r for c in (base_sha, sha) for r in self.store.runs(commit=c) if (r.commit, r.task, r.seed) in wanted]
        if len(runs) < len(wanted) or not all(RunStatus(r.status).is_finished() for r in runs):
            return None
        queued = min(r.queued_at or 0.0 for r in runs)
        block = seed_block(g)
        base_rows, chal_rows = self.store.results_for(base_sha, tasks), self.store.results_for(sha, tasks)
        dataset = _one_dataset([r for r in base_rows + chal_rows if r.seed in seeds])  # one line if the data moved
        base, chal = by_task(base_rows, tasks), by_task(chal_rows, tasks)
        alpha, metric = cfg.gate.replicate_alpha, cfg.benchmark.metric

        def done(out: Replication) -> Replication:
            if record_as is not None:
                self.store.put_gate_record(record_as, look, out, kind="replicate")
            return out

        # a run finished without a result (an infrastructure failure past its retries) counts as failed,
        # as at a look: a challenger's fails the replication, never skips it
        failed = [f"{t} seed {s}" for t in tasks for s in seeds if chal.get(t, {}).get(s) is None]
        if failed:
            return done(untested(seeds, tasks, f"a challenger run failed on a fresh seed ({', '.join(failed[:3])})",
                                 alpha, metric))
        sigma = []
        for t in tasks:  # σ_task: the baseline's own block, before the replication (no challenger's run)
            v = [r.value for r in base_rows if r.task == t and r.seed in block and r.value is not None
                 and r.created_at < queued and (dataset is None or r.dataset_id in (None, dataset))]
            sigma.append(float(np.std(v, ddof=1)) if len(v) >= 2 else np.nan)
        scale = np.array(sigma)
        sign = 1.0 if cfg.benchmark.higher_is_better else -1.0

        def diffs(on: list[int]) -> np.ndarray:
            """Oriented Δ (tasks, seeds), NaN where either arm has no result."""
            out = np.full((len(tasks), len(on)), np.nan)
            for i, t in enumerate(tasks):
                for j, s in enumerate(on):
                    c, b = chal.get(t, {}).get(s), base.get(t, {}).get(s)
                    if c is not None and b is not None:
                        out[i, j] = sign * (c - b)
            return out

        fresh, at_look = diffs(seeds), diffs(list(challenger_seeds(look, g)))
        trim = cfg.gate.horizontal_trim
        fresh_h, look_h = paired_horizontal(fresh, scale, trim), paired_horizontal(at_look, scale, trim)
        if not np.isfinite(fresh_h).any():
            return done(untested(seeds, tasks, "no fresh pair to test (the baseline's fresh runs failed, or no task "
                                 "has a measured σ)", alpha, metric))
        test = own_spread_test(look_h, fresh_h, alpha)
        out = record(seeds, tasks, sign * fresh, scale, test, alpha, metric)
        if out["passed"] and cfg.gate.online_fdr == "lond":  # the stream's discovery: the gate's, replicated
            self.store.fdr_discovered(sha, base_sha)
        return done(out)

    def promoted_unreplicated(self, base_sha: str, sha: str) -> None:
        """A gate's improvement promoted with no replication asked for (now): a discovery of the
        stream (`online_fdr = "lond"`), also when the lab asked for a replication at its look
        (`replicate_runs` set to 0 since). Idempotent."""
        if self.lab.config.gate.online_fdr == "lond":
            self.store.fdr_discovered(sha, base_sha)

    def finished(self, ids: list[int]) -> bool:
        return all(RunStatus(r.status).is_finished() for r in self.store.runs(ids))

    def ran_alone(self, base_commit: str, commit: str) -> str | None:
        """Why a challenger's gain is held for a human because its stages ran alone on their GPU more
        often than its baseline's, or None. A stage that ran out of CUDA memory beside another is run
        again with the GPU alone (a neighbour must not fail a hypothesis); the out-of-memory is read
        from the stage's log, which branch code writes, and a lab whose training is bounded by time
        gets more compute alone. So a challenger with such runs, at more than twice its baseline's
        rate (and `ALONE_HOLD_MIN` of them at least: one genuine out-of-memory is no pattern), is never
        promoted without a human."""
        sha, base = resolve_commit(self.lab, commit), resolve_commit(self.lab, base_commit)
        k, n = self.store.alone_retries(sha)
        j, m = self.store.alone_retries(base)
        if k < ALONE_HOLD_MIN or not n or (m and j and k / n <= 2 * j / m):
            return None
        return (f"{k} of its {n} runs ran a stage again alone on its GPU after a CUDA out-of-memory beside "
                f"another stage (its baseline: {j} of {m}); alone, a stage that trains for a fixed time gets more compute")

    def mixed_environments(self, base_commit: str, commit: str, look: int) -> str | None:
        """Why a challenger's gain at `look` is held for a human because its pairs were measured in
        different environments one way (`environment.imbalance`: the baseline's runs under one torch
        or GPU, the challenger's under another), or None. The gain may be the environment's."""
        from pipeline.environment import change, held_for

        tasks = self.lab.tasks()
        seeds = set(challenger_seeds(look, self.generation(base_commit)))
        base_sha, sha = resolve_commit(self.lab, base_commit), resolve_commit(self.lab, commit)
        arms: dict[str, dict[Any, str | None]] = {base_sha: {}, sha: {}}
        for r in self.store.result_rows([base_sha, sha], tasks):
            if r.seed in seeds and r.value is not None:
                arms[r.commit][(r.task, r.seed)] = r.env_id
        moved = held_for(arms[base_sha], arms[sha])
        if moved is None:
            return None
        _, old, new, n, pairs = moved
        envs = self.store.envs([old, new])
        what = change(envs[old], envs[new]) if old in envs and new in envs else f"{old} → {new}"
        return (f"{n} more of its {pairs} pairs had the baseline's run in one measurement environment and its own "
                f"in another than the other way round ({what}): the gain may be the environment's")

    def baseline_environment(self) -> tuple[str, str | None]:
        """(the baseline's head, the environment id most of its runs on its own seed block were
        measured in: the baseline arm of its challengers' pairs, not a champion's runs as a
        challenger; None before any)."""
        from collections import Counter

        head = resolve_commit(self.lab, BASELINE_BRANCH)
        block = seed_block(self.generation(head))
        ids = Counter(r.env_id for r in self.store.result_rows([head], self.lab.tasks())
                      if r.value is not None and r.env_id and r.seed in block)
        return head, (ids.most_common(1)[0][0] if ids else None)

    def environment_change(self, current: Any) -> tuple[str, str] | None:
        """(the baseline's head, what changed) when the environment the baseline was measured in
        (`baseline_environment`) is not `current` (an `Environment`: the driver's stages'), else None."""
        from pipeline.environment import change

        head, usual = self.baseline_environment()
        if usual is None:
            return None
        old = self.store.envs([usual]).get(usual)
        if old is None or usual == current.id:
            return None
        return head, change(old, current) or "the environment changed"

    def judge_look(self, base_commit: str, commit: str, look: int, *, record_as: str | None = None) -> GateResult:
        """The gate's result at a look, from the store's results (never from the policy). With
        `record_as`, it is recorded as that key's gate record at this look (the agent's hypothesis
        id; replaced if judged again): what the decision, the summary and `report` read."""
        from pipeline.gate import evaluate

        cfg = self.lab.config
        tasks = self.lab.tasks()
        g = self.generation(base_commit)
        base_sha, sha = resolve_commit(self.lab, base_commit), resolve_commit(self.lab, commit)
        seeds, own = challenger_seeds(look, g), self.look_baseline_seeds(base_commit, look, gen=g)
        block = seed_block(g)
        base_rows = self.store.results_for(base_sha, tasks)
        chal_rows = self.store.results_for(sha, tasks)
        dataset = _one_dataset([r for r in base_rows if r.seed in own] + [r for r in chal_rows if r.seed in seeds])
        base, chal = by_task(base_rows, tasks), by_task(chal_rows, tasks)
        # the variance prior (and a task's σ): the baseline's runs on its own block that this look
        # waits for, and those finished before the comparison was first recorded (earlier
        # challengers' deeper looks, variance studies), never one that merely finished by now: a
        # look's verdict is a function of the look, not of what else ran meanwhile (and not the
        # runs a promoted champion was selected on: the block before)
        timed = self.store.comparisons_timed()
        cutoff = next((t for c, b, t in timed if (c, b) == (sha, base_sha)), None)
        prior = {(r.task, r.seed) for r in base_rows
                 if r.seed in block and cutoff is not None and r.created_at < cutoff and r.seed not in own
                 and (dataset is None or r.dataset_id in (None, dataset))}
        if self.protocol().reads_lab_history():
            # a seed joins the history on every task or on none: the paired bound's horizontal value
            # lines the tasks up by seed, and one failed run (a noise study's) would otherwise leave the
            # counts unequal, and the whole history out (`looks.with_baseline_arm`); a task added to
            # the lab since has none, and stays out
            measured = {t for t, _ in prior}
            full = {sd for sd in {sd for _, sd in prior}
                    if all((t, sd) in prior and base.get(t, {}).get(sd) is not None for t in measured)}
            prior = {(t, sd) for t, sd in prior if sd in full}
        gate = cfg.gate.model_dump()
        if cfg.gate.online_fdr == "lond":  # this comparison's level in the lab's stream, given once
            gate["alpha"] = self.stream_test(sha, base_sha).alpha
        inp = {
            "config": gate,
            "tasks": [
                {
                    "task": t,
                    "baseline": [base.get(t, {}).get(s) for s in own],
                    # an infrastructure failure that exhausted its retries has no result: counted as failed
                    "challenger": [chal.get(t, {}).get(s) for s in seeds],
                    "history": [v for s, v in sorted(base.get(t, {}).items()) if s in own or (t, s) in prior],
                }
                for t in tasks
            ],
            **(dict(zip(("pair_history", "arm_history"), self.histories(tasks, exclude=(sha, base_sha), dataset=dataset,
                                                                          timed=timed)))
               if self.protocol().reads_lab_history() else {}),
            "looks_done": [n for n in cfg.gate.looks if n < look],
            "at_look": True,
        }
        result = evaluate(inp)
        if (cfg.gate.online_fdr == "lond" and result.verdict is not None and result.verdict.value == "improvement"
                and not self.wants_replication()):  # with a replication step, a discovery is a replicated one
            self.store.fdr_discovered(sha, base_sha)
        if record_as is not None:
            self.store.put_gate_record(record_as, look, result)
        return result

    def stream_test(self, sha: str, base_sha: str) -> FdrTest:
        """The comparison's test of the lab's stream (`[gate] online_fdr = "lond"`): its index and α_i."""
        from pipeline.gate.online_fdr import lond_alpha

        gate = self.lab.config.gate
        return self.store.fdr_test(sha, base_sha, lambda i, d: lond_alpha(i, d, gate.fdr, gate.alpha))

    def stream(self) -> dict[str, Any] | None:
        """`status`'s view of the stream's error control: None with `online_fdr = "off"`."""
        from pipeline.gate.online_fdr import lond_alpha

        gate = self.lab.config.gate
        if gate.online_fdr == "off":
            return None
        tests, found = self.store.fdr_stream()
        return {"procedure": gate.online_fdr, "fdr": gate.fdr, "tests": tests, "discoveries": found,
                "next_alpha": lond_alpha(tests + 1, found, gate.fdr, gate.alpha)}

    def pairs(self, challenger: str, baseline: str, tasks: list[str],
              rows: dict[str, list[Any]] | None = None,
              tables: dict[str, dict[str, dict[int, float | None]]] | None = None) -> dict[str, list[float | None]]:
        """{task: [challenger_k - baseline_k]} over the seeds both arms measured (None: a failed run);
        from the arms' result `rows`, or their `by_task` `tables` made once for many comparisons."""
        if tables is not None:
            chal, base = tables[challenger], tables[baseline]
        else:
            if rows is None:
                rows = {c: self.store.results_for(c, tasks) for c in (challenger, baseline)}
            chal, base = by_task(rows[challenger], tasks), by_task(rows[baseline], tasks)
        out: dict[str, list[float | None]] = {}
        for t in tasks:
            common = sorted(set(chal.get(t, {})) & set(base.get(t, {})))
            out[t] = [None if (c := chal[t][k]) is None or (b := base[t][k]) is None else c - b for k in common]
        return out

    def pair_history(self, tasks: list[str], exclude: tuple[str, str] | None = None) -> list[dict[str, list[float | None]]]:
        """The lab's earlier comparisons as paired differences (the `paired` protocol's futility prior)."""
        return self.histories(tasks, exclude)[0]

    def histories(self, tasks: list[str], exclude: tuple[str, str] | None = None, dataset: str | None = None,
                  timed: list[tuple[str, str, float]] | None = None
                  ) -> tuple[list[dict[str, list[float | None]]], list[dict[str, list[float | None]]]]:
        """The lab's earlier comparisons, from one read of the store: their paired differences (the
        `paired` protocol's futility prior) and the runs of every arm in them by seed, each commit
        once and neither commit of `exclude` (the unpaired bound on the paired variance, and σ_task);
        the latest HISTORY_COMPARISONS of them (thousands of seeds per task already: more would only
        make a hypothesis's first look read a year of results).

        Frozen for `exclude`'s comparison: only comparisons recorded before it and result rows
        created before it, so the prior and σ_task do not move between its looks (the boundaries are
        calibrated for one draw of them) while other hypotheses add runs. Rows measured on another
        dataset than `dataset` (default: the newest) are left out. Being frozen, the answer for a
        recorded `exclude` is computed once per process and kept (`_frozen`, bounded): each later
        look of the hypothesis reads only the comparisons' times."""
        timed = self.store.comparisons_timed() if timed is None else timed  # the caller's read, if it made one
        cutoff = next((t for c, b, t in timed if (c, b) == exclude), None)
        key = (tuple(tasks), exclude, dataset)
        if cutoff is not None and key in self._frozen:
            return self._frozen[key]
        out = self._histories(tasks, timed, exclude, cutoff, dataset)
        if cutoff is not None:
            if len(self._frozen) >= FROZEN_HISTORIES:
                self._frozen.pop(next(iter(self._frozen)))  # the oldest
            self._frozen[key] = out
        return out

    def _histories(self, tasks: list[str], timed: list[tuple[str, str, float]], exclude: tuple[str, str] | None,
                   cutoff: float | None, dataset: str | None
                   ) -> tuple[list[dict[str, list[float | None]]], list[dict[str, list[float | None]]]]:
        comps = [(c, b) for c, b, t in timed if (c, b) != exclude and (cutoff is None or t < cutoff)]
        comps = comps[-HISTORY_COMPARISONS:]  # the latest: a year's are 16,000 (and the lab's noise drifts)
        if not comps:
            return [], []
        commits = {x for c in comps for x in c}
        rows: dict[str, list[Any]] = {c: [] for c in commits}
        for r in self.store.result_rows(commits, tasks):
            if cutoff is None or r.created_at < cutoff:
                rows[r.commit].append(r)
        if dataset is None:
            latest = max((r for rs in rows.values() for r in rs if r.dataset_id), key=lambda r: r.created_at,
                         default=None)
            dataset = latest.dataset_id if latest is not None else None
        if dataset is not None:
            rows = {c: [r for r in rs if r.dataset_id in (None, dataset)] for c, rs in rows.items()}
        tables = {c: by_task(rs, tasks) for c, rs in rows.items()}  # once per commit: a baseline is in thousands
        out = []
        for chal, base in comps:
            d = self.pairs(chal, base, tasks, tables=tables)
            if any(len(v) >= 2 for v in d.values()):
                out.append(d)
        skip = set(exclude or ())
        arms = []
        for commit in sorted(commits - skip):
            by = tables[commit]
            seeds = sorted({s for t in tasks for s in by.get(t, {})})
            if len(seeds) >= 2:
                arms.append({t: [by.get(t, {}).get(k) for k in seeds] for t in tasks})
        return out, arms

    # --- champions -----------------------------------------------------------------------------

    def queue_champion(self, commit: str, label: str, *, replicated: int | None = None) -> list[int]:
        """A new champion's own runs, on its generation's block: it re-verifies on seeds it was not
        selected on (a fast-forward keeps the commit, so its challenger runs stay in the store, on
        the block before)."""
        self.store.mark_baseline(resolve_commit(self.lab, commit))
        g = self.generation(commit)
        seeds = range(seed_block(g).start, self.fresh_seeds(g, replicated).stop)  # its replication's, its fresh
        return ensure_runs(self.store, self.lab, commit, self.lab.tasks(), seeds, label=label)

    def fresh_seeds(self, gen: int, replicated: int | None = None) -> range:
        """The seeds a champion of generation `gen` re-verifies on: its first look's lazy baseline
        seeds, after the `replicated` ones its promotion was replicated on (it was selected on those
        too; None: as many as the lab asks for now)."""
        if replicated is None:
            replicated = self.lab.config.gate.replicate_runs if self.wants_replication() else 0
        c = replicated
        n = self.protocol().baseline_runs_at(self.lab.config.gate.looks[0], self.lab.config.gate.baseline_runs)
        return seed_block(gen)[c: c + n]

    def reverification(self, champion: str, commit: str, base_commit: str, look: int, *,
                       replicated: int | None = None) -> Reverification | None:
        """How a champion (`champion`, e.g. its tag) did on its fresh baseline seeds, against the
        runs its challenger `commit` was selected on at `look` (the winner's curse, measured).
        None until every fresh run has finished."""
        lab, cfg = self.lab, self.lab.config
        tasks = lab.tasks()
        fresh = results(self.store, lab, resolve_commit(lab, champion), tasks)
        chosen = results(self.store, lab, commit, tasks)
        g = self.generation(base_commit)  # the champion's generation is one more than its baseline's
        seeds = list(self.fresh_seeds(g + 1, replicated))
        # selected on: the look's runs, and the replication's (the first seeds of the champion's block)
        picked = [*challenger_seeds(look, g), *seed_block(g + 1)[: seeds[0] - seed_block(g + 1)[0]]]
        if any(s not in fresh.get(t, {}) for t in tasks for s in seeds):
            return None
        rows: list[TaskReverification] = []
        sign = 1.0 if cfg.benchmark.higher_is_better else -1.0
        for t in tasks:
            f = [v for s in seeds if (v := fresh[t].get(s)) is not None]
            c = [v for s in picked if (v := chosen.get(t, {}).get(s)) is not None]
            if f and c:
                rows.append({"task": t, "fresh": sum(f) / len(f), "selected": sum(c) / len(c), "fresh_runs": len(f)})
        if not rows:
            return None
        fresh_mean = sum(r["fresh"] for r in rows) / len(rows)
        sel_mean = sum(r["selected"] for r in rows) / len(rows)
        return {"tag": champion, "tasks": rows, "fresh_mean": fresh_mean, "selected_mean": sel_mean,
                "shrinkage": fresh_mean - sel_mean,
                "tasks_worse": sum(sign * (r["fresh"] - r["selected"]) < 0 for r in rows), "fresh_seeds": seeds}

    def standing(self, commit: str) -> dict[str, Any] | None:
        """A baseline commit measured on its own runs (its own block, never the runs it was selected
        on): the mean over tasks on the gate split and, on the same runs, on the sealed holdout
        (None without one). For status, the digest and the chart only: nothing that decides reads it."""
        sha = resolve_commit(self.lab, commit)
        tasks = self.lab.tasks()
        return self._standing(sha, tasks, results(self.store, None, sha, tasks), self.store.holdout_scores(sha))

    def standings(self, revs: list[str]) -> dict[str, dict[str, Any] | None | Exception]:
        """`standing` of many baselines (commits or tags) at once: their results and holdout scores
        in one read each and their generations in one walk of the history (`status` asks it of every
        champion: a year's are hundreds). A revision that cannot be resolved (a tag deleted by hand)
        maps to the error."""
        out: dict[str, dict[str, Any] | None | Exception] = {}
        shas: dict[str, str] = {}
        for rev, sha in resolve_commits(self.lab, list(dict.fromkeys(revs))).items():  # one git call
            if isinstance(sha, Exception):
                out[rev] = sha
            else:
                shas[rev] = sha
        generations(str(self.lab.root), list(shas.values()))
        tasks = self.lab.tasks()
        rows: dict[str, list[Any]] = {}
        for r in self.store.result_rows(shas.values(), tasks):
            rows.setdefault(r.commit, []).append(r)
        hold = self.store.holdout_scores_of(shas.values())
        for rev, sha in shas.items():
            out[rev] = self._standing(sha, tasks, by_task(rows.get(sha, []), tasks), hold.get(sha, {}))
        return out

    def _standing(self, sha: str, tasks: list[str], gate: dict[str, dict[int, float | None]],
                  hold: dict[str, dict[int, float]]) -> dict[str, Any] | None:
        block = seed_block(self.generation(sha))
        g_means, h_means, runs = [], [], 0
        for t in tasks:
            seeds = [s for s, v in gate.get(t, {}).items() if s in block and v is not None]
            paired = [s for s in seeds if s in hold.get(t, {})]
            use = paired or seeds
            if not use:  # a level over some of the tasks is not comparable with one over all of them
                return None
            runs += len(use)
            g_means.append(sum(gate[t][s] for s in use) / len(use))
            if paired:
                h_means.append(sum(hold[t][s] for s in paired) / len(paired))
        return {"commit": sha, "gate": sum(g_means) / len(g_means),
                "holdout": sum(h_means) / len(h_means) if len(h_means) == len(g_means) else None,
                "tasks": len(g_means), "runs": runs}

    def release(self, commit: str) -> None:
        """A decided challenger's worktree is not needed any more (its tag keeps the commit)."""
        from pipeline.worktrees import Worktrees

        Worktrees(self.lab.root, self.lab.state).remove(commit)

    # --- smoke runs ----------------------------------------------------------------------------

    def smoke(self, base: str, files: dict[str, str], stop: threading.Event | None = None,
              hypothesis: str | None = None) -> float:
        """The candidate (`base` with `files` applied) through every stage on tiny data, in a warm
        worker of its own; the metric, or `MethodFailure` with what went wrong. What it spent and how
        it ended are booked in the store (`SmokeExec`, under `hypothesis` if given): the smoke runs'
        CPU and GPU time in `goodput`, beside the measuring runs'."""
        from pipeline.errors import Interrupted, MethodFailure
        from pipeline.smoke import SmokeCost, SmokeRunner, smoke_run

        self._smoke_runner = self._smoke_runner or SmokeRunner(self.lab, lender=self._lender)
        cost, started, t0 = SmokeCost(), time.time(), time.monotonic()

        def book(outcome: str) -> None:
            try:
                self.store.smoke_finished(base, outcome, hypothesis=hypothesis, executor=cost.where,
                                          stages=cost.stages, cpu_s=cost.cpu_s, gpu_s=cost.gpu_s,
                                          wall_s=time.monotonic() - t0, started_at=started,
                                          gpu_from=cost.gpu_from, gpu_to=cost.gpu_to)
            except Exception as e:  # the books must neither fail a smoke run nor hide why it ended
                log.warning("smoke run of %s not booked: %s: %s", base[:12], type(e).__name__, e)

        try:
            value = smoke_run(self.lab, base, files, stop=stop, runner=self._smoke_runner, cost=cost)
        except BaseException as e:
            book("method" if isinstance(e, MethodFailure) else
                 "interrupted" if isinstance(e, (Interrupted, KeyboardInterrupt)) else "infra")
            raise
        book("ok")
        return value

    def close(self) -> None:
        if self._smoke_runner is not None:
            self._smoke_runner.close()
            self._smoke_runner = None
