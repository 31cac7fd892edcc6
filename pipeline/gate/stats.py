"""Vectorised statistics shared by `evaluate` (one hypothesis) and `sim` (hundreds of thousands).

Every function works on arrays with any leading batch shape and NaN for a missing run (a failed
or not-yet-run seed), so the simulator exercises exactly the code that judges real hypotheses.
Conventions: the last axis is seeds; for per-task arrays the axis before it is tasks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats

PRIOR_DF_CAP = 30  # the baseline history can weigh at most as much as 30 df (the README's "The gate")
HORIZONTAL_TRIM = 0.125  # the horizontal statistic drops this share of tasks at each end (0.25: the IQM)


@dataclass(frozen=True)
class Arm:
    """Sufficient statistics of one arm along the seed axis: run count, mean, sum of squares."""

    count: np.ndarray
    mean: np.ndarray
    ss: np.ndarray

    @property
    def var(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.count > 1, self.ss / np.maximum(self.count - 1, 1), np.nan)


def summarize(x: np.ndarray) -> Arm:
    """Count, mean and sum of squares over the last axis, ignoring NaN (failed or missing runs)."""
    ok = np.isfinite(x)
    count = ok.sum(axis=-1)
    filled = np.where(ok, x, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = filled.sum(axis=-1) / count
    dev = np.where(ok, x - mean[..., None], 0.0)
    return Arm(count=count, mean=mean, ss=(dev * dev).sum(axis=-1))


@dataclass(frozen=True)
class Prior:
    """The moderated variance's prior from the baseline history: its variance, raw df and weight."""

    var: np.ndarray
    df: np.ndarray
    weight: np.ndarray


def history_prior(history: np.ndarray | None, shape: tuple[int, ...]) -> Prior:
    """Prior variance from extra runs of the baseline commit (NaN-padded), weight capped at 30 df.

    Capping the weight of a variance estimated with more df than 30 is conservative: the real
    estimate is less variable than the χ²_30/30 the test assumes.
    """
    if history is None or history.shape[-1] == 0:
        zero = np.zeros(shape)
        return Prior(var=zero, df=zero.astype(int), weight=zero)
    arm = summarize(history)
    df = np.maximum(arm.count - 1, 0)
    var = np.where(df > 0, arm.ss / np.maximum(df, 1), 0.0)
    return Prior(var=var, df=df, weight=np.minimum(df, PRIOR_DF_CAP).astype(float))


@dataclass(frozen=True)
class TwoSample:
    """A two-sample comparison: Δ = challenger - baseline, its SE, df and t = Δ / SE."""

    delta: np.ndarray
    se: np.ndarray
    df: np.ndarray
    t: np.ndarray


def pooled_t(base: Arm, chal: Arm, prior: Prior | None = None) -> TwoSample:
    """Student pooled t with a moderated variance: prior weight·prior var + both arms' sums of squares.

    With no prior this is the textbook pooled two-sample t of the reference post.
    """
    ss = base.ss + chal.ss
    df = np.maximum(base.count - 1.0, 0.0) + np.maximum(chal.count - 1.0, 0.0)
    if prior is not None:
        ss = ss + prior.weight * prior.var
        df = df + prior.weight
    df = np.where((base.count > 0) & (chal.count > 0), df, np.nan)  # an empty arm: no test
    with np.errstate(invalid="ignore", divide="ignore"):
        var = np.where(df > 0, ss / np.where(df > 0, df, 1.0), np.nan)
        se = np.sqrt(var * (1.0 / base.count + 1.0 / chal.count))
        delta = chal.mean - base.mean
        t = np.where(se > 0, delta / np.where(se > 0, se, 1.0), np.where(delta == 0, 0.0, np.sign(delta) * np.inf))
    return TwoSample(delta=delta, se=se, df=df, t=t)


def welch_t(base: Arm, chal: Arm) -> TwoSample:
    """Welch's unequal-variance t (Satterthwaite df): shown beside the pooled t for unstable challengers."""
    with np.errstate(invalid="ignore", divide="ignore"):
        vb, vc = base.var / base.count, chal.var / chal.count
        se = np.sqrt(vb + vc)
        df = (vb + vc) ** 2 / (vb**2 / (base.count - 1) + vc**2 / (chal.count - 1))
        delta = chal.mean - base.mean
        t = delta / se
    return TwoSample(delta=delta, se=se, df=df, t=t)


def variance_ratio_p(base_var: np.ndarray, base_df: np.ndarray, chal: Arm) -> np.ndarray:
    """One-sided F-test p-value for challenger variance > baseline variance (NaN when undefined)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        f = chal.var / base_var
        p = stats.f.sf(f, chal.count - 1, base_df)
    return np.where((chal.count > 1) & (base_df > 0) & (base_var > 0), p, np.nan)


def trimmed_mean(x: np.ndarray, axis: int = -1, trim: float = HORIZONTAL_TRIM) -> np.ndarray:
    """Trimmed mean along `axis` (`trim` of the values dropped at each end), ignoring NaN, with
    fractional weights at the cut points.

    Each of the c sorted values owns the slice [i/c, (i+1)/c] of the distribution and gets weight
    equal to its overlap with [trim, 1 - trim] (normalised). With trim 0.125 and 8 tasks the
    largest and smallest values get zero weight, so one task that moves hugely cannot move the
    horizontal statistic much; trim 0.25 is the interquartile mean, trim 0 the plain mean.
    """
    if not 0.0 <= trim < 0.5:
        raise ValueError(f"trim must be in [0, 0.5), got {trim}")
    x = np.moveaxis(np.asarray(x, dtype=float), axis, -1)
    srt = np.sort(x, axis=-1)  # NaN sorts last
    count = np.isfinite(srt).sum(axis=-1, keepdims=True)
    i = np.arange(srt.shape[-1])
    with np.errstate(invalid="ignore", divide="ignore"):
        lo = np.maximum(i / count, trim)
        hi = np.minimum((i + 1) / count, 1.0 - trim)
        w = np.clip(hi - lo, 0.0, None) / (1.0 - 2.0 * trim)
        w = np.where(i < count, w, 0.0)
        out = (np.where(w > 0, srt, 0.0) * w).sum(axis=-1)
    return np.where(count[..., 0] > 0, out, np.nan)



def horizontal_values(
    base: np.ndarray, chal: np.ndarray, center: np.ndarray, scale: np.ndarray, trim: float = HORIZONTAL_TRIM
) -> tuple[np.ndarray, np.ndarray]:
    """Per-seed horizontal values: trimmed mean over tasks of (metric - task's baseline level) / σ_task.

    `base` is (..., tasks, n), `chal` (..., tasks, m), `center` and `scale` (..., tasks) come from
    the baseline only, so a seed's value never changes as the challenger adds runs: the sequential
    test then sees one fixed number per seed. Centering removes the tasks' different levels (AUC
    0.6 vs 0.9), which otherwise decide who gets trimmed; a task with no usable scale is NaN.
    Returns the (..., n) baseline and (..., m) challenger per-seed values; the caller passes data
    oriented so that higher is better.
    """
    with np.errstate(invalid="ignore", divide="ignore"):
        good = np.isfinite(scale) & (scale > 0)
        s = np.where(good, scale, np.nan)[..., None]
        c = center[..., None]
        hb = trimmed_mean((base - c) / s, axis=-2, trim=trim)
        hc = trimmed_mean((chal - c) / s, axis=-2, trim=trim)
    return hb, hc


def without_task(x: np.ndarray, task: np.ndarray) -> np.ndarray:
    """Copy of a (..., tasks, seeds) array with one task per batch element set to NaN."""
    out = np.array(x, dtype=float, copy=True)
    mask = np.arange(x.shape[-2]) == np.asarray(task)[..., None]
    out[mask] = np.nan
    return out


def arms_without_task(arms: np.ndarray | None, task: np.ndarray) -> np.ndarray | None:
    """Copy of a (..., arms, tasks, seeds) array with one task per batch element (...) set to NaN."""
    if arms is None:
        return None
    mask = np.arange(arms.shape[-2]) == np.asarray(task)[..., None]  # (..., tasks)
    return np.where(mask[..., None, :, None], np.nan, arms)


def bh_qvalues(p: np.ndarray, axis: int = -1) -> np.ndarray:
    """Benjamini-Hochberg adjusted p-values (q-values) along `axis`; NaN p-values are left out."""
    p = np.moveaxis(np.asarray(p, dtype=float), axis, -1)
    order = np.argsort(p, axis=-1)  # NaN last
    srt = np.take_along_axis(p, order, axis=-1)
    count = np.isfinite(srt).sum(axis=-1, keepdims=True)
    rank = np.arange(1, p.shape[-1] + 1)
    with np.errstate(invalid="ignore"):
        scaled = np.where(rank <= count, srt * count / rank, np.inf)
    q = np.minimum.accumulate(scaled[..., ::-1], axis=-1)[..., ::-1]
    q = np.where(rank <= count, np.minimum(q, 1.0), np.nan)
    out = np.empty_like(q)
    np.put_along_axis(out, order, q, axis=-1)
    return np.moveaxis(out, -1, axis)


def one_sided_p(t: np.ndarray, df: np.ndarray) -> np.ndarray:
    """P(T ≥ t) under the null: the improvement-side p-value (t oriented so that + is better)."""
    with np.errstate(invalid="ignore"):
        return np.where(np.isfinite(df) & (df > 0), stats.t.sf(t, np.where(df > 0, df, 1)), np.nan)


def sequential_p(p_one: np.ndarray, nominal: np.ndarray, alpha: float) -> np.ndarray:
    """Boundary-scaled p-value: p·α / (the boundary's nominal level), capped at 1.

    It is ≤ α exactly when the boundary is crossed, so per-task BH works on the same evidence
    scale as the sequential test; at a fixed-sample look (nominal = α) it is the ordinary p.
    """
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.minimum(1.0, p_one * alpha / nominal)


# ---------------------------------------------------------------- paired differences (protocol `paired`)

PAIRED_PRIOR_DF_CAP = 20  # the lab's history of paired differences weighs at most as much as 20 df
MAX_PAIR_RHO = 0.99  # a paired variance is never taken below 2·(1 - 0.99)·σ²: numerical noise is no gain


def paired_t(d: np.ndarray, prior: Prior | None = None, floor: np.ndarray | float = 0.0) -> TwoSample:
    """One-sample t on paired differences d (..., pairs), NaN where a seed has no pair.

    The variance is the pairs' own sum of squares plus the prior's weight·var (a moderated variance,
    as in `pooled_t`), never below `floor`. With no pair there is no test; with one pair and no
    prior there is a Δ but no variance (df 0, t NaN).
    """
    arm = summarize(d)
    ss, df = arm.ss, np.maximum(arm.count - 1.0, 0.0)
    if prior is not None:
        ss = ss + prior.weight * prior.var
        df = df + prior.weight
    df = np.where(arm.count > 0, df, np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        var = np.where(df > 0, ss / np.where(df > 0, df, 1.0), np.nan)
        var = np.where(np.isfinite(var), np.maximum(var, floor), np.nan)
        se = np.sqrt(var / arm.count)
        delta = arm.mean
        t = np.where(se > 0, delta / np.where(se > 0, se, 1.0), np.where(delta == 0, 0.0, np.sign(delta) * np.inf))
        t = np.where(np.isfinite(se), t, np.nan)
    return TwoSample(delta=delta, se=se, df=df, t=t)


def pair_prior(d_history: np.ndarray | None, shape: tuple[int, ...]) -> Prior:
    """The lab's history of paired differences as a variance prior: `d_history` (..., comparisons,
    pairs) NaN-padded, each earlier comparison centred on its own mean (its true effect is not
    noise), pooled; weight capped at PAIRED_PRIOR_DF_CAP. `shape` is the prior's shape without it."""
    if d_history is None or d_history.shape[-1] == 0 or d_history.shape[-2] == 0:
        zero = np.zeros(shape)
        return Prior(var=zero, df=zero.astype(int), weight=zero)
    arm = summarize(d_history)  # per comparison
    df = np.maximum(arm.count - 1, 0).sum(axis=-1)
    ss = np.where(arm.count > 1, arm.ss, 0.0).sum(axis=-1)
    var = np.where(df > 0, ss / np.maximum(df, 1), 0.0)
    return Prior(var=var, df=df.astype(int), weight=np.minimum(df, PAIRED_PRIOR_DF_CAP).astype(float))


def spread_ratio_p(base: np.ndarray, chal: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Seeds must vary: the challenger's per-seed spread over the baseline's (variance ratio) and its
    lower-tail F-test p-value, along the last axis (NaN = no run). A ratio of 0 (every seed gives
    the same value) while the baseline varies has p = 0; undefined (NaN) with fewer than 2 runs a
    side or a baseline that does not vary either."""
    b, c = summarize(base), summarize(chal)
    with np.errstate(invalid="ignore", divide="ignore"):
        # a spread at the level of floating-point rounding (one draw repeated, summed in another
        # order) is no spread: it reads as exactly 0
        noise = 1e-20 * (b.var + c.mean * c.mean)
        ratio = np.where(c.var <= noise, 0.0, c.var / b.var)
        p = stats.f.cdf(ratio, c.count - 1, b.count - 1)
    ok = (c.count > 1) & (b.count > 1) & (b.var > 0)
    return np.where(ok, ratio, np.nan), np.where(ok, p, np.nan)


def paired_horizontal(d: np.ndarray, scale: np.ndarray, trim: float = HORIZONTAL_TRIM) -> np.ndarray:
    """Per-seed horizontal paired differences: the trimmed mean over tasks of d_k / σ_task.

    `d` is (..., tasks, pairs) with NaN where a task's seed has no pair, `scale` (..., tasks) from
    the baseline only; returns (..., pairs)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        good = np.isfinite(scale) & (scale > 0)
        s = np.where(good, scale, np.nan)[..., None]
        return trimmed_mean(d / s, axis=-2, trim=trim)


PAIRED_BOUND_WEIGHT = 20  # the unpaired bound weighs at most 20 df at one pair, 20/m at m pairs


def bound_weight(df: np.ndarray | float, pairs: np.ndarray | float) -> np.ndarray:
    """The unpaired bound's weight at a look of `pairs` pairs, from the df it was estimated with:
    ⌈PAIRED_BOUND_WEIGHT / pairs⌉, at most its df. It carries a look with one pair (which has no
    variance of its own) and gives way as the pairs' own variance, the paired gain, accumulates."""
    return np.minimum(np.asarray(df, dtype=float), np.ceil(PAIRED_BOUND_WEIGHT / np.maximum(pairs, 1)))


def bound_priors(arms: np.ndarray | None, scale: np.ndarray, trim: float, task_pairs: np.ndarray,
                 h_pairs: np.ndarray) -> tuple[Prior, Prior]:
    """The unpaired bound on the variance of the paired differences, as priors: (per task, horizontal).

    `arms` (..., arms, tasks, seeds): runs of earlier arms (commits other than this comparison's,
    NaN-padded, oriented); `scale` (..., tasks) the current σ_task. Each arm is centred on its own
    task means. Per task, the arms' pooled within-arm variance V_j estimates one arm's seed spread;
    for the horizontal, V_h is the pooled within-arm variance of an arm's per-seed trimmed means of
    runs / σ_task. Whatever the pair correlation in [0, 1), a paired difference varies no more than
    two independent arms do (Var(c - b) = Var c + Var b - 2 Cov ≤ 2 V for equal variances and
    Cov ≥ 0), so 2·V is the prior: a paired t moderated by it, with boundaries calibrated as if the
    bound were the truth (pair correlation 0), keeps its error rate for any pairing, and the pairs'
    own variance takes over as they accumulate (`bound_weight` at the look's pairs: `task_pairs`
    (..., tasks), `h_pairs` (...)). `df` is what the
    boundaries are calibrated with: the estimate's df, at most PAIRED_BOUND_WEIGHT (fewer df than it
    has: conservative). The task prior has shape (..., tasks), the horizontal one (...).
    """
    shape = np.shape(scale)
    if arms is None or arms.shape[-1] == 0 or arms.shape[-3] == 0:
        zt, zh = np.zeros(shape), np.zeros(np.shape(h_pairs))
        return (Prior(var=zt, df=zt.astype(int), weight=zt), Prior(var=zh, df=zh.astype(int), weight=zh))
    ok = np.isfinite(arms)
    with np.errstate(invalid="ignore", divide="ignore"):
        count = ok.sum(axis=-1, keepdims=True)
        mean = np.where(ok, arms, 0.0).sum(axis=-1, keepdims=True) / np.maximum(count, 1)
        centred = np.where(ok, arms - mean, np.nan)
        good = np.isfinite(scale) & (scale > 0)
        s = np.where(good, scale, np.nan)[..., None, :, None]
        z = centred / s
        # a seed counts only where every task the arm measured has a run there (a trimmed mean over
        # the same tasks at every seed); a task left out (NaN throughout, or no σ) is left out of all
        present = np.isfinite(z).any(axis=-1, keepdims=True)
        complete = (np.isfinite(z) | ~present).all(axis=-2, keepdims=True) & present.any(axis=-2, keepdims=True)
        h = trimmed_mean(np.where(complete, z, np.nan), axis=-2, trim=trim)  # (..., arms, seeds)

    def pooled(x: np.ndarray, pairs: np.ndarray) -> Prior:  # (..., arms, seeds) → 2 × pooled within-arm variance
        arm = summarize(x)
        df = np.maximum(arm.count - 1, 0).sum(axis=-1)
        ss = np.where(arm.count > 1, arm.ss, 0.0).sum(axis=-1)
        var = np.where(df > 0, 2.0 * ss / np.maximum(df, 1), 0.0)
        df = np.minimum(df, PAIRED_BOUND_WEIGHT)
        return Prior(var=var.astype(float), df=df.astype(int), weight=bound_weight(df, pairs))

    return pooled(np.moveaxis(centred, -3, -2), task_pairs), pooled(h, h_pairs)


def noisier_p(chal: np.ndarray, lab_var: np.ndarray, lab_df: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A challenger noisier than the lab: its per-seed spread (last axis, NaN = no run) over the lab's
    arms' spread `lab_var` (with `lab_df` df), and the upper-tail F-test p. NaN with fewer than 2
    runs, no lab spread or no lab df."""
    c = summarize(chal)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = c.var / lab_var
        p = stats.f.sf(ratio, np.maximum(c.count - 1, 1), np.maximum(lab_df, 1))
    ok = (c.count > 1) & (lab_var > 0) & (lab_df > 0)
    return np.where(ok, ratio, np.nan), np.where(ok, p, np.nan)
