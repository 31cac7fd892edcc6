"""Protocol `sequential`: a moderated variance (the baseline's history as a prior), Lan-DeMets
O'Brien-Fleming boundaries calibrated on the t scale, and Benjamini-Hochberg across tasks on both
tails, so per-task wins and harms keep their error rates across looks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.gate.protocol.base import GateProtocol

if TYPE_CHECKING:
    import numpy as np

    from pipeline.gate.boundaries import Boundaries


class Sequential(GateProtocol):
    name = "sequential"
    moderated = True

    def boundaries(self, n_baseline: int, looks: tuple[int, ...], planned_max: int, alpha: float,
                   prior_df: int = 0, prior_weight: float = 0.0) -> Boundaries:
        from pipeline.gate.boundaries import sequential_boundaries

        return sequential_boundaries(n_baseline, looks, max(planned_max, looks[-1]), alpha, int(prior_df),
                                     float(prior_weight))

    def flags(self, p_up: np.ndarray, p_down: np.ndarray, q: np.ndarray, t: np.ndarray, alpha: float,
              harm_q: float) -> tuple[np.ndarray, np.ndarray]:
        return (q <= harm_q) & (t > 0), (q <= harm_q) & (t < 0)

    def harm_rule(self, harm_q: float) -> str:
        return f"BH q ≤ {harm_q}"
