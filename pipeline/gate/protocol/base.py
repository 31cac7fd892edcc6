"""The interface of a gate protocol, with the two-sample behaviour as its default.

Everything that differs between a protocol that tests two samples (`sequential`, `fixed`) and one
that tests the paired differences of seed k (`paired`) is a method here, so the gate's code
(`pipeline.gate.judge`, `inputs`, `sim`) asks the protocol object and never its name.

Light at import (the statistics are imported by the methods that compute): reading a lab's
`[gate]` asks its protocol whether the looks fit (`looks_problem`) and must not import numpy
(tests/test_cli_startup.py).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import numpy as np

    from pipeline.gate.boundaries import Boundaries
    from pipeline.gate.looks import LookData, LookTests
    from pipeline.gate.paths import LookPath


class GateProtocol:
    name: str = ""
    moderated: bool = False  # whether the per-task variance borrows a history (a prior)
    default_looks: tuple[int, ...] = (2, 5, 10)  # a two-sample variance needs 2 challenger runs
    default_alpha: float = 0.025  # `[gate] alpha` when research.toml does not set it
    default_futility_p: float = 0.30  # `[gate] futility_p` when research.toml does not set it

    # ------------------------------------------------------------ the design
    def looks_problem(self, looks: tuple[int, ...], baseline_runs: int) -> str | None:
        """What is wrong with these looks for this protocol (one line), or None."""
        if looks[0] < 2:
            return (f"looks: expected the first look at 2 runs or more with protocol {self.name!r} (a two-sample "
                    "variance needs 2 challenger runs; only a paired protocol looks at 1)")
        return None

    def baseline_runs_at(self, look: int, baseline_runs: int) -> int:
        """The baseline runs a look needs: all of them, up front (both arms' variances are estimated)."""
        return baseline_runs

    def reads_lab_history(self) -> bool:
        """Whether a look's input carries the lab's earlier comparisons (`pair_history`, `arm_history`)."""
        return False

    def df(self, n_baseline: int, n_challenger: int, prior_weight: float) -> float:
        """Degrees of freedom of a task's test at these run counts (for a paired test, n_challenger pairs)."""
        from pipeline.gate.boundaries import degrees_of_freedom

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

    # ------------------------------------------------------------ a look (`evaluate`)
    def look_tests(self, d: LookData) -> LookTests:
        """The look's tests: two samples, the variance moderated by the history where `moderated`."""
        from pipeline.gate.looks import two_sample_tests

        return two_sample_tests(d, self.moderated)

    def task_planned(self, planned_last: int, m: int, count: int, failed: int) -> int:
        """A task's planned last look in runs its test stands on: failed runs add no information."""
        return planned_last - failed

    def next_baseline_runs(self, n: int, m_next: int) -> int:
        """The baseline runs a task's test stands on at the next look (the baseline is run once, in full)."""
        return n

    def pairs(self, count: int) -> int | None:
        """What a record says of pairs (None: the test stands on runs, not pairs)."""
        return None

    def futility_p(self, p_up: np.ndarray, h_values: np.ndarray) -> np.ndarray:
        """The p the futility rule judges: the horizontal test's own."""
        return p_up

    def no_variance(self, p_up: float, h_values: np.ndarray) -> bool:
        """Whether the look has a value but no variance to test it on yet (then no futility)."""
        return False

    # ------------------------------------------------------------ the simulator (`gate-sim`)
    def path(self, base: np.ndarray, chal: np.ndarray, looks: tuple[int, ...], **kw: Any) -> LookPath:
        """A batch of hypotheses judged at every look (`pipeline.gate.paths`)."""
        from pipeline.gate.paths import two_sample_path

        return two_sample_path(self, base, chal, looks, **kw)

    def lab_history(self, draw: Callable[..., np.ndarray], b: int, comparisons: int,
                    pair_rho: float) -> tuple[np.ndarray | None, np.ndarray | None]:
        """A simulated lab's earlier comparisons (paired differences, arms): none for two samples."""
        return None, None

    def sim_fields(self, history_pair_rho: float, pair_history: int, lazy: bool) -> dict[str, Any]:
        """What a simulation reports of the lab's pairing: nothing for two samples."""
        return {"history_pair_rho": None, "pair_history": 0, "lazy": False}
