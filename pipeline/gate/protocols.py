"""The two protocols and `evaluate`: runs in, one look's `GateResult` out.

Both protocols share every statistic and the verdict table; they differ here:

- `fixed` (the reference post): plain pooled t per task, nominal one-sided α at every look
  (= two-sided 2α), a task is a win or a harm on its own nominal p, no variance prior.
- `sequential`: the pooled t's variance is moderated by the baseline history (≤ 30 prior df),
  every test uses Lan-DeMets O'Brien-Fleming boundaries calibrated on the t scale, and per-task
  wins and harms come from Benjamini-Hochberg (q = harm_q) on boundary-scaled p-values.

Everything is oriented internally so that "+" means better (lower-is-better metrics are negated);
records report raw Δ = challenger - baseline in metric units.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import stats as sps

from pipeline.gate.boundaries import Boundaries, normalize_schedule
from pipeline.gate.inputs import GateConfig, GateInput, TaskRuns, parse_input
from pipeline.gate.power import DEFAULT_POWER, mde_at
from pipeline.gate.protocol import get_protocol
from pipeline.gate.report import (
    FailureReport,
    GateResult,
    HorizontalResult,
    SeedSpread,
    TaskResult,
    WelchResult,
)
from pipeline.gate.stats import (
    MAX_PAIR_RHO,
    Arm,
    Prior,
    TwoSample,
    arms_without_task,
    bh_qvalues,
    bound_priors,
    noisier_p,
    history_prior,
    horizontal_values,
    one_sided_p,
    pair_prior,
    paired_horizontal,
    paired_t,
    pooled_t,
    sequential_p,
    spread_ratio_p,
    summarize,
    variance_ratio_p,
    welch_t,
    without_task,
)
from pipeline.gate.verdict import ORDER, Verdict, decide

UNSTABLE_P = 0.05  # F-test level for "challenger variance ≫ baseline variance"


# ---------------------------------------------------------------- vectorised look statistics


@dataclass(frozen=True)
class TaskLook:
    """Per-task tests at one look, arrays of shape (..., tasks)."""

    test: TwoSample
    p_up: np.ndarray
    p_nominal: np.ndarray
    p: np.ndarray
    q: np.ndarray
    wins: np.ndarray
    harms: np.ndarray


def task_look(
    test: TwoSample, nominal: np.ndarray, protocol: str, alpha: float, harm_q: float
) -> TaskLook:  # `protocol`: a name in pipeline.gate.protocol.PROTOCOLS
    """p-values, BH q-values and win/harm flags from per-task t statistics and boundary levels.

    `nominal` is each boundary's one-sided nominal level (α itself for `fixed`), so the scaled
    p is ≤ α exactly when the boundary is crossed.
    """
    p_up = one_sided_p(test.t, test.df)
    p_down = one_sided_p(-test.t, test.df)
    p_nominal = np.minimum(1.0, 2.0 * np.minimum(p_up, p_down))
    p = np.minimum(1.0, 2.0 * np.minimum(sequential_p(p_up, nominal, alpha), sequential_p(p_down, nominal, alpha)))
    q = bh_qvalues(p, axis=-1)
    with np.errstate(invalid="ignore"):
        wins, harms = get_protocol(protocol).flags(p_up, p_down, q, test.t, alpha, harm_q)
    return TaskLook(test=test, p_up=p_up, p_nominal=p_nominal, p=p, q=q, wins=wins, harms=harms)


@dataclass(frozen=True)
class HorizontalLook:
    """The horizontal test at one look, arrays of shape (...)."""

    test: TwoSample
    p_up: np.ndarray
    up: np.ndarray
    down: np.ndarray
    breadth: TwoSample | None
    breadth_up: np.ndarray


def horizontal_look(
    test: TwoSample,
    upper: np.ndarray | float,
    breadth: TwoSample | None,
    breadth_required: np.ndarray | bool = True,
    futility: TwoSample | None = None,
) -> HorizontalLook:
    """Boundary crossings of the horizontal test both ways, and the breadth check.

    `test` is the horizontal test (pooled t on per-seed values, or the paired t on their paired
    differences), `breadth` the same test with the most-improved task left out: it must cross too
    only where that task stands out (`breadth_required`); with one task there is nothing to leave
    out (None). The futility rule's p comes from `futility` when given (the paired protocol's
    moderated test), else from `test`.
    """
    with np.errstate(invalid="ignore"):
        up, down = test.t >= upper, test.t <= -np.asarray(upper)
        if breadth is None:
            breadth_up = up
        else:
            breadth_up = (breadth.t >= upper) | ~np.asarray(breadth_required, dtype=bool)
    f = futility if futility is not None else test
    return HorizontalLook(
        test=test, p_up=one_sided_p(f.t, f.df), up=up, down=down, breadth=breadth, breadth_up=breadth_up
    )


def two_sample_horizontal(hb: np.ndarray, hc: np.ndarray) -> TwoSample:
    """The two-sample protocols' horizontal test: pooled t on the arms' per-seed horizontal values."""
    return pooled_t(summarize(hb), summarize(hc))


def most_improved(delta: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The task with the largest Δ/σ_task, and whether it stands out from the others.

    It stands out when it lies beyond the upper Tukey fence (Q3 + 1.5·IQR) of all tasks' Δ/σ_task
    (with 2 or 3 tasks there are no quartiles to speak of, so the top task always stands out).
    Only then must the horizontal test also cross without it: one task moving far more than the
    rest is exactly the case where a per-seed trimmed mean is pulled up (asymmetric trimming of the other
    tasks), while leaving out the top task when nothing stands out would throw away power, since
    removing the largest of several similar effects biases the rest downward.
    """
    with np.errstate(invalid="ignore", divide="ignore"):
        z = np.where(np.isfinite(delta / scale), delta / scale, np.nan)
    filled = np.where(np.isfinite(z), z, -np.inf)
    top = np.argmax(filled, axis=-1)
    count = np.isfinite(z).sum(axis=-1)
    if z.shape[-1] < 4:
        return top, count >= 2
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN rows: no task to leave out
        quartiles = np.percentile if np.isfinite(z).all() else np.nanpercentile  # the former is much faster
        q1, q3 = quartiles(z, [25, 75], axis=-1)
        outlier = np.take_along_axis(filled, top[..., None], axis=-1)[..., 0] > q3 + 1.5 * (q3 - q1)
    return top, np.where(count >= 4, outlier, count >= 2)


def task_scale(base: Arm, hist: Arm | None, arms: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """σ_task and its df from the baseline commit's runs (comparison baseline + history) and, for
    `paired`, the within-arm spread of earlier arms (`arms` (..., arms, tasks, seeds), commits other
    than this comparison's): a lazy baseline has 2 seeds at its first look, too few for a scale.

    Never from the challenger, so per-seed horizontal values do not move when challenger runs arrive.
    """
    ss, df = base.ss, base.count - 1.0
    if hist is not None:
        ss = ss + hist.ss
        df = df + np.maximum(hist.count - 1.0, 0.0)
    if arms is not None and arms.shape[-1]:
        a = summarize(arms)  # (..., arms, tasks)
        ss = ss + np.where(a.count > 1, a.ss, 0.0).sum(axis=-2)
        df = df + np.maximum(a.count - 1.0, 0.0).sum(axis=-2)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(df > 0, np.sqrt(ss / np.maximum(df, 1.0)), np.nan), df


# ---------------------------------------------------------------- evaluate: one hypothesis


def _pad(rows: list[list[float]], width: int) -> np.ndarray:
    out = np.full((len(rows), max(width, 1)), np.nan)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


@dataclass(frozen=True)
class _Schedule:
    planned: tuple[int, ...]
    seeds: tuple[int, ...]  # challenger seed counts of the looks taken, this one last
    is_look: bool
    last: bool
    next_look: int | None


def _schedule(inp: GateInput) -> _Schedule:
    cfg, m = inp.config, inp.challenger_count
    complete = all(len(t.challenger) == m for t in inp.tasks)
    planned = cfg.looks
    is_look = inp.at_look if inp.at_look is not None else complete and (m in planned or m >= planned[-1])
    done = sorted({l for l in (inp.looks_done if inp.looks_done is not None else planned) if 0 < l < m})
    later = [l for l in planned if l > m]
    return _Schedule(
        planned=planned,
        seeds=tuple(done) + (m,),
        is_look=bool(is_look),
        last=m >= planned[-1],
        next_look=later[0] if later else None,
    )


def _counts_at(values: np.ndarray, seeds: tuple[int, ...]) -> tuple[int, ...]:
    """Successful runs among the first k seeds, for each look's seed count k."""
    ok = np.isfinite(values)
    return tuple(int(ok[:k].sum()) for k in seeds)


def _boundaries(
    cfg: GateConfig, n: int, counts: tuple[int, ...], planned_max: int, prior_df: int, weight: float
) -> Boundaries | None:
    counts = tuple(c for c in counts if c >= 1)
    proto = get_protocol(cfg.protocol)
    if n < 1 or not counts or proto.df(n, counts[-1], weight) < 1:
        return None
    sched = normalize_schedule(counts)
    return proto.boundaries(n, sched, planned_max, cfg.alpha, int(prior_df), float(weight))


@dataclass(frozen=True)
class PairedTests:
    """The paired protocol's statistics at one look, arrays (..., tasks) or (...)."""

    test: TwoSample  # per task: the moderated paired t
    d: np.ndarray  # (..., tasks, seeds) paired differences, NaN where a seed has no pair
    h: TwoSample  # horizontal, its variance moderated by the unpaired bound: what the boundaries judge
    h_futility: TwoSample  # horizontal, moderated by the lab's history: what the futility rule judges
    hd: np.ndarray  # (..., seeds) per-seed horizontal paired differences
    prior: Prior  # per task: the unpaired bound (its df feed the boundaries)
    bound: Prior  # (...): the unpaired bound on the horizontal variance (its df feed the boundaries)
    lab: Prior  # (...): one earlier arm's spread of per-seed horizontal values (var) and its df
    hc: np.ndarray  # (..., seeds) the challenger's per-seed horizontal values (paired seeds)


def _by_seed(records: list[dict[str, list[float | None]]], names: list[str], sign: float) -> np.ndarray | None:
    """(records, tasks, seeds) of {task: [value by seed]} records (None = no value), NaN-padded and
    oriented; None without any value."""
    width = max((len(v) for r in records for v in r.values()), default=0)
    if width == 0:
        return None
    out = np.full((len(records), len(names), width), np.nan)
    for i, rec in enumerate(records):
        for j, name in enumerate(names):
            row = [math.nan if v is None else float(v) for v in rec.get(name, [])]
            out[i, j, : len(row)] = row
    return sign * out


def _pair_history(inp: GateInput, names: list[str], sign: float) -> np.ndarray | None:
    """(tasks, comparisons, seeds) paired differences of the lab's earlier comparisons, oriented."""
    out = _by_seed(inp.pair_history, names, sign)
    return None if out is None else np.moveaxis(out, 0, 1)


def _arm_history(inp: GateInput, names: list[str], sign: float) -> np.ndarray | None:
    """(arms, tasks, seeds) runs of the lab's earlier arms, oriented (the unpaired bound's history)."""
    return _by_seed(inp.arm_history, names, sign)


def paired_tests(
    base: np.ndarray, chal: np.ndarray, scale: np.ndarray, hb: np.ndarray, trim: float, history: np.ndarray | None,
    arms: np.ndarray | None = None,
) -> PairedTests:
    """The paired protocol's statistics: per-task moderated paired t, the horizontal paired t
    moderated by the unpaired bound (boundaries) and by the history of paired differences (futility).

    Arrays (..., tasks, seeds), oriented; `hb` the baseline's per-seed horizontal values (the
    variance floor); `history` (..., tasks, comparisons, seeds) of earlier paired differences;
    `arms` (..., arms, tasks, seeds) runs of earlier arms (`stats.bound_priors`).
    """
    m = chal.shape[-1]
    d = chal - base[..., :m] if base.shape[-1] >= m else chal - _widen(base, m)
    floor = 2.0 * (1.0 - MAX_PAIR_RHO) * scale**2
    hd = paired_horizontal(d, scale, trim)
    prior, bound = bound_priors(arms, scale, trim, np.isfinite(d).sum(axis=-1), np.isfinite(hd).sum(axis=-1))
    # the bound is one arm's spread (the baseline's, from the lab) plus the challenger's: the lab's
    # too, unless its own runs spread more (a noisier branch, or one that makes itself noisier)
    paired_chal = np.where(np.isfinite(d), chal, np.nan)
    _, hc = horizontal_values(base, paired_chal, summarize(base).mean, scale, trim)
    lab = Prior(var=bound.var / 2.0, df=bound.df, weight=bound.weight)
    prior = _with_own_spread(prior, summarize(paired_chal).var)
    bound = _with_own_spread(bound, summarize(hc).var)
    test = paired_t(d, prior, floor)
    h_floor = 2.0 * (1.0 - MAX_PAIR_RHO) * np.nan_to_num(summarize(hb).var, nan=0.0)
    h = paired_t(hd, bound, h_floor)
    h_fut = h
    if history is not None:  # each earlier comparison's per-seed horizontal differences, on this σ_task
        h_hist = paired_horizontal(np.moveaxis(history, -3, -2), scale[..., None, :], trim)
        h_fut = paired_t(hd, pair_prior(h_hist, hd.shape[:-1]), h_floor)
    return PairedTests(test=test, d=d, h=h, h_futility=h_fut, hd=hd, prior=prior, bound=bound, lab=lab, hc=hc)


def _with_own_spread(bound: Prior, own: np.ndarray) -> Prior:
    """The unpaired bound with the challenger's arm at max(the lab's spread, its own), where it has
    2 runs or more: Var(c - b) ≤ Var c + Var b holds for any challenger variance, not only the lab's."""
    one = bound.var / 2.0
    with np.errstate(invalid="ignore"):
        var = np.where(np.isfinite(own), one + np.maximum(one, own), bound.var)
    return Prior(var=var, df=bound.df, weight=bound.weight)


def futility_p_value(p_up: np.ndarray, hd: np.ndarray) -> np.ndarray:
    """The paired futility rule's p: one pair and no history of paired differences give no variance
    yet, so no futility either (p 0: the next look decides); no pair at all gives NaN (never escalates)."""
    return np.where(np.isfinite(p_up) | ~np.isfinite(hd).any(axis=-1), p_up, 0.0)


def _widen(x: np.ndarray, width: int) -> np.ndarray:
    out = np.full(x.shape[:-1] + (width,), np.nan)
    out[..., : x.shape[-1]] = x
    return out


def evaluate(inp: GateInput | dict[str, Any]) -> GateResult:
    """Judge one look of one hypothesis (see `pipeline.gate` for the input shape)."""
    return _evaluate(parse_input(inp), with_sensitivity=True)


def _evaluate(inp: GateInput, with_sensitivity: bool) -> GateResult:
    cfg = inp.config
    proto = get_protocol(cfg.protocol)
    sign = 1.0 if cfg.higher_is_better else -1.0
    names = [t.task for t in inp.tasks]
    sched = _schedule(inp)
    m = inp.challenger_count

    base = sign * _pad([t.baseline_values() for t in inp.tasks], max(len(t.baseline) for t in inp.tasks))
    chal = sign * _pad([t.challenger_values() for t in inp.tasks], m)
    extra = [t.extra_history() for t in inp.tasks]
    hist = sign * _pad(extra, max(len(h) for h in extra)) if any(extra) else None
    failed = np.array([t.failed() for t in inp.tasks])

    base_arm, chal_arm = summarize(base), summarize(chal)
    hist_arm = summarize(hist) if hist is not None else None
    arms = _arm_history(inp, names, sign) if proto.paired else None
    scale, scale_df = task_scale(base_arm, hist_arm, arms)
    hb, hc = horizontal_values(base, chal, base_arm.mean, scale, cfg.horizontal_trim)
    pairs_dropped = np.zeros(len(names), dtype=int)
    if proto.paired:
        pt = paired_tests(base, chal, scale, hb, cfg.horizontal_trim, _pair_history(inp, names, sign), arms)
        test, prior, h, h_fut, h_values, task_values = pt.test, pt.prior, pt.h, pt.h_futility, pt.hd, pt.d
        counts = np.isfinite(pt.d).sum(axis=-1)
        pairs_dropped = chal_arm.count - counts  # a challenger run whose baseline seed has no result
        top_arr, stands_out = most_improved(test.delta, scale)
        top = int(top_arr)
        h_breadth = None
        if len(names) > 1:
            h_breadth = paired_tests(without_task(base, top), without_task(chal, top), scale, hb,
                                     cfg.horizontal_trim, None, arms_without_task(arms, top)).h
    else:
        prior = history_prior(hist, base_arm.mean.shape) if proto.moderated else None
        test = pooled_t(base_arm, chal_arm, prior)
        counts = chal_arm.count
        top_arr, stands_out = most_improved(test.delta, scale)
        top = int(top_arr)
        h = h_fut = two_sample_horizontal(hb, hc)
        h_breadth = None
        if len(names) > 1:
            bb, bc = horizontal_values(without_task(base, top), without_task(chal, top), base_arm.mean, scale,
                                       cfg.horizontal_trim)
            h_breadth = two_sample_horizontal(bb, bc)
        h_values, task_values = hc, chal
    weight = prior.weight if prior is not None else np.zeros(len(names))
    prior_df = prior.df if prior is not None else np.zeros(len(names), dtype=int)

    # per-task boundaries: each task's own schedule (failed runs and dropped pairs add no information)
    bounds = [
        _boundaries(cfg, int(base_arm.count[j]), _counts_at(task_values[j], sched.seeds),
                    sched.planned[-1] - int(m - counts[j]) if proto.paired else sched.planned[-1] - int(failed[j]),
                    int(prior_df[j]), float(weight[j]))
        for j in range(len(names))
    ]
    upper = np.array([b.upper[-1] if b else np.inf for b in bounds])
    nominal = np.array([b.nominal[-1] if b else np.nan for b in bounds])
    tl = task_look(test, nominal, cfg.protocol, cfg.alpha, cfg.harm_q)

    # horizontal: its boundaries borrow only the unpaired bound (`paired`), never the history of pairs
    h_df = int(pt.bound.df) if proto.paired else 0
    hbounds = _boundaries(cfg, int(np.isfinite(hb).sum()), _counts_at(h_values, sched.seeds), sched.planned[-1], h_df,
                          float(pt.bound.weight) if proto.paired else 0.0)
    h_upper = hbounds.upper[-1] if hbounds else np.inf
    hl = horizontal_look(h, h_upper, h_breadth, bool(stands_out), h_fut)
    no_variance = bool(proto.paired and int(np.isfinite(h_values).sum()) >= 1 and not np.isfinite(hl.p_up))
    p_futility = np.atleast_1d(futility_p_value(hl.p_up, h_values) if proto.paired else hl.p_up)

    total_failed = int(failed.sum())
    code = decide(
        wins=tl.wins[None, :],
        harms=tl.harms[None, :],
        horizontal_up=np.atleast_1d(hl.up),
        horizontal_breadth=np.atleast_1d(hl.breadth_up),
        horizontal_down=np.atleast_1d(hl.down),
        horizontal_p=p_futility,
        failures=np.array([total_failed]),
        last=sched.last,
        futility_p=cfg.futility_p,
    )[0]
    verdict = ORDER[int(code)] if sched.is_look else None

    # unstable challengers: F-test against the baseline commit's variance, Welch beside
    f_p = variance_ratio_p(scale**2, scale_df, chal_arm)
    welch = welch_t(base_arm, chal_arm)
    spread = _seed_spread(hb, hc, pt.lab if proto.paired else None, pt.hc if proto.paired else None)

    tasks = [
        _task_record(
            j, name, sign, cfg, sched, m, test, tl, base_arm, chal_arm, failed, upper, bounds, prior_df, weight, f_p,
            welch, int(counts[j]), int(pairs_dropped[j]),
        )
        for j, name in enumerate(names)
    ]
    ci = _interval(float(hl.test.delta), h_upper * float(hl.test.se), 1.0)
    horizontal = HorizontalResult(
        baseline_seeds=int(np.isfinite(hb).sum()),
        challenger_seeds=int(np.isfinite(hc).sum()),
        baseline_mean=float(np.nanmean(hb)) if np.isfinite(hb).any() else None,
        challenger_mean=float(np.nanmean(hc)) if np.isfinite(hc).any() else None,
        delta=hl.test.delta,
        ci_low=ci[0],
        ci_high=ci[1],
        df=hl.test.df,
        t=hl.test.t,
        boundary=h_upper,
        p_one_sided=hl.p_up,
        breadth_t=hl.breadth.t if hl.breadth is not None else None,
        breadth_task=names[top] if hl.breadth is not None else None,
        breadth_required=bool(stands_out) if hl.breadth is not None else False,
        mde_next=_horizontal_mde(cfg, sched, hb, h_values, hl.test),
        pairs=int(np.isfinite(h_values).sum()) if proto.paired else None,
    )

    sensitivity, sens_verdict = None, None
    if with_sensitivity and total_failed:
        worst = _worst_case(inp)
        sens_verdict = worst.verdict
        sensitivity = (
            f"worst case: {total_failed} failed run(s) scored as their task's worst observed value → "
            f"{worst.verdict.value if worst.verdict else 'no verdict (between looks)'}, horizontal Δ "
            f"{_fmt(worst.horizontal.delta)}σ, t {_fmt(worst.horizontal.t)}"
        )

    reasons = _reasons(verdict, tl, hl, h_upper, names, total_failed, cfg, sched, top)
    if verdict is not None and no_variance:
        reasons.append("one pair and no history of paired differences in this lab: no variance yet, "
                       f"so no futility test: run to {sched.next_look}")
    dropped = int(pairs_dropped.sum())
    if verdict is not None and dropped:
        reasons.append(f"{dropped} challenger run(s) without a baseline result on the same seed: "
                       "dropped from the paired tests")
    return GateResult(
        protocol=cfg.protocol,
        alpha=cfg.alpha,
        higher_is_better=cfg.higher_is_better,
        look=m,
        looks_done=list(sched.seeds),
        planned_looks=list(sched.planned),
        is_look=sched.is_look,
        last_look=sched.last,
        next_look=sched.next_look,
        verdict=verdict,
        reasons=reasons,
        tasks=tasks,
        horizontal=horizontal,
        failures=FailureReport(
            failed_runs=total_failed,
            not_promising=total_failed >= 2,
            sensitivity=sensitivity,
            sensitivity_verdict=sens_verdict,
        ),
        seed_spread=spread,
        baseline_runs_used=int(base_arm.count.sum()),
        challenger_runs_used=int(sum(len(t.challenger) for t in inp.tasks)),
        mde_power=DEFAULT_POWER,
    )


SEED_SPREAD_P = 0.01  # lower-tail F level below which a challenger's seeds "do not vary"


def _seed_spread(hb: np.ndarray, hc: np.ndarray, lab: Prior | None = None,
                 hc_paired: np.ndarray | None = None) -> SeedSpread | None:
    """Seeds must vary: the challenger's per-seed horizontal values against the baseline's spread;
    `paired` (`lab`, the earlier arms' spread): and not far above the lab's either."""
    ratio, p = spread_ratio_p(hb, hc)
    up_ratio, p_up = (noisier_p(hc_paired, lab.var, lab.df) if lab is not None and hc_paired is not None
                      else (np.nan, np.nan))
    if not np.isfinite(p) and not np.isfinite(p_up):
        return None
    ratio, p, up_ratio, p_up = float(ratio), float(p), float(up_ratio), float(p_up)
    low = bool(np.isfinite(p) and p < SEED_SPREAD_P)
    high = bool(np.isfinite(p_up) and p_up < SEED_SPREAD_P)
    reasons = []
    if low:
        what = ("its runs do not vary with the seed" if ratio == 0 else
                f"its spread across seeds is {ratio:.3g}× the baseline's (lower-tail F p {p:.2g} < {SEED_SPREAD_P})")
        reasons.append(f"seeds must vary: {what} while the baseline's do; a branch that ignores or hard-codes "
                       "the seed repeats one draw, and replication over seeds is what the gate stands on")
    if high:
        reasons.append(f"noisier than the lab: its spread across seeds is {up_ratio:.3g}× that of the lab's earlier "
                       f"arms (upper-tail F p {p_up:.2g} < {SEED_SPREAD_P}); the paired gate's bound assumes a "
                       "challenger no noisier than them, and a noisier branch buys more chances at a lucky draw")
    return SeedSpread(ratio=ratio if np.isfinite(ratio) else None, p_lower=p if np.isfinite(p) else None,
                      held=low or high, reason="; ".join(reasons) or None,
                      noisier_ratio=up_ratio if np.isfinite(up_ratio) else None,
                      p_upper=p_up if np.isfinite(p_up) else None)


def _interval(delta: float, half: float, sign: float) -> tuple[float | None, float | None]:
    """delta ± half in raw metric units (None when undefined, e.g. no boundary can be crossed)."""
    if not (math.isfinite(delta) and math.isfinite(half)):
        return None, None
    a, b = sign * (delta - half), sign * (delta + half)
    return min(a, b), max(a, b)


def _task_record(
    j: int,
    name: str,
    sign: float,
    cfg: GateConfig,
    sched: _Schedule,
    m: int,
    test: TwoSample,
    tl: TaskLook,
    base: Arm,
    chal: Arm,
    failed: np.ndarray,
    upper: np.ndarray,
    bounds: list[Boundaries | None],
    prior_df: np.ndarray,
    weight: np.ndarray,
    f_p: np.ndarray,
    welch: TwoSample,
    count: int,
    pairs_dropped: int,
) -> TaskResult:
    """One task's row: arm means, Δ with its (repeated) interval, p, q, flags, Welch, next-look MDE.
    `count` is what the test stands on: challenger runs, or pairs for `paired`."""
    ci = _interval(float(test.delta[j]), float(upper[j] * test.se[j]), sign)
    flags = []
    if sched.is_look and tl.wins[j]:
        flags.append("win")
    if sched.is_look and tl.harms[j]:
        flags.append("harm")
    unstable = bool(np.isfinite(f_p[j]) and f_p[j] < UNSTABLE_P)
    if unstable:
        flags.append("unstable")
    n, c = int(base.count[j]), int(chal.count[j])
    return TaskResult(
        task=name,
        baseline_runs=n,
        challenger_runs=c,
        failed_runs=int(failed[j]),
        baseline_mean=sign * base.mean[j],
        challenger_mean=sign * chal.mean[j],
        delta=sign * test.delta[j],
        ci_low=ci[0],
        ci_high=ci[1],
        sigma=test.se[j] / get_protocol(cfg.protocol).se_factor(n, count) if n and count else None,
        prior_df=int(prior_df[j]),
        df=test.df[j],
        t=test.t[j],
        boundary=upper[j],
        p_nominal=tl.p_nominal[j],
        p=tl.p[j],
        q=tl.q[j],
        flags=flags,
        variance_ratio_p=f_p[j],
        welch=_welch_record(welch, j, sign, cfg.alpha) if unstable else None,
        mde_next=_task_mde(cfg, sched, bounds[j], test, base, count, weight[j], prior_df[j], j, m),
        pairs=count if get_protocol(cfg.protocol).paired else None,
        pairs_dropped=pairs_dropped,
    )


def _fmt(v: float | None) -> str:
    return "—" if v is None else f"{v:+.3f}"


def _welch_record(w: TwoSample, j: int, sign: float, alpha: float) -> WelchResult:
    crit = float(sps.t.isf(alpha, w.df[j])) if np.isfinite(w.df[j]) else math.nan
    lo, hi = w.delta[j] - crit * w.se[j], w.delta[j] + crit * w.se[j]
    p = float(2 * sps.t.sf(abs(w.t[j]), w.df[j])) if np.isfinite(w.t[j]) else math.nan
    return WelchResult(
        delta=sign * w.delta[j], ci_low=min(sign * lo, sign * hi), ci_high=max(sign * lo, sign * hi), df=w.df[j], p=p
    )


def _next_crit(cfg: GateConfig, n: int, counts: tuple[int, ...], planned_max: int, prior_df: int, weight: float) -> float | None:
    """The next look's boundary, for the minimum detectable effect (a report: nothing decides on it).
    Its prior df is rounded down to a power of two, so the hypothetical schedule's calibration is
    shared by every look of a lab whose history grows (a slightly larger, conservative MDE)."""
    prior_df = 1 << (int(prior_df).bit_length() - 1) if prior_df > 0 else 0
    b = _boundaries(cfg, n, counts, planned_max, prior_df, weight)
    return b.upper[-1] if b else None


def _task_mde(
    cfg: GateConfig,
    sched: _Schedule,
    bounds: Boundaries | None,
    test: TwoSample,
    base: Arm,
    count: int,
    weight: float,
    prior_df: int,
    j: int,
    m: int,
) -> float | None:
    """Smallest improvement (metric units) the task's test would detect at the next planned look.
    `count`: the challenger runs (pairs for `paired`) the test stands on now."""
    if sched.next_look is None or bounds is None or not np.isfinite(test.se[j]) or count < 1:
        return None
    proto = get_protocol(cfg.protocol)
    n, c = int(base.count[j]), count
    m_next = c + (sched.next_look - m)
    n_next = max(n, m_next) if proto.paired else n
    sigma = test.se[j] / proto.se_factor(n, c)
    crit = _next_crit(cfg, n_next, bounds.looks + (m_next,), sched.planned[-1] - (m - c), prior_df, weight)
    if crit is None or not np.isfinite(crit) or sigma <= 0:
        return None
    return mde_at(sigma * proto.se_factor(n_next, m_next), proto.df(n_next, m_next, weight), crit, False,
                  DEFAULT_POWER)


def _horizontal_mde(cfg: GateConfig, sched: _Schedule, hb: np.ndarray, hc: np.ndarray, test: TwoSample) -> float | None:
    """Smallest horizontal improvement (σ units) detectable at the next planned look. `hc`: the
    challenger's per-seed values (for `paired`, the per-seed paired differences)."""
    proto = get_protocol(cfg.protocol)
    n, c = int(np.isfinite(hb).sum()), int(np.isfinite(hc).sum())
    if sched.next_look is None or c < 1 or not np.isfinite(test.se) or test.se <= 0:
        return None
    m_next = c + (sched.next_look - int(hc.shape[-1]))
    n_next = max(n, m_next) if proto.paired else n
    sigma = float(test.se) / proto.se_factor(n, c)
    counts = _counts_at(hc, sched.seeds) + (m_next,)
    crit = _next_crit(cfg, n_next, counts, sched.planned[-1], 0, 0.0)
    if crit is None or not np.isfinite(crit):
        return None
    return mde_at(sigma * proto.se_factor(n_next, m_next), proto.df(n_next, m_next, 0.0), crit, False,
                  DEFAULT_POWER)


def _worst_case(inp: GateInput) -> GateResult:
    """The same look with every failed challenger run replaced by its task's worst observed value."""
    hib = inp.config.higher_is_better
    tasks = []
    for t in inp.tasks:
        seen = [v for v in t.baseline_values() + t.challenger_values() + t.extra_history() if not math.isnan(v)]
        worst = (min(seen) if hib else max(seen)) if seen else math.nan
        chal = [worst if math.isnan(v) else v for v in t.challenger_values()]
        tasks.append(TaskRuns(task=t.task, baseline=t.baseline, challenger=chal, history=t.history))
    return _evaluate(inp.model_copy(update={"tasks": tasks}), with_sensitivity=False)


def _reasons(
    verdict: Verdict | None,
    tl: TaskLook,
    hl: HorizontalLook,
    h_upper: float,
    names: list[str],
    failed: int,
    cfg: GateConfig,
    sched: _Schedule,
    top: int,
) -> list[str]:
    """Plain-language grounds for the verdict (empty between looks: no verdict, no labels)."""
    if verdict is None:
        return []
    t, out = float(hl.test.t), []
    harms = [names[j] for j in np.flatnonzero(tl.harms)]
    wins = [names[j] for j in np.flatnonzero(tl.wins)]
    if harms:
        out.append(f"harm on {', '.join(harms)} ({get_protocol(cfg.protocol).harm_rule(cfg.harm_q)})")
    if hl.down:
        out.append(f"horizontal t {t:.2f} ≤ -{h_upper:.2f}: the tasks got worse together")
    if failed >= 2:
        out.append(f"{failed} failed challenger runs: not promising")
    if hl.up and not hl.breadth_up:
        out.append(
            f"horizontal t {t:.2f} crossed {h_upper:.2f} but not without {names[top]}, which stands out "
            f"(t {float(hl.breadth.t):.2f}): driven by one task"
        )
    elif hl.up:
        out.append(f"horizontal t {t:.2f} ≥ boundary {h_upper:.2f}")
    else:
        out.append(f"horizontal t {t:.2f} < boundary {h_upper:.2f}")
    if verdict is Verdict.escalate:
        out.append(f"horizontal one-sided p {float(hl.p_up):.3f} < futility_p {cfg.futility_p}: run to {sched.next_look}")
    elif verdict is Verdict.futile and failed < 2:
        out.append(f"horizontal one-sided p {float(hl.p_up):.3f} ≥ futility_p {cfg.futility_p}")
    if wins:
        out.append(f"per-task wins: {', '.join(wins)}")
    return out
