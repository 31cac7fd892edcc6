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
