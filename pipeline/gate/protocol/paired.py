"""Protocol `paired` (default): the arms share seed k (pretraining through the cache, the fine-tuning
seed), so they are common random numbers and the test is on the paired differences
d_k = challenger_k - baseline_k.

- per task, a t on the d_k, and across tasks the horizontal test on the per-seed trimmed means of
  d_k / σ_task; Benjamini-Hochberg on both tails for per-task wins and harms;
- their variance is moderated by the unpaired bound (`stats.bound_priors`: twice the spread of the
  lab's earlier arms and of this comparison's baseline commit, `looks.with_baseline_arm`, weight
  ⌈20 / m⌉ at m pairs) and the boundaries are calibrated as if the bound were the truth (pair
  correlation 0), so the error rate holds for any pair correlation in [0, 1): also when this
  hypothesis pairs worse than the history (it changes pretraining) or not at all; a challenger
  noisier than the lab widens the bound by its own noise ratio (`looks.noise_ratio`);
- Lan-DeMets spending of Pocock shape (`boundaries.PAIRED_SPENDING`): a clear gain stops at 1-2 pairs;
- the lab's history of paired differences feeds only the futility rule, where an early stop can
  cost power but never a false promotion (without it, the earlier arms' bound). A look with one
  pair can stop a hypothesis (futile) but never promote it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

from pipeline.gate.protocol.base import GateProtocol

if TYPE_CHECKING:
    import numpy as np

    from pipeline.gate.boundaries import Boundaries
    from pipeline.gate.looks import LookData, LookTests
    from pipeline.gate.paths import LookPath


MIN_BASELINE_RUNS = 2  # a lazy baseline still runs 2 seeds at the first look: a task's σ needs a variance


class Paired(GateProtocol):
    name = "paired"
    moderated = True
    default_looks = (1, 2, 5, 10)  # a look at one pair can stop a futile hypothesis
    # issue 34, measured by benchmarks/loop_quality.py --fdp (100 campaigns × 200 hypotheses per prior
    # and ρ): against α 0.025 and futility 0.30, the stream's false-discovery proportion falls from
    # 1.2-50 % to 0.2-46 % (≤ 5 % under the bundled prior and small effects; 8.6 % and 46 % under the
    # nearly-null one, on 3 and 6 false promotions in 20 000 hypotheses) and the true gain per 1000
    # runs rises 15-26 %, except under small effects at ρ 0.6 (−22 %) and the nearly-null prior
    # (which banks almost nothing either way); 0.5σ-1σ gains are promoted less often
    default_alpha = 0.01
    default_futility_p = 0.20

    def looks_problem(self, looks: tuple[int, ...], baseline_runs: int) -> str | None:
        if looks[-1] > baseline_runs:  # seed k of the challenger pairs with seed k of the baseline
            return f"looks: the last look ({looks[-1]}) needs as many baseline runs: baseline_runs is {baseline_runs}"
        return None

    def baseline_runs_at(self, look: int, baseline_runs: int) -> int:
        """The lazy baseline: seed k only once a challenger reaches seed k, and at least 2 (a task's σ
        needs a variance), so the baseline grows with the deepest look asked of it."""
        return min(max(look, MIN_BASELINE_RUNS), baseline_runs)

    def reads_lab_history(self) -> bool:
        return True

    def df(self, n_baseline: int, n_challenger: int, prior_weight: float) -> float:
        from pipeline.gate.boundaries import paired_df

        return paired_df(n_challenger, prior_weight)

    def se_factor(self, n_baseline: int, n_challenger: int) -> float:
        return math.sqrt(1 / n_challenger)

    def boundaries(self, n_baseline: int, looks: tuple[int, ...], planned_max: int, alpha: float,
                   prior_df: int = 0, prior_weight: float = 0.0) -> Boundaries:
        from pipeline.gate.boundaries import calibration_df, paired_boundaries

        # the bound's weight at each look follows from its df (`stats.bound_weight`): `prior_weight` is
        # not a parameter of the calibration, and leaving it out of the cache key keeps one per schedule
        # a history past EXACT_PRIOR_DF is calibrated on a grid, rounded down (`calibration_df`)
        return paired_boundaries(looks, max(planned_max, looks[-1]), alpha, calibration_df(int(prior_df)))

    def flags(self, p_up: np.ndarray, p_down: np.ndarray, q: np.ndarray, t: np.ndarray, alpha: float,
              harm_q: float) -> tuple[np.ndarray, np.ndarray]:
        return (q <= harm_q) & (t > 0), (q <= harm_q) & (t < 0)

    def harm_rule(self, harm_q: float) -> str:
        return f"BH q ≤ {harm_q}"

    def look_tests(self, d: LookData) -> LookTests:
        from pipeline.gate.looks import paired_look_tests

        return paired_look_tests(d)

    def task_planned(self, planned_last: int, m: int, count: int, failed: int) -> int:
        return planned_last - (m - count)  # a failed run or a dropped pair is a pair fewer

    def next_baseline_runs(self, n: int, m_next: int) -> int:
        return max(n, m_next)  # the lazy baseline runs the seeds the next look pairs with

    def pairs(self, count: int) -> int | None:
        return count

    def futility_p(self, p_up: np.ndarray, h_values: np.ndarray) -> np.ndarray:
        from pipeline.gate.looks import futility_p_value

        return futility_p_value(p_up, h_values)

    def no_variance(self, p_up: float, h_values: np.ndarray) -> bool:
        return sum(1 for v in h_values.ravel() if math.isfinite(v)) >= 1 and not math.isfinite(p_up)

    def path(self, base: np.ndarray, chal: np.ndarray, looks: tuple[int, ...], **kw: Any) -> LookPath:
        from pipeline.gate.paths import paired_path

        return paired_path(self, base, chal, looks, **kw)

    def lab_history(self, draw: Callable[..., np.ndarray], b: int, comparisons: int,
                    pair_rho: float) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Earlier comparisons' paired differences (var 2(1 − ρ_pair) per task, 2 pairs each) and
        their arms (2 seeds each, both arms of each comparison): the prior and the unpaired bound."""
        if not comparisons:
            return None, None
        import numpy as np

        pairs = math.sqrt(2 * (1 - pair_rho)) * draw(b, comparisons, 2)
        arms = np.moveaxis(draw(b, 2 * comparisons, 2), 1, 2)
        return pairs, arms

    def sim_fields(self, history_pair_rho: float, pair_history: int, lazy: bool) -> dict[str, Any]:
        return {"history_pair_rho": history_pair_rho, "pair_history": pair_history, "lazy": lazy}
