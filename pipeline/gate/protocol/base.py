"""The interface of a gate protocol."""

from __future__ import annotations

import math

import numpy as np

from pipeline.gate.boundaries import Boundaries, degrees_of_freedom


class GateProtocol:
    name: str = ""
    moderated: bool = False  # whether the per-task variance borrows a history (a prior)
    paired: bool = False  # whether it tests the paired differences of seed k (else two samples)

    def df(self, n_baseline: int, n_challenger: int, prior_weight: float) -> float:
        """Degrees of freedom of a task's test at these run counts (for `paired`, n_challenger pairs)."""
        return degrees_of_freedom(n_baseline, n_challenger, prior_weight)

    def se_factor(self, n_baseline: int, n_challenger: int) -> float:
        """The test's standard error over the per-run σ at these run counts."""
        return math.sqrt(1 / n_baseline + 1 / n_challenger)

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
