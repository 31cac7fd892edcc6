"""Group-sequential boundaries: Lan-DeMets spending, O'Brien-Fleming shape for the pooled t, Pocock
shape for the paired t (`PAIRED_SPENDING`).

Why: the fixed protocol re-tests the same hypothesis at 2, 5 and 10 challenger runs at the full
α each time, so noise gets several chances to look like an improvement. Spending α over the
looks keeps the chance of ever crossing the improvement boundary at α.

- Information at a look with n baseline and m challenger runs is 1/(1/n + 1/m) (the inverse
  variance of the difference of means, in σ² units); the fraction is relative to the planned
  final look (or to the current look if it runs past the plan, which then spends all of α).
- Lan-DeMets O'Brien-Fleming spending: α(t) = 2·(1 - Φ(z_{1-α/2} / √t)). Little α goes to early
  looks, where two challenger runs carry little information, and almost all of it to the last.
- Calibration on the t scale: the statistics are Student t with few degrees of freedom and share
  a variance estimate, so the usual normal-theory boundaries are off. We draw the exact joint null
  distribution of the look statistics by Monte Carlo from their sufficient statistics (arm means
  and sums of squares, block by block, plus the moderated-variance prior), reflect it (the null is
  symmetric, which halves the error), and set each boundary so that the crossing probability at
  that look, among paths not yet stopped, equals the α spent there. A fixed RNG seed makes the
  boundaries reproducible; `functools.lru_cache` makes repeated calls free. A look at an unplanned
  run count is just another schedule: the boundaries are recomputed from the spending function.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from scipy import stats

from pipeline.gate.stats import bound_weight

CALIBRATION_SIMS = 1_000_000  # null paths (doubled by reflection): α's MC error ≈ sqrt(α/2e6) ≈ 1e-4
CALIBRATION_SEED = 20_240_611


@dataclass(frozen=True)
class Boundaries:
    """Upper (improvement-side) boundaries on the t scale; the harm side is their mirror image.

    `looks` are the challenger run counts of the schedule, `fractions` their information fractions,
    `spent` the cumulative α after each look, `upper` the t boundaries, `df` each look's degrees of
    freedom and `nominal` the one-sided nominal p-value level each boundary amounts to.
    """

    looks: tuple[int, ...]
    fractions: tuple[float, ...]
    spent: tuple[float, ...]
    upper: tuple[float, ...]
    df: tuple[float, ...]
    nominal: tuple[float, ...]

    @property
    def increments(self) -> tuple[float, ...]:
        """α spent at each look (the spending function's increments)."""
        prev = (0.0,) + self.spent[:-1]
        return tuple(s - p for s, p in zip(self.spent, prev))


def obf_spending(t: np.ndarray | float, alpha: float) -> np.ndarray:
    """Cumulative one-sided α spent by information fraction t (Lan-DeMets, O'Brien-Fleming shape)."""
    t = np.clip(np.asarray(t, dtype=float), 1e-12, 1.0)
    z = stats.norm.isf(alpha / 2)
    return 2.0 * stats.norm.sf(z / np.sqrt(t))


def pocock_spending(t: np.ndarray | float, alpha: float) -> np.ndarray:
    """Cumulative one-sided α spent by information fraction t (Lan-DeMets, Pocock shape): α·ln(1 + (e - 1)·t).
    It spends early looks far more than O'Brien-Fleming does, so a clear effect stops early."""
    t = np.clip(np.asarray(t, dtype=float), 0.0, 1.0)
    return alpha * np.log1p((math.e - 1.0) * t)


def power_spending(t: np.ndarray | float, alpha: float, gamma: float) -> np.ndarray:
    """Cumulative one-sided α spent by information fraction t, power family (Kim-DeMets): α·t^γ."""
    t = np.clip(np.asarray(t, dtype=float), 0.0, 1.0)
    return alpha * t**gamma


SPENDING = ("obf", "pocock", "power1", "power1.5", "power2")


def spending(kind: str, t: np.ndarray | float, alpha: float) -> np.ndarray:
    """Cumulative α spent by fraction t under a named spending function (`[gate] spending`)."""
    if kind == "obf":
        return obf_spending(t, alpha)
    if kind == "pocock":
        return pocock_spending(t, alpha)
    if kind.startswith("power"):
        return power_spending(t, alpha, float(kind.removeprefix("power")))
    raise ValueError(f"unknown spending function {kind!r}; expected one of {', '.join(SPENDING)}")


PAIRED_SPENDING = "pocock"  # the paired protocol spends early: a clear effect stops at 1-2 pairs


def information(n_baseline: float, n_challenger: float) -> float:
    """Statistical information of the mean difference, in units of 1/σ²."""
    return 1.0 / (1.0 / n_baseline + 1.0 / n_challenger)


def information_fractions(n_baseline: int, looks: tuple[int, ...], planned_max: int) -> np.ndarray:
    """Fractions of the final information reached at each look (the final look is max(plan, last look))."""
    final = information(n_baseline, max(planned_max, looks[-1]))
    return np.array([information(n_baseline, m) / final for m in looks])


def degrees_of_freedom(n_baseline: int, n_challenger: int, prior_weight: float) -> float:
    """df of the moderated pooled variance: the prior's weight plus both arms' within-arm df."""
    return prior_weight + (n_baseline - 1) + (n_challenger - 1)


def normalize_schedule(looks: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """Looks that add information: positive, strictly increasing run counts (repeats dropped).

    A look at which failed runs added nothing is the same statistic as the one before it and
    spends nothing new, so it is dropped rather than spending α twice on one number.
    """
    out: list[int] = []
    for m in looks:
        if m >= 1 and (not out or m > out[-1]):
            out.append(int(m))
    if not out:
        raise ValueError("a schedule needs at least one look with one run or more")
    return tuple(out)


def null_t_paths(
    n_baseline: int,
    looks: tuple[int, ...],
    prior_df: int,
    prior_weight: float,
    sims: int,
    seed: int,
) -> np.ndarray:
    """Exact draws of the look statistics under the null (σ = 1), shape (sims, len(looks)).

    Built from sufficient statistics so the cost does not grow with the run counts: the baseline
    mean and sum of squares, then per block of new challenger runs its mean and within-block sum
    of squares, merged into the running challenger sum of squares; the prior variance is an
    independent χ²_{prior_df}/prior_df entering with weight `prior_weight` (≤ prior_df: the cap).
    """
    rng = np.random.default_rng(seed)
    n = n_baseline
    xbar = rng.standard_normal(sims) / math.sqrt(n)
    ss = rng.chisquare(n - 1, sims) if n > 1 else np.zeros(sims)
    if prior_df > 0 and prior_weight > 0:
        ss = ss + prior_weight * rng.chisquare(prior_df, sims) / prior_df
    out = np.empty((sims, len(looks)))
    for k, (m, ybar, ss_c) in enumerate(_running_blocks(rng, looks, sims)):
        df = degrees_of_freedom(n, m, prior_weight)
        var = (ss + ss_c) / df
        out[:, k] = (ybar - xbar) / np.sqrt(var * (1.0 / n + 1.0 / m))
    return out


def _running_blocks(rng: np.random.Generator, looks: tuple[int, ...],
                    sims: int) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Per look (m runs so far): (m, mean, within sum of squares) of m unit-normal draws, drawn block
    by block from sufficient statistics (the new block's mean and sum of squares, merged)."""
    m_prev, mean, ss = 0, np.zeros(sims), np.zeros(sims)
    for m in looks:
        r = m - m_prev
        block_mean = rng.standard_normal(sims) / math.sqrt(r)
        block_ss = rng.chisquare(r - 1, sims) if r > 1 else 0.0
        if m_prev:
            ss = ss + block_ss + (m_prev * r / m) * (mean - block_mean) ** 2
            mean = (m_prev * mean + r * block_mean) / m
        else:
            ss, mean = ss + block_ss, block_mean
        yield m, mean, ss
        m_prev = m


def calibrate(paths: np.ndarray, increments: np.ndarray, usable: np.ndarray | None = None) -> np.ndarray:
    """Upper boundaries such that the first-crossing probability at look k equals increments[k].

    Works on the reflected sample (paths and -paths, equally likely under a symmetric null). A look
    that is not `usable` (no statistic there) gets +inf and stops no path.
    """
    sample = np.concatenate([paths, -paths])
    total = sample.shape[0]
    alive = np.ones(total, dtype=bool)
    upper = np.empty(sample.shape[1])
    for k in range(sample.shape[1]):
        if usable is not None and not usable[k]:
            upper[k] = np.inf
            continue
        vals = sample[alive, k]
        want = increments[k] * total  # how many paths should first cross here
        count = int(round(want))
        if count <= 0 or vals.size == 0:
            upper[k] = np.inf if vals.size == 0 else float(vals.max()) + 1e-9
        elif count >= vals.size:
            upper[k] = float(vals.min())
        else:
            # midpoint between the count-th and (count+1)-th largest values
            part = np.partition(vals, [vals.size - count - 1, vals.size - count])
            upper[k] = 0.5 * (part[vals.size - count - 1] + part[vals.size - count])
        alive &= sample[:, k] < upper[k]
    return upper


@lru_cache(maxsize=512)
def sequential_boundaries(
    n_baseline: int,
    looks: tuple[int, ...],
    planned_max: int,
    alpha: float,
    prior_df: int = 0,
    prior_weight: float = 0.0,
    sims: int = CALIBRATION_SIMS,
    seed: int = CALIBRATION_SEED,
) -> Boundaries:
    """Spending boundaries for the looks actually taken (`looks`), on the t scale, cached.

    `planned_max` is the final planned look; `prior_df`/`prior_weight` describe the moderated
    variance's prior (its runs' df and the weight it gets, capped by the caller at 30).
    """
    if n_baseline < 2 and prior_weight <= 0 and looks[-1] < 2:
        raise ValueError("no degrees of freedom for a variance")
    looks = normalize_schedule(looks)
    fractions = information_fractions(n_baseline, looks, planned_max)
    spent = obf_spending(fractions, alpha)
    if looks[-1] >= planned_max:
        spent[-1] = alpha  # the final look spends whatever is left
    increments = np.diff(np.concatenate([[0.0], spent]))
    paths = null_t_paths(n_baseline, looks, prior_df, prior_weight, sims, seed)
    upper = calibrate(paths, increments)
    dfs = tuple(degrees_of_freedom(n_baseline, m, prior_weight) for m in looks)
    nominal = tuple(float(stats.t.sf(u, df)) for u, df in zip(upper, dfs))
    return Boundaries(
        looks=looks,
        fractions=tuple(float(f) for f in fractions),
        spent=tuple(float(s) for s in spent),
        upper=tuple(float(u) for u in upper),
        df=dfs,
        nominal=nominal,
    )


def fixed_boundaries(
    n_baseline: int, looks: tuple[int, ...], alpha: float, prior_weight: float = 0.0
) -> Boundaries:
    """The fixed protocol's boundaries: the nominal one-sided α quantile at every look (re-testing).

    "Spent" is reported as the nominal α at each look; the true cumulative rate is higher, which
    is the inflation that `gate-sim` measures.
    """
    looks = normalize_schedule(looks)
    dfs = tuple(degrees_of_freedom(n_baseline, m, prior_weight) for m in looks)
    upper = tuple(float(stats.t.isf(alpha, df)) for df in dfs)
    return Boundaries(
        looks=looks,
        fractions=tuple(1.0 for _ in looks),
        spent=tuple(alpha for _ in looks),
        upper=upper,
        df=dfs,
        nominal=tuple(alpha for _ in looks),
    )


# ---------------------------------------------------------------- the paired protocol's boundaries


MIN_DECIDING_PAIRS = 2  # a paired test decides (crosses a boundary) from this many pairs on


def paired_df(n_pairs: int, prior_weight: float) -> float:
    """df of a paired (one-sample) t on `n_pairs` differences whose variance is moderated by a prior
    of weight `prior_weight`: the prior's weight plus the pairs' own n - 1."""
    return prior_weight + max(n_pairs - 1, 0)


def null_paired_paths(looks: tuple[int, ...], prior_df: int, sims: int, seed: int) -> np.ndarray:
    """Exact draws of a paired t at each look under the null (σ_d = 1), shape (sims, len(looks)).

    From sufficient statistics, block by block: the running mean and within-sum of squares of the
    differences, plus the unpaired bound's χ²_{prior_df}/prior_df entering with weight
    `stats.bound_weight(prior_df, m)` at m pairs, at the truth (pair correlation 0: the worst case).
    A look with no df (one pair, no prior) is -inf: it can never cross.
    """
    rng = np.random.default_rng(seed)
    prior_var = rng.chisquare(prior_df, sims) / prior_df if prior_df > 0 else np.zeros(sims)
    out = np.empty((sims, len(looks)))
    for k, (m, mean, ss) in enumerate(_running_blocks(rng, looks, sims)):
        w = float(bound_weight(prior_df, m)) if prior_df > 0 else 0.0
        df = paired_df(m, w)
        out[:, k] = mean / np.sqrt((w * prior_var + ss) / df / m) if df >= 1 else -np.inf
    return out


EXACT_PRIOR_DF = 128  # prior df up to this are calibrated as they are; above, on a grid (calibration_df)


def calibration_df(prior_df: int) -> int:
    """The prior df a paired boundary is calibrated at: `prior_df` itself up to EXACT_PRIOR_DF, above
    it the largest point of the grid 128 · 2^(k/4) not above it (steps of 19 %). The lab's history
    grows by every comparison, so without a grid nearly every look would miss the cache and pay a
    calibration of CALIBRATION_SIMS paths; rounding down is conservative (fewer df: heavier tails,
    a higher boundary), and at 128 df and more the boundary moves by less than 0.01 on the t scale."""
    if prior_df <= EXACT_PRIOR_DF:
        return int(prior_df)
    k = math.floor(4 * math.log2(prior_df / EXACT_PRIOR_DF) + 1e-9)
    return int(math.floor(EXACT_PRIOR_DF * 2 ** (k / 4)))


@lru_cache(maxsize=512)
def paired_boundaries(
    looks: tuple[int, ...],
    planned_max: int,
    alpha: float,
    prior_df: int = 0,
    sims: int = CALIBRATION_SIMS,
    seed: int = CALIBRATION_SEED,
) -> Boundaries:
    """Lan-DeMets boundaries (`PAIRED_SPENDING`) for a paired t moderated by the unpaired bound of
    `prior_df` df, calibrated on the t scale, cached.

    The information of m pairs is m / σ_d², so a look's fraction is m / max(plan, m). A look with
    no df spends nothing (its boundary is +inf); what it would have spent goes to the next look.
    """
    looks = normalize_schedule(looks)
    final = max(planned_max, looks[-1])
    fractions = np.array([m / final for m in looks], dtype=float)
    spent = spending(PAIRED_SPENDING, fractions, alpha)
    if looks[-1] >= planned_max:
        spent[-1] = alpha
    dfs = tuple(paired_df(m, float(bound_weight(prior_df, m)) if prior_df > 0 else 0.0) for m in looks)
    # one pair never decides a test (the challenger's own spread is unknown there, and a branch can
    # make itself noisier): a look at one pair spends nothing and can only stop for futility
    usable = np.array([df >= 1 and m >= MIN_DECIDING_PAIRS for df, m in zip(dfs, looks)])
    spent = np.where(usable, spent, 0.0)
    spent = np.maximum.accumulate(spent)
    increments = np.diff(np.concatenate([[0.0], spent]))
    paths = null_paired_paths(looks, prior_df, sims, seed)
    upper = calibrate(np.where(np.isfinite(paths), paths, np.nan), increments, usable)
    nominal = tuple(float(stats.t.sf(u, df)) if df >= 1 else 0.0 for u, df in zip(upper, dfs))
    return Boundaries(
        looks=looks,
        fractions=tuple(float(f) for f in fractions),
        spent=tuple(float(s) for s in spent),
        upper=tuple(float(u) for u in upper),
        df=dfs,
        nominal=nominal,
    )
