"""Protocol `paired` (default): the arms share seed k (pretraining through the cache, the fine-tuning
seed), so they are common random numbers and the test is on the paired differences
d_k = challenger_k - baseline_k.

- per task, a t on the d_k, and across tasks the horizontal test on the per-seed trimmed means of
  d_k / σ_task; Benjamini-Hochberg on both tails for per-task wins and harms;
- their variance is moderated by the unpaired bound (`stats.bound_priors`: twice the spread of the
  lab's earlier arms, weight ⌈20 / m⌉ at m pairs) and the boundaries are calibrated as if the bound
  were the truth (pair correlation 0), so the error rate holds for any pair correlation in [0, 1):
  also when this hypothesis pairs worse than the history (it changes pretraining) or not at all;
- Lan-DeMets spending of Pocock shape (`boundaries.PAIRED_SPENDING`): a clear gain stops at 1-2 pairs;
- the lab's history of paired differences feeds only the futility rule, where an early stop can
  cost power but never a false promotion. With no earlier arm, a look with one pair can stop a
  hypothesis (futile) but never promote it.
"""

from __future__ import annotations

import math

import numpy as np

from pipeline.gate.boundaries import Boundaries, calibration_df, paired_boundaries, paired_df
from pipeline.gate.protocol.base import GateProtocol


class Paired(GateProtocol):
    name = "paired"
    moderated = True
    paired = True

    def df(self, n_baseline: int, n_challenger: int, prior_weight: float) -> float:
        return paired_df(n_challenger, prior_weight)

    def se_factor(self, n_baseline: int, n_challenger: int) -> float:
        return math.sqrt(1 / n_challenger)

    def boundaries(self, n_baseline: int, looks: tuple[int, ...], planned_max: int, alpha: float,
                   prior_df: int = 0, prior_weight: float = 0.0) -> Boundaries:
        # the bound's weight at each look follows from its df (`stats.bound_weight`): `prior_weight` is
        # not a parameter of the calibration, and leaving it out of the cache key keeps one per schedule
        # a history past EXACT_PRIOR_DF is calibrated on a grid, rounded down (`calibration_df`)
        return paired_boundaries(looks, max(planned_max, looks[-1]), alpha, calibration_df(int(prior_df)))

    def flags(self, p_up: np.ndarray, p_down: np.ndarray, q: np.ndarray, t: np.ndarray, alpha: float,
              harm_q: float) -> tuple[np.ndarray, np.ndarray]:
        return (q <= harm_q) & (t > 0), (q <= harm_q) & (t < 0)

    def harm_rule(self, harm_q: float) -> str:
        return f"BH q ≤ {harm_q}"
