"""A look's statistics, for `evaluate` (pipeline.gate.judge) and the simulator (pipeline.gate.paths):
the per-task tests and their flags, the horizontal test and its breadth check, σ_task, and the two
ways a protocol tests a look (`LookTests`): two samples (`two_sample_tests`) or the paired
differences of seed k (`paired_look_tests`). A protocol picks its way (`GateProtocol.look_tests`);
nothing here asks which protocol it is.

Arrays are oriented so that + is better.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from pipeline.gate.stats import (
    MAX_PAIR_RHO,
    Arm,
    Prior,
    TwoSample,
    arms_without_task,
    bh_qvalues,
    bound_priors,
    bound_weight,
    history_prior,
    horizontal_values,
    noisier_p,
    one_sided_p,
    pair_prior,
    paired_horizontal,
    paired_t,
    pooled_t,
    sequential_p,
    summarize,
    without_task,
)

if TYPE_CHECKING:
    from pipeline.gate.boundaries import Boundaries


class GateProtocol(Protocol):
    """What a look's statistics ask of their gate protocol (`pipeline.gate.protocol.base.GateProtocol`
    has it; named here so that the statistics need not import the protocols that call them)."""

    moderated: bool

    def df(self, n_baseline: int, n_challenger: int, prior_weight: float) -> float: ...

    def boundaries(self, n_baseline: int, looks: tuple[int, ...], planned_max: int, alpha: float,
                   prior_df: int = 0, prior_weight: float = 0.0) -> Boundaries: ...

    def flags(self, p_up: np.ndarray, p_down: np.ndarray, q: np.ndarray, t: np.ndarray, alpha: float,
              harm_q: float) -> tuple[np.ndarray, np.ndarray]: ...

SEED_SPREAD_P = 0.01  # lower-tail F level below which a challenger's seeds "do not vary"

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


def task_look(test: TwoSample, nominal: np.ndarray, proto: GateProtocol, alpha: float, harm_q: float) -> TaskLook:
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
        wins, harms = proto.flags(p_up, p_down, q, test.t, alpha, harm_q)
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
    # (...): the challenger's per-seed horizontal spread over one lab arm's, and the upper-tail F p of
    # it (`stats.noisier_p`; NaN: fewer than 2 pairs, or no lab arm): the "noisier than the lab" hold
    noisier: tuple[np.ndarray, np.ndarray]


def paired_tests(
    base: np.ndarray, chal: np.ndarray, scale: np.ndarray, hb: np.ndarray, trim: float, history: np.ndarray | None,
    arms: np.ndarray | None = None,
    hist: np.ndarray | None = None,
) -> PairedTests:
    """The paired protocol's statistics: per-task moderated paired t, the horizontal paired t
    moderated by the unpaired bound (boundaries) and by the history of paired differences (futility).

    Arrays (..., tasks, seeds), oriented; `hb` the baseline's per-seed horizontal values (the
    variance floor); `history` (..., tasks, comparisons, seeds) of earlier paired differences;
    `arms` (..., arms, tasks, seeds) runs of earlier arms (`stats.bound_priors`); `hist` (..., tasks,
    h) the baseline commit's runs off the pairs, finished before the comparison began: one more arm
    behind the bound (`with_baseline_arm`).
    """
    m = chal.shape[-1]
    d = chal - base[..., :m] if base.shape[-1] >= m else chal - _widen(base, m)
    floor = 2.0 * (1.0 - MAX_PAIR_RHO) * scale**2
    hd = paired_horizontal(d, scale, trim)
    pairs, h_pairs = np.isfinite(d).sum(axis=-1), np.isfinite(hd).sum(axis=-1)
    lab_arms = with_baseline_arm(arms, hist)
    prior, bound = bound_priors(lab_arms, scale, trim, pairs, h_pairs)
    # the bound is one arm's spread (the baseline's, from the lab) plus the challenger's: the lab's
    # too, unless its own runs spread more (a noisier branch, or one that makes itself noisier)
    paired_chal = np.where(np.isfinite(d), chal, np.nan)
    base_arm = summarize(base)
    _, hc = horizontal_values(base, paired_chal, base_arm.mean, scale, trim)
    chal_arm, own_h = summarize(paired_chal), summarize(hc).var
    # its spread over the lab's, pooled across tasks; the lab's per task pools the earlier arms with
    # this comparison's baseline runs (df-weighted): a lab of few arms alone made a challenger as
    # noisy as its baseline look twice as noisy (benchmarks/planted.py: a 3.2σ gain not promoted)
    ratio, ratio_df = noise_ratio(chal_arm, _reference_spread(prior, base_arm))
    ratio_df = ratio_df / _spread_overlap(bound, prior.var / 2.0 / scale**2)  # what that many tasks are worth
    # the hold's test: its horizontal spread over the lab's (the pooled ratio's F-test held 2x as many
    # large true gains in loop_quality at cross-task ρ 0.6, where a hypothesis that runs on is one whose
    # noise drew wide: the bound takes the ratio in, the hold stays for the blatant)
    noisier = noisier_p(hc, bound.var / 2.0, bound.df)
    h_df = _noisy_df(bound, ratio, ratio_df)

    def widened(b: Prior) -> Prior:  # the challenger's half at the largest of the lab's, its own, ratio × lab's
        return _with_own_spread(b, np.fmax(own_h, ratio * b.var / 2.0))

    prior = _with_own_spread(prior, np.fmax(chal_arm.var, ratio[..., None] * prior.var / 2.0))
    wide = widened(bound)
    bound = Prior(var=wide.var, df=h_df, weight=bound_weight(h_df, h_pairs))
    test = paired_t(d, prior, floor)
    h_floor = 2.0 * (1.0 - MAX_PAIR_RHO) * np.nan_to_num(summarize(hb).var, nan=0.0)
    h = paired_t(hd, bound, h_floor)
    if history is not None:  # each earlier comparison's per-seed horizontal differences, on this σ_task
        h_hist = paired_horizontal(np.moveaxis(history, -3, -2), scale[..., None, :], trim)
        h_fut = paired_t(hd, pair_prior(h_hist, hd.shape[:-1]), h_floor)
    else:  # futility stands on the earlier arms alone: a baseline's few seeds (a bound of 1-2 df) would
        # stop true gains at one pair; without them the bound is that already
        lab_only = wide if lab_arms is arms else widened(bound_priors(arms, scale, trim, pairs, h_pairs)[1])
        h_fut = paired_t(hd, lab_only, h_floor)
    return PairedTests(test=test, d=d, h=h, h_futility=h_fut, hd=hd, prior=prior, bound=bound, noisier=noisier)


def with_baseline_arm(arms: np.ndarray | None, hist: np.ndarray | None) -> np.ndarray | None:
    """The lab's earlier arms (..., arms, tasks, seeds) and, as one more, this comparison's baseline
    commit's runs off this look's pairs, finished before the comparison began (`hist` (..., tasks, h):
    a variance study, earlier challengers' deeper looks; frozen with the comparison, so the bound stays
    a function of the look). They join only where every task has as many (then they line up by seed
    across tasks, as a horizontal value needs) and at least 2.

    The first comparison of a lab has no earlier arm, and without a measured noise a large gain waits
    for its own pairs' variance (1 df at two pairs). The paired seeds' own baseline runs stay out: the
    pairs' variance is made of them too, and a bound that shares them with it has fewer df than
    its calibration assumes (measured: 4.6 % false promotions at 2 seeds, against 1.5 % without)."""
    if hist is None or not hist.shape[-1]:
        return arms
    counts = np.isfinite(hist).sum(axis=-1)  # (..., tasks); a task left out (0) does not count
    aligned = ((counts == counts.max(axis=-1, keepdims=True)) | (counts == 0)).all(axis=-1)  # (...)
    aligned &= counts.max(axis=-1) >= 2
    if not aligned.any():
        return arms
    arm = np.where(aligned[..., None, None], hist, np.nan)[..., None, :, :]
    if arms is None:
        return arm
    width = max(arm.shape[-1], arms.shape[-1])
    return np.concatenate([_widen(arms, width), _widen(arm, width)], axis=-3)


def noise_ratio(chal: Arm, one: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The challenger's per-seed spread over one lab arm's (`one`, per task), pooled across tasks:
    Σ_j (n_j − 1)·s²_j / one_j ÷ Σ_j (n_j − 1), over the tasks where both are known (NaN: none). With
    2 pairs a task's own spread has 1 df, the pooled ratio one per task: a branch that makes itself
    noisier on every task is seen at the look where the horizontal spread alone (1 df) hides it.
    Returns (ratio, its df Σ_j (n_j − 1))."""
    with np.errstate(invalid="ignore", divide="ignore"):
        df = np.maximum(chal.count - 1, 0).astype(float)
        ok = (df > 0) & np.isfinite(one) & (one > 0)
        total = np.where(ok, df, 0.0).sum(axis=-1)
        num = np.where(ok, chal.ss / np.where(ok, one, 1.0), 0.0).sum(axis=-1)
        return np.where(total > 0, num / np.maximum(total, 1.0), np.nan), total


def _reference_spread(prior: Prior, base: Arm) -> np.ndarray:
    """One arm's seed spread per task that the noise ratio divides by: the lab arms' (`prior.var / 2`,
    on `prior.df` df) pooled with the baseline commit's runs at this look (`base`, on count − 1 df),
    each by its df; either alone where the other has none (NaN: neither)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        lab_df = np.where(np.isfinite(prior.var) & (prior.df > 0), prior.df, 0).astype(float)
        b_df = np.where(np.isfinite(base.var), np.maximum(base.count - 1, 0), 0).astype(float)
        ss = lab_df * np.where(lab_df > 0, prior.var / 2.0, 0.0) + np.where(b_df > 0, base.ss, 0.0)
        df = lab_df + b_df
        return np.where(df > 0, ss / np.maximum(df, 1.0), np.nan)


def _spread_overlap(bound: Prior, one_z: np.ndarray) -> np.ndarray:
    """1 + (T − 1)·ρ²: how much T tasks' spreads move together, ρ the tasks' correlation as the lab's
    arms show it (one arm's horizontal spread `bound.var / 2` against its per-task spreads `one_z`, in
    σ units: T·V_h / mean V_j = 1 + (T − 1)·ρ for a plain mean). A pooled ratio of T tasks' spreads
    has its df divided by it."""
    with np.errstate(invalid="ignore", divide="ignore"):
        ok = np.isfinite(one_z) & (one_z > 0)
        n = ok.sum(axis=-1)
        mean_one = np.where(ok, one_z, 0.0).sum(axis=-1) / np.maximum(n, 1)
        rho = np.clip((n * (bound.var / 2.0) / mean_one - 1.0) / np.maximum(n - 1, 1), 0.0, 1.0)
        rho = np.where(np.isfinite(rho), rho, 1.0)
        return 1.0 + np.maximum(n - 1, 0) * rho**2


def _noisy_df(bound: Prior, ratio: np.ndarray, ratio_df: np.ndarray) -> np.ndarray:
    """The df the horizontal bound is calibrated with when the challenger spreads more than the lab
    (`ratio` > 1): the bound is then one lab arm's spread plus `ratio` times it, and the second term
    is only as sure as the challenger's own runs (`ratio_df`, after `_spread_overlap`): Satterthwaite's
    df for the sum, (1 + R)² ÷ (1/df_lab + R²/df_R). Where the challenger is no noisier, the lab's df."""
    with np.errstate(invalid="ignore", divide="ignore"):
        r = np.where(np.isfinite(ratio), ratio, 0.0)
        sat = (1.0 + r) ** 2 / (1.0 / np.maximum(bound.df, 1) + r**2 / np.maximum(ratio_df, 1e-9))
        df = np.where((r > 1.0) & (bound.df > 0), np.minimum(bound.df, np.floor(sat)), bound.df)
    return np.maximum(df, 0).astype(int)


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


@dataclass(frozen=True)
class LookData:
    """One look's runs as arrays, oriented: `base` (tasks, n) and `chal` (tasks, m) by seed, `hist`
    extra baseline-commit runs (tasks, h) or None, the lab's earlier comparisons' paired differences
    `pair_history` (tasks, comparisons, seeds) and earlier arms `arm_history` (arms, tasks, seeds)
    (None: none), the horizontal trim."""

    base: np.ndarray
    chal: np.ndarray
    hist: np.ndarray | None
    pair_history: np.ndarray | None
    arm_history: np.ndarray | None
    trim: float


@dataclass(frozen=True)
class LookTests:
    """A look's tests as a protocol computes them (`GateProtocol.look_tests`), arrays (tasks,) or (...)."""

    base_arm: Arm
    chal_arm: Arm
    scale: np.ndarray  # σ_task
    scale_df: np.ndarray
    hb: np.ndarray  # the baseline's per-seed horizontal values
    hc: np.ndarray  # the challenger's
    test: TwoSample  # per task
    prior: Prior | None  # per task: the variance prior (its df and weight feed the boundaries)
    h: TwoSample  # horizontal: what the boundaries judge
    h_futility: TwoSample  # horizontal: what the futility rule judges
    h_breadth: TwoSample | None  # horizontal with the most-improved task left out (None: one task)
    h_values: np.ndarray  # (seeds,) what the horizontal test stands on
    task_values: np.ndarray  # (tasks, seeds) what each task's test stands on
    counts: np.ndarray  # (tasks,) challenger runs, or pairs, each task's test stands on
    pairs_dropped: np.ndarray  # (tasks,) challenger runs left out (no baseline result on their seed)
    top: int  # the most-improved task
    stands_out: bool  # ... and whether it stands out (then the breadth check must hold)
    h_prior: Prior | None  # the horizontal boundaries' prior (the unpaired bound), or None
    noisier: tuple[np.ndarray, np.ndarray] | None  # the paired protocol's (ratio, F p): `PairedTests.noisier`


def two_sample_tests(d: LookData, moderated: bool) -> LookTests:
    """Pooled t per task (its variance moderated by the baseline's history where `moderated`), the
    horizontal pooled t on the arms' per-seed values; the lab's earlier comparisons are not used."""
    base_arm, chal_arm = summarize(d.base), summarize(d.chal)
    hist_arm = summarize(d.hist) if d.hist is not None else None
    scale, scale_df = task_scale(base_arm, hist_arm)
    hb, hc = horizontal_values(d.base, d.chal, base_arm.mean, scale, d.trim)
    prior = history_prior(d.hist, base_arm.mean.shape) if moderated else None
    test = pooled_t(base_arm, chal_arm, prior)
    top_arr, stands_out = most_improved(test.delta, scale)
    top = int(top_arr)
    h = two_sample_horizontal(hb, hc)
    breadth = None
    if d.base.shape[0] > 1:
        bb, bc = horizontal_values(without_task(d.base, top), without_task(d.chal, top), base_arm.mean, scale, d.trim)
        breadth = two_sample_horizontal(bb, bc)
    return LookTests(base_arm=base_arm, chal_arm=chal_arm, scale=scale, scale_df=scale_df, hb=hb, hc=hc, test=test,
                     prior=prior, h=h, h_futility=h, h_breadth=breadth, h_values=hc, task_values=d.chal,
                     counts=chal_arm.count, pairs_dropped=np.zeros(d.base.shape[0], dtype=int), top=top,
                     stands_out=bool(stands_out), h_prior=None, noisier=None)


def paired_look_tests(d: LookData) -> LookTests:
    """The paired t on d_k = challenger_k − baseline_k per task and across tasks (`paired_tests`),
    σ_task borrowing the earlier arms' spread (a lazy baseline has 2 seeds at its first look)."""
    base_arm, chal_arm = summarize(d.base), summarize(d.chal)
    hist_arm = summarize(d.hist) if d.hist is not None else None
    arms = d.arm_history
    scale, scale_df = task_scale(base_arm, hist_arm, arms)
    hb, hc = horizontal_values(d.base, d.chal, base_arm.mean, scale, d.trim)
    pt = paired_tests(d.base, d.chal, scale, hb, d.trim, d.pair_history, arms, d.hist)
    counts = np.isfinite(pt.d).sum(axis=-1)
    top_arr, stands_out = most_improved(pt.test.delta, scale)
    top = int(top_arr)
    breadth = None
    if d.base.shape[0] > 1:
        breadth = paired_tests(without_task(d.base, top), without_task(d.chal, top), scale, hb, d.trim, None,
                               arms_without_task(arms, top), without_task(d.hist, top) if d.hist is not None else None).h
    return LookTests(base_arm=base_arm, chal_arm=chal_arm, scale=scale, scale_df=scale_df, hb=hb, hc=hc,
                     test=pt.test, prior=pt.prior, h=pt.h, h_futility=pt.h_futility, h_breadth=breadth,
                     h_values=pt.hd, task_values=pt.d, counts=counts, pairs_dropped=chal_arm.count - counts,
                     top=top, stands_out=bool(stands_out), h_prior=pt.bound, noisier=pt.noisier)
