"""Error control across the stream of hypotheses: LOND (Javanmard & Montanari 2018), opt-in.

Each comparison (a challenger against its baseline) is one test of the stream. Tested alone at
`[gate] alpha`, a lab whose ideas are nearly all null promotes a steady trickle of them: each test
spends α whatever came before. With `[gate] online_fdr = "lond"` the i-th comparison of the lab is
run through the same gate at

    α_i = min(alpha, fdr · γ_i · (D + 1)),

where D is the number of discoveries (comparisons whose gate said `improvement`) recorded before
the i-th was first judged, and γ is a fixed sequence summing to 1 (`gamma`: the one R's onlineFDR
uses for LOND). That bounds the false discovery rate of the whole stream by `fdr`, for independent
tests and under positive dependence (PRDS: challengers share a baseline's runs), which LORD++,
SAFFRON and ADDIS do not promise in general. A comparison keeps its α_i once given (a look's verdict
is a function of the look), every look of it spends that α_i through the protocol's boundaries, a
re-based hypothesis is a new comparison, and only the gate's verdict counts as a discovery: a
human's approval of a held hypothesis adds nothing to D, and nothing is refunded. With a replication
step (`[gate] replicate_runs`) the test is the gate and the replication together: a discovery is an
`improvement` that replicated (one that did not was not promoted, and does not raise the next α).

The bookkeeping lives in the store (`FdrTest` rows: index, α_i, D before it, when it was found), so it
survives restarts; `status` shows the tests, the discoveries and the α the next one would get.
"""

from __future__ import annotations

import math

GAMMA_SCALE = 0.07720838  # makes the sequence below sum to 1 (onlineFDR's LOND default)


def gamma(i: int) -> float:
    """γ_i, i = 1, 2, ...: 0.0772 · log(max(i, 2)) / (i · e^√log i), summing to 1 over all i."""
    if i < 1:
        raise ValueError(f"the stream's tests are numbered from 1, not {i}")
    return GAMMA_SCALE * math.log(max(i, 2)) / (i * math.exp(math.sqrt(math.log(i))))


def lond_alpha(i: int, discoveries: int, fdr: float, cap: float) -> float:
    """The one-sided level of the i-th test given `discoveries` before it: never above `cap`."""
    return min(cap, fdr * gamma(i) * (discoveries + 1))


def lord_alpha(i: int, discovered_at: list[int], fdr: float, cap: float, w0: float | None = None) -> float:
    """LORD++ (Ramdas et al. 2017): the level of the i-th test given the indices τ_1 < τ_2 < ... (< i) of
    the tests that were discoveries before it, with initial wealth `w0` (default fdr / 10, onlineFDR's):

        α_i = γ_i·w0 + (fdr − w0)·γ_{i−τ_1} + fdr·Σ_{j≥2} γ_{i−τ_j},  never above `cap`.

    Each discovery earns wealth back, so the level does not decay with i while discoveries keep coming
    (LOND's does). Its FDR bound is proved for independent tests only, not for the positive dependence
    that shared baselines create: measured, not assumed (benchmarks/loop_quality.py's `paired-lord`)."""
    w0 = fdr / 10.0 if w0 is None else w0
    if not 0 <= w0 <= fdr:
        raise ValueError(f"LORD++'s initial wealth must be in [0, fdr], got {w0}")
    earlier = [t for t in discovered_at if t < i]
    level = gamma(i) * w0
    for j, t in enumerate(sorted(earlier)):
        level += (fdr - w0 if j == 0 else fdr) * gamma(i - t)
    return min(cap, level)
