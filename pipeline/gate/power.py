"""Power and minimum detectable effect (MDE) of the pooled two-sample Student t.

This is the planner behind `autoresearch power` and behind the gate's "MDE at the next look".
Under a true difference δ between arm means, the pooled t statistic follows a non-central t with
df = n + m - 2 and non-centrality δ / (σ·sqrt(1/n + 1/m)); power is the probability that it lands
beyond the critical value. With the reference post's σ ≈ 0.02 AUC and 5 baseline runs this gives
MDE ≈ 0.08 (2 challenger runs), ≈ 0.055 (5) and ≈ 0.045 (10) at 95 % power, α = 0.05 two-sided.

The functions take an explicit critical value where the gate needs one (a group-sequential
boundary on the t scale instead of the fixed-sample quantile), so the same code serves both.
"""

from __future__ import annotations

import math

from scipy import optimize, stats

from pipeline.errors import UserError

DEFAULT_POWER = 0.95


def _check(sigma: float, n_baseline: int, n_challenger: int, alpha: float | None = None) -> None:
    if not (isinstance(sigma, (int, float)) and math.isfinite(sigma) and sigma > 0):
        raise UserError(f"--sigma: expected a positive number, got {sigma!r}")
    if n_baseline < 1 or n_challenger < 1 or n_baseline + n_challenger < 3:
        raise UserError(
            f"--baseline/--challenger: expected at least 1 run per arm and 3 in all, "
            f"got {n_baseline} and {n_challenger}"
        )
    if alpha is not None and not (0 < alpha < 1):
        raise UserError(f"--alpha: expected a number in (0, 1), got {alpha!r}")


def standard_error(sigma: float, n_baseline: int, n_challenger: int) -> float:
    """SE of the difference of arm means when both arms share the per-run σ."""
    return sigma * math.sqrt(1.0 / n_baseline + 1.0 / n_challenger)


def critical_value(alpha: float, df: float, two_sided: bool) -> float:
    """Fixed-sample critical value of Student t: the level α is split over two tails if two-sided."""
    return float(stats.t.isf(alpha / 2 if two_sided else alpha, df))


def power_at(effect: float, se: float, df: float, crit: float, two_sided: bool) -> float:
    """P(reject) for a true mean difference `effect`, given the SE unit, df and critical value.

    The lower tail of a two-sided test is written as the upper tail at -ncp, which scipy evaluates
    stably (its cdf far in the lower tail can return NaN for large ncp).
    """
    ncp = effect / se
    upper = float(stats.nct.sf(crit, df, ncp))
    if two_sided:
        upper += float(stats.nct.sf(crit, df, -ncp))
    return min(1.0, upper)


def mde_at(se: float, df: float, crit: float, two_sided: bool, target: float = DEFAULT_POWER) -> float:
    """Smallest positive effect with power ≥ `target` (bisection on the non-central t).

    The bracket grows until it holds the root, so small df (heavy tails) and tiny α still work.
    """
    if not (0 < target < 1):
        raise UserError(f"--power: expected a number in (0, 1), got {target!r}")

    def gap(effect: float) -> float:
        return power_at(effect, se, df, crit, two_sided) - target

    hi = se * max(crit + 4.0, 4.0)
    while gap(hi) < 0:
        hi *= 2.0
        if hi > se * 1e6:  # only reachable with absurd inputs (df→0); refuse rather than loop
            raise UserError("no effect reaches the requested power; expected more runs")
    if gap(0.0) >= 0:  # α ≥ target: any effect "detects"
        return 0.0
    return float(optimize.brentq(gap, 0.0, hi, xtol=se * 1e-10, rtol=1e-12))


def power(
    effect: float,
    sigma: float,
    n_baseline: int,
    n_challenger: int,
    alpha: float = 0.025,
    two_sided: bool = False,
) -> float:
    """Power of the pooled t (df = n + m - 2) to detect a true difference `effect` (same units as σ)."""
    _check(sigma, n_baseline, n_challenger, alpha)
    df = n_baseline + n_challenger - 2
    return power_at(
        abs(effect), standard_error(sigma, n_baseline, n_challenger), df, critical_value(alpha, df, two_sided), two_sided
    )


def mde(
    sigma: float,
    n_baseline: int,
    n_challenger: int,
    alpha: float = 0.025,
    two_sided: bool = False,
    target_power: float = DEFAULT_POWER,
) -> float:
    """Minimum detectable effect of the pooled t at `target_power` (same units as σ)."""
    _check(sigma, n_baseline, n_challenger, alpha)
    df = n_baseline + n_challenger - 2
    return mde_at(
        standard_error(sigma, n_baseline, n_challenger),
        df,
        critical_value(alpha, df, two_sided),
        two_sided,
        target_power,
    )


def plan(
    sigma: float,
    n_baseline: int,
    challengers: list[int],
    alpha: float | None = None,
    two_sided: bool = False,
    effect: float | None = None,
    target_power: float = DEFAULT_POWER,
) -> dict[str, object]:
    """The `autoresearch power` table as a JSON-ready dict (stable shape, one row per challenger count).

    `alpha` defaults to 0.05 two-sided or 0.025 one-sided (the same test, one tail reported).
    Each row has the MDE at `target_power` and `power`: at `effect` if given, else at the MDE
    (which is the target by construction). The top-level `mde`/`power`/`challenger` repeat the
    first row, so a single-count call reads `out["mde"]` directly.
    """
    if alpha is None:
        alpha = 0.05 if two_sided else 0.025
    if not challengers:
        raise UserError("--challenger: expected at least one run count")
    if effect is not None and not math.isfinite(effect):
        raise UserError(f"--effect: expected a finite number, got {effect!r}")
    if not (0 < target_power < 1):
        raise UserError(f"--power: expected a number in (0, 1), got {target_power!r}")
    rows = []
    for m in challengers:
        d = mde(sigma, n_baseline, m, alpha, two_sided, target_power)
        at = d if effect is None else abs(effect)
        rows.append(
            {
                "challenger": m,
                "df": n_baseline + m - 2,
                "se": standard_error(sigma, n_baseline, m),
                "mde": d,
                "power_at": at,
                "power": power(at, sigma, n_baseline, m, alpha, two_sided),
            }
        )
    first = rows[0]
    return {
        "sigma": sigma,
        "baseline": n_baseline,
        "alpha": alpha,
        "two_sided": two_sided,
        "target_power": target_power,
        "effect": effect,
        "challenger": first["challenger"],
        "mde": first["mde"],
        "power": first["power"],
        "rows": rows,
    }
