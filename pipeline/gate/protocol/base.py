"""The interface of a gate protocol."""

from __future__ import annotations

import numpy as np

from pipeline.gate.boundaries import Boundaries


class GateProtocol:
    name: str = ""
    moderated: bool = False  # whether the per-task variance borrows the baseline's history (a prior)

    def boundaries(self, n_baseline: int, looks: tuple[int, ...], planned_max: int, alpha: float,
                   prior_df: int = 0, prior_weight: float = 0.0) -> Boundaries:
        """The one-sided upper boundaries on the t scale at the looks taken so far."""
        raise NotImplementedError

    def flags(self, p_up: np.ndarray, p_down: np.ndarray, q: np.ndarray, t: np.ndarray, alpha: float,
              harm_q: float) -> tuple[np.ndarray, np.ndarray]:
        """(wins, harms) per task from one-sided nominal p-values, BH q-values and t."""
        raise NotImplementedError

    def harm_rule(self, harm_q: float) -> str:
        """How a per-task harm is called, for the verdict's reasons."""
        raise NotImplementedError
