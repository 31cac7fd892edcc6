"""Protocol `fixed`: the original post's pooled (Student) t, re-tested at every look at the nominal
one-sided α, each task on its own (no multiplicity correction). Kept to measure what it costs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.gate.protocol.base import GateProtocol

if TYPE_CHECKING:
    import numpy as np

    from pipeline.gate.boundaries import Boundaries


class Fixed(GateProtocol):
    name = "fixed"
    moderated = False

    def boundaries(self, n_baseline: int, looks: tuple[int, ...], planned_max: int, alpha: float,
                   prior_df: int = 0, prior_weight: float = 0.0) -> Boundaries:
        from pipeline.gate.boundaries import fixed_boundaries

        return fixed_boundaries(n_baseline, looks, alpha, prior_weight)

    def flags(self, p_up: np.ndarray, p_down: np.ndarray, q: np.ndarray, t: np.ndarray, alpha: float,
              harm_q: float) -> tuple[np.ndarray, np.ndarray]:
        return p_up < alpha, p_down < alpha

    def harm_rule(self, harm_q: float) -> str:
        return "nominal p"
