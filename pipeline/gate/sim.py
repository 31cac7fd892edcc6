"""Vectorised simulation of a protocol's error rates, power and cost (`autoresearch gate-sim`).

Each trial is one hypothesis on J tasks: the baseline's runs (n seeds) and the challenger's (up
to the last planned look), every seed a vector over tasks with cross-task correlation ρ (tasks
share pretraining), per-run σ = 1 on every task and a true improvement `effect` (in σ units) on
the first `affected` tasks. The trial goes through the planned looks with exactly the statistics
and verdict table `evaluate` uses, stopping at the first verdict other than `escalate`.

Rates reported (each over trials; a task rate over trial × task pairs):
- improvement_rate: the verdict is `improvement` (the false-positive rate when effect = 0);
- horizontal_rate: the horizontal test crossed its improvement boundary at a look reached;
- per_task_rate: an affected task's test crossed its improvement boundary at a look reached
  (unaffected tasks: per_task_null_rate); `*_all_looks`: the same if every look were taken
  whatever the verdicts said (the stricter check, since futility stops only remove chances);
- mean_challenger_runs: challenger runs per task when the trial stopped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from pipeline.errors import UserError
from pipeline.gate.protocol import PROTOCOLS, get_protocol
from pipeline.gate.protocols import (
    SEED_SPREAD_P,
    futility_p_value,
    horizontal_look,
    most_improved,
    paired_tests,
    task_look,
    task_scale,
    two_sample_horizontal,
)
from pipeline.gate.stats import (
    HORIZONTAL_TRIM,
    PRIOR_DF_CAP,
    arms_without_task,
    bound_weight,
    history_prior,
    horizontal_values,
    noisier_p,
    pooled_t,
    spread_ratio_p,
    summarize,
    without_task,
)
from pipeline.gate.verdict import CODE, ORDER, Verdict, decide


class SimResult(BaseModel):
    """Outcome of a gate simulation; `to_json` gives the CLI's stable JSON."""

    model_config = ConfigDict(frozen=True)

    protocol: str
    effect: float
    tasks: int
    affected: int
    rho: float
    trials: int
    baseline_runs: int
    looks: list[int]
    alpha: float
    futility_p: float
    harm_q: float
    history: int
    horizontal_trim: float
    seed: int
    improvement_rate: float  # every `improvement` verdict, held ones included
    held_rate: float  # `improvement` held for review: its seeds do not vary, or it is noisier than the lab
    pair_rho: float
    history_pair_rho: float | None
    pair_history: int
    lazy: bool
    challenger_sd: float
    horizontal_rate: float
    horizontal_rate_all_looks: float
    per_task_rate: float | None
    per_task_rate_all_looks: float | None
    per_task_null_rate: float | None
    per_task_null_rate_all_looks: float | None
    mean_challenger_runs: float
    verdict_rates: dict[str, float]

    def standard_error(self, rate: float) -> float:
        """Binomial standard error of a rate over the trials."""
        return math.sqrt(max(rate * (1 - rate), 1e-12) / self.trials)

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = self.model_dump()
        key = "power" if self.effect != 0 else "false_positive_rate"
        out[key] = self.improvement_rate
        out[key + "_se"] = self.standard_error(self.improvement_rate)
        return out


def _check(protocol: str, effect: float, tasks: int, rho: float, trials: int, baseline_runs: int,
           looks: tuple[int, ...], alpha: float, futility_p: float, history: int, affected: int,
           horizontal_trim: float) -> None:
    problems = [
        (protocol not in PROTOCOLS, f"--protocol: expected one of {', '.join(sorted(PROTOCOLS))}"),
        (not math.isfinite(effect), "--effect: expected a finite number (σ units)"),
        (tasks < 1, "--tasks: expected at least 1"),
        (not (0 <= rho < 1), "--rho: expected a correlation in [0, 1)"),
        (trials < 1, "--trials: expected at least 1"),
        (baseline_runs < 2, "--baseline-runs: expected at least 2"),
        (not looks or looks[0] < 1 or any(b <= a for a, b in zip(looks, looks[1:])),
         "--looks: expected strictly increasing positive run counts"),
        (not (0 < alpha < 0.5), "--alpha: expected a one-sided level in (0, 0.5)"),
        (not (0 < futility_p <= 1), "--futility-p: expected a number in (0, 1]"),
        (history < 0, "--history: expected 0 or more extra baseline runs"),
        (not (0 <= affected <= tasks), "--affected: expected between 0 and --tasks"),
        (not (0 <= horizontal_trim < 0.5), "--trim: expected a share in [0, 0.5)"),
    ]
    for bad, message in problems:
        if bad:
            raise UserError(message)


def simulate(
    protocol: str = "sequential",
    effect: float = 0.0,
    tasks: int = 8,
    rho: float = 0.0,
    trials: int = 20_000,
    baseline_runs: int = 10,
    looks: tuple[int, ...] = (2, 5, 10),
    alpha: float = 0.025,
    futility_p: float = 0.30,
    harm_q: float = 0.10,
    history: int = 0,
    affected: int | None = None,
    horizontal_trim: float = HORIZONTAL_TRIM,
    seed: int = 0,
    chunk: int = 20_000,
    pair_rho: float = 0.0,
    history_pair_rho: float | None = None,
    pair_history: int = 10,
    lazy: bool = True,
    challenger_sd: float = 1.0,
) -> SimResult:
    """Simulate `trials` hypotheses through the protocol; see the module docstring for the rates.

    `pair_rho`: the correlation of the challenger's seed-k run with the baseline's seed-k run (common
    random numbers; the two-sample protocols ignore it). `paired` only: `pair_history` earlier
    comparisons of 2 pairs each, paired at `history_pair_rho` (default: `pair_rho`), are the
    lab's history behind its prior; `lazy`: the gate sees the baseline seeds a look needs (the
    first challenger of a baseline), else all `baseline_runs`. `challenger_sd`: the challenger's
    per-run σ over the baseline's (and the lab's earlier arms'): a branch that is noisier than the lab.
    """
    looks = tuple(int(x) for x in looks)
    affected = tasks if affected is None else affected
    hist_rho = pair_rho if history_pair_rho is None else history_pair_rho
    _check(protocol, effect, tasks, rho, trials, baseline_runs, looks, alpha, futility_p, history, affected,
           horizontal_trim)
    for bad, message in ((not 0 <= pair_rho < 1, "--pair-rho: expected a correlation in [0, 1)"),
                         (not (math.isfinite(challenger_sd) and challenger_sd > 0), "--challenger-sd: expected a positive σ ratio"),
                         (not 0 <= hist_rho < 1, "--history-pair-rho: expected a correlation in [0, 1)"),
                         (pair_history < 0, "--pair-history: expected 0 or more earlier comparisons"),
                         (get_protocol(protocol).paired and looks[-1] > baseline_runs,
                          "--looks: the paired protocol's last look needs as many --baseline-runs")):
        if bad:
            raise UserError(message)
    n, J, last = baseline_runs, tasks, looks[-1]
    shift = np.where(np.arange(J) < affected, effect, 0.0)
    rng = np.random.default_rng(seed)
    paired = get_protocol(protocol).paired

    def draw(b: int, *seeds: int) -> np.ndarray:
        common = rng.standard_normal((b, 1, *seeds))
        own = rng.standard_normal((b, J, *seeds))
        return math.sqrt(rho) * common + math.sqrt(1 - rho) * own

    def challenger(base: np.ndarray, b: int) -> np.ndarray:
        fresh = draw(b, last)
        if pair_rho == 0 or base.shape[-1] < last:
            return challenger_sd * fresh
        return challenger_sd * (pair_rho * base[..., :last] + math.sqrt(1 - pair_rho**2) * fresh)

    sums = {"improvement": 0, "held": 0, "h": 0, "h_all": 0, "runs": 0}
    task_hits = np.zeros(J)
    task_hits_all = np.zeros(J)
    verdicts = np.zeros(len(ORDER))
    done = 0
    while done < trials:
        b = min(chunk, trials - done)
        base = draw(b, n)
        chal = challenger(base, b) + shift[None, :, None]
        hist = draw(b, history) if history else None
        # earlier comparisons' paired differences: var 2(1 - ρ_pair) per task, 2 pairs each
        pairs = math.sqrt(2 * (1 - hist_rho)) * draw(b, pair_history, 2) if paired and pair_history else None
        # ... and their arms (2 seeds each, both arms of each comparison): the unpaired bound's history
        arms = np.moveaxis(draw(b, 2 * pair_history, 2), 1, 2) if paired and pair_history else None
        path = look_path(protocol, base, chal, looks, alpha=alpha, futility_p=futility_p, harm_q=harm_q,
                         horizontal_trim=horizontal_trim, history=hist, pair_history=pairs,
                         base_depth=np.zeros(b, int) if lazy else None, arm_history=arms)
        code, k_stop = path.first_stop()
        reached = np.arange(len(looks))[None, :] <= k_stop[:, None]  # (b, K): looks this trial took
        verdicts += np.bincount(code, minlength=len(ORDER))
        sums["improvement"] += int((code == CODE[Verdict.improvement]).sum())
        sums["held"] += int(((code == CODE[Verdict.improvement]) & path.held[np.arange(b), k_stop]).sum())
        sums["h"] += int((path.horizontal_up & reached).any(axis=1).sum())
        sums["h_all"] += int(path.horizontal_up.any(axis=1).sum())
        sums["runs"] += int(np.asarray(looks)[k_stop].sum())
        task_hits += (path.task_up & reached[..., None]).any(axis=1).sum(axis=0)
        task_hits_all += path.task_up.any(axis=1).sum(axis=0)
        done += b

    def task_rate(hits: np.ndarray, cols: slice) -> float | None:
        chosen = hits[cols]
        return float(chosen.sum() / (chosen.size * trials)) if chosen.size else None

    hit_cols, null_cols = (slice(0, affected), slice(affected, J)) if effect != 0 else (slice(0, J), slice(J, J))
    return SimResult(
        protocol=protocol, effect=effect, tasks=J, affected=affected, rho=rho, trials=trials,
        baseline_runs=n, looks=list(looks), alpha=alpha, futility_p=futility_p, harm_q=harm_q,
        history=history, horizontal_trim=horizontal_trim, seed=seed,
        improvement_rate=sums["improvement"] / trials,
        held_rate=sums["held"] / trials,
        pair_rho=pair_rho, history_pair_rho=hist_rho if paired else None,
        pair_history=pair_history if paired else 0, lazy=lazy if paired else False, challenger_sd=challenger_sd,
        horizontal_rate=sums["h"] / trials,
        horizontal_rate_all_looks=sums["h_all"] / trials,
        per_task_rate=task_rate(task_hits, hit_cols),
        per_task_rate_all_looks=task_rate(task_hits_all, hit_cols),
        per_task_null_rate=task_rate(task_hits, null_cols),
        per_task_null_rate_all_looks=task_rate(task_hits_all, null_cols),
        mean_challenger_runs=sums["runs"] / trials,
        verdict_rates={v.value: float(verdicts[i] / trials) for i, v in enumerate(ORDER)},
    )


@dataclass(frozen=True)
class LookPath:
    """A batch of hypotheses judged at every planned look, as if each look were taken.

    Arrays are (b, K) or (b, K, tasks), oriented so that + is better: the verdict code at each
    look, whether the horizontal test and each task's test crossed their improvement boundaries,
    and the horizontal Δ (σ units) and per-task Δ (metric units) at each look.
    """

    looks: tuple[int, ...]
    codes: np.ndarray
    horizontal_up: np.ndarray
    task_up: np.ndarray
    horizontal_delta: np.ndarray
    task_delta: np.ndarray
    held: np.ndarray  # (b, K): seeds do not vary (an `improvement` there is held, not promoted)

    def first_stop(self) -> tuple[np.ndarray, np.ndarray]:
        """The verdict where each hypothesis stops (its first verdict other than `escalate`, or the
        last look's) and the index of that look: what the loop's escalate-or-decide rule does."""
        going = self.codes == CODE[Verdict.escalate]
        going[:, -1] = False
        k_stop = np.argmin(going, axis=1)  # the first look that does not escalate
        return self.codes[np.arange(len(k_stop)), k_stop], k_stop


def look_path(
    protocol: str,
    base: np.ndarray,
    chal: np.ndarray,
    looks: tuple[int, ...],
    *,
    alpha: float = 0.025,
    futility_p: float = 0.30,
    harm_q: float = 0.10,
    horizontal_trim: float = HORIZONTAL_TRIM,
    history: np.ndarray | None = None,
    scale: np.ndarray | None = None,
    pair_history: np.ndarray | None = None,
    base_depth: np.ndarray | None = None,
    arm_history: np.ndarray | None = None,
) -> LookPath:
    """Judge a batch of hypotheses at every look with the statistics and verdict table `evaluate`
    uses: `base` (b, tasks, n) baseline runs, `chal` (b, tasks, ≥ looks[-1]) challenger runs by seed,
    `history` (b, tasks, h) extra baseline-commit runs (the variance prior), all oriented so that +
    is better. `scale` (b, tasks) overrides σ_task (default: from the baseline's runs and history).
    Runs have no failures here (NaN is a failed run, as in `evaluate`, but failures are not counted).

    `paired` only: `pair_history` (b, tasks, comparisons, seeds) is the lab's earlier paired
    differences (the prior), and `base_depth` (b,) the baseline seeds already run before this
    hypothesis (the lazy baseline: at a look of m runs the gate sees max(depth, m, 2) of them; None:
    all n). A result held because its seeds do not vary is `held` (never promoted automatically).
    """
    looks = tuple(int(x) for x in looks)
    b, J, n = base.shape
    proto = get_protocol(protocol)
    if proto.paired:
        return _paired_path(protocol, base, chal, looks, alpha, futility_p, harm_q, horizontal_trim, history,
                            pair_history, base_depth, arm_history)
    hist_arm = summarize(history) if history is not None and history.shape[-1] else None
    prior_df = int(hist_arm.count.max()) - 1 if hist_arm is not None else 0
    prior_df = max(prior_df, 0)
    weight = float(min(prior_df, PRIOR_DF_CAP))
    tb = proto.boundaries(n, looks, looks[-1], alpha, prior_df, weight if proto.moderated else 0.0)
    hbnd = proto.boundaries(n, looks, looks[-1], alpha)
    base_arm = summarize(base)
    prior = history_prior(history, base_arm.mean.shape) if proto.moderated and hist_arm is not None else None
    if scale is None:
        scale, _ = task_scale(base_arm, hist_arm)
    hb, hc = horizontal_values(base, chal, base_arm.mean, scale, horizontal_trim)
    K = len(looks)
    out = _Path(b, K, J)
    for k, mk in enumerate(looks):
        test = pooled_t(base_arm, summarize(chal[..., :mk]), prior)
        tl = task_look(test, np.float64(tb.nominal[k]), protocol, alpha, harm_q)
        breadth, required = None, True
        if J > 1:
            top, required = most_improved(test.delta, scale)
            bb, bc = horizontal_values(without_task(base, top), without_task(chal[..., :mk], top), base_arm.mean,
                                       scale, horizontal_trim)
            breadth = two_sample_horizontal(bb, bc)
        hl = horizontal_look(two_sample_horizontal(hb, hc[:, :mk]), hbnd.upper[k], breadth, required)
        out.record(k, tl, hl, hl.p_up, test, tb.upper[k], k == K - 1, futility_p, spread_ratio_p(hb, hc[:, :mk])[1])
    return out.finish(looks)


def _paired_path(protocol: str, base: np.ndarray, chal: np.ndarray, looks: tuple[int, ...], alpha: float,
                 futility_p: float, harm_q: float, trim: float, history: np.ndarray | None,
                 pair_history: np.ndarray | None, base_depth: np.ndarray | None,
                 arm_history: np.ndarray | None = None) -> LookPath:
    b, J, n = base.shape
    proto = get_protocol(protocol)
    if pair_history is None or not (pair_history.shape[-1] and pair_history.shape[-2]):
        pair_history = None
    hist_arm = summarize(history) if history is not None and history.shape[-1] else None
    K = len(looks)
    out = _Path(b, K, J)
    seeds = np.arange(n)
    for k, mk in enumerate(looks):
        depth = np.full(b, n) if base_depth is None else np.maximum(np.asarray(base_depth), max(mk, 2))
        visible = np.where((seeds[None, :] < np.minimum(depth, n)[:, None])[:, None, :], base, np.nan)
        base_arm = summarize(visible)
        scale, _ = task_scale(base_arm, hist_arm, arm_history)
        c = chal[..., :mk]
        hb, hc = horizontal_values(visible, c, base_arm.mean, scale, trim)
        pt = paired_tests(visible, c, scale, hb, trim, pair_history, arm_history)
        # boundaries: one calibration per bound df (trials, and tasks, differ in their history)
        t_upper, t_nominal = np.full((b, J), np.inf), np.full((b, J), np.nan)
        for w in np.unique(pt.prior.df):
            bnd = _paired_boundaries(proto, n, looks[: k + 1], looks[-1], alpha, int(w))
            if bnd is not None:
                t_upper = np.where(pt.prior.df == w, bnd.upper[-1], t_upper)
                t_nominal = np.where(pt.prior.df == w, bnd.nominal[-1], t_nominal)
        tl = task_look(pt.test, t_nominal, protocol, alpha, harm_q)
        breadth, required = None, True
        if J > 1:
            top, required = most_improved(pt.test.delta, scale)
            breadth = paired_tests(without_task(visible, top), without_task(c, top), scale, hb, trim, None,
                                   arms_without_task(arm_history, top)).h
        # the horizontal boundaries: one calibration per bound df (trials differ in their history)
        h_upper = np.full(b, np.inf)
        for w in np.unique(pt.bound.df):
            bnd = _paired_boundaries(proto, n, looks[: k + 1], looks[-1], alpha, int(w))
            if bnd is not None:
                h_upper = np.where(pt.bound.df == w, bnd.upper[-1], h_upper)
        hl = horizontal_look(pt.h, h_upper, breadth, required, pt.h_futility)
        low = spread_ratio_p(hb, hc)[1]
        high = noisier_p(pt.hc, pt.lab.var, pt.lab.df)[1]
        with np.errstate(invalid="ignore"):
            held_p = np.fmin(low, high)  # held when either tail is below SEED_SPREAD_P (NaN: untested)
        out.record(k, tl, hl, futility_p_value(hl.p_up, pt.hd), pt.test, t_upper, k == K - 1, futility_p, held_p)
    return out.finish(looks)


def _paired_boundaries(proto: Any, n: int, looks: tuple[int, ...], planned_max: int, alpha: float,
                       prior_df: int) -> Any:
    """The paired boundaries at `looks` for a bound prior of `prior_df` df (None: no df at the last
    look), as `evaluate` computes them."""
    if proto.df(n, looks[-1], float(bound_weight(prior_df, looks[-1]))) < 1:
        return None
    return proto.boundaries(n, looks, planned_max, alpha, prior_df, 0.0)


class _Path:
    """Accumulates a LookPath look by look."""

    def __init__(self, b: int, K: int, J: int):
        self.codes = np.empty((b, K), dtype=np.int8)
        self.h_up, self.t_up = np.zeros((b, K), bool), np.zeros((b, K, J), bool)
        self.h_delta, self.t_delta = np.zeros((b, K)), np.zeros((b, K, J))
        self.held = np.zeros((b, K), bool)

    def record(self, k: int, tl: Any, hl: Any, p_fut: np.ndarray, test: Any, task_upper: float, last: bool,
               futility_p: float, spread_p: np.ndarray) -> None:
        b = self.codes.shape[0]
        self.codes[:, k] = decide(
            wins=tl.wins, harms=tl.harms, horizontal_up=hl.up, horizontal_breadth=hl.breadth_up,
            horizontal_down=hl.down, horizontal_p=p_fut, failures=np.zeros(b, int),
            last=last, futility_p=futility_p,
        )
        self.h_up[:, k] = hl.up
        self.t_up[:, k] = test.t >= task_upper
        self.h_delta[:, k] = hl.test.delta
        self.t_delta[:, k] = test.delta
        with np.errstate(invalid="ignore"):
            self.held[:, k] = spread_p < SEED_SPREAD_P

    def finish(self, looks: tuple[int, ...]) -> LookPath:
        return LookPath(looks=looks, codes=self.codes, horizontal_up=self.h_up, task_up=self.t_up,
                        horizontal_delta=self.h_delta, task_delta=self.t_delta, held=self.held)
