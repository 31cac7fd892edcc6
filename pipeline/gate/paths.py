"""A batch of simulated hypotheses judged at every planned look (`LookPath`), with the statistics and
the verdict table `evaluate` uses: two samples (`two_sample_path`) or paired (`paired_path`). A
protocol picks its path (`GateProtocol.path`); the simulator (pipeline.gate.sim) and
benchmarks/loop_quality.py call `pipeline.gate.sim.look_path`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.gate.looks import (
    SEED_SPREAD_P,
    GateProtocol,
    futility_p_value,
    horizontal_look,
    most_improved,
    paired_tests,
    task_look,
    task_scale,
    two_sample_horizontal,
)
from pipeline.gate.stats import (
    HORIZONTAL_TRIM,
    PRIOR_DF_CAP,
    arms_without_task,
    bound_weight,
    history_prior,
    horizontal_values,
    pooled_t,
    spread_ratio_p,
    summarize,
    without_task,
)
from pipeline.gate.verdict import CODE, Verdict, decide



@dataclass(frozen=True)
class LookPath:
    """A batch of hypotheses judged at every planned look, as if each look were taken.

    Arrays are (b, K) or (b, K, tasks), oriented so that + is better: the verdict code at each
    look, whether the horizontal test and each task's test crossed their improvement boundaries,
    and the horizontal Δ (σ units) and per-task Δ (metric units) at each look.
    """

    looks: tuple[int, ...]
    codes: np.ndarray
    horizontal_up: np.ndarray
    task_up: np.ndarray
    horizontal_delta: np.ndarray
    task_delta: np.ndarray
    held: np.ndarray  # (b, K): seeds do not vary (an `improvement` there is held, not promoted)

    def first_stop(self) -> tuple[np.ndarray, np.ndarray]:
        """The verdict where each hypothesis stops (its first verdict other than `escalate`, or the
        last look's) and the index of that look: what the loop's escalate-or-decide rule does."""
        going = self.codes == CODE[Verdict.escalate]
        going[:, -1] = False
        k_stop = np.argmin(going, axis=1)  # the first look that does not escalate
        return self.codes[np.arange(len(k_stop)), k_stop], k_stop


def two_sample_path(
    proto: GateProtocol,
    base: np.ndarray,
    chal: np.ndarray,
    looks: tuple[int, ...],
    *,
    alpha: float = 0.025,
    futility_p: float = 0.30,
    harm_q: float = 0.10,
    horizontal_trim: float = HORIZONTAL_TRIM,
    history: np.ndarray | None = None,
    scale: np.ndarray | None = None,
    pair_history: np.ndarray | None = None,
    base_depth: np.ndarray | None = None,
    arm_history: np.ndarray | None = None,
) -> LookPath:
    """Judge a batch of hypotheses at every look with the statistics and verdict table `evaluate`
    uses: `base` (b, tasks, n) baseline runs, `chal` (b, tasks, ≥ looks[-1]) challenger runs by seed,
    `history` (b, tasks, h) extra baseline-commit runs (the variance prior), all oriented so that +
    is better. `scale` (b, tasks) overrides σ_task (default: from the baseline's runs and history).
    Runs have no failures here (NaN is a failed run, as in `evaluate`, but failures are not counted).

    `paired` only: `pair_history` (b, tasks, comparisons, seeds) is the lab's earlier paired
    differences (the prior), and `base_depth` (b,) the baseline seeds already run before this
    hypothesis (the lazy baseline: at a look of m runs the gate sees max(depth, m, 2) of them; None:
    all n). A result held because its seeds do not vary is `held` (never promoted automatically).
    """
    b, J, n = base.shape
    hist_arm = summarize(history) if history is not None and history.shape[-1] else None
    prior_df = int(hist_arm.count.max()) - 1 if hist_arm is not None else 0
    prior_df = max(prior_df, 0)
    weight = float(min(prior_df, PRIOR_DF_CAP))
    tb = proto.boundaries(n, looks, looks[-1], alpha, prior_df, weight if proto.moderated else 0.0)
    hbnd = proto.boundaries(n, looks, looks[-1], alpha)
    base_arm = summarize(base)
    prior = history_prior(history, base_arm.mean.shape) if proto.moderated and hist_arm is not None else None
    if scale is None:
        scale, _ = task_scale(base_arm, hist_arm)
    hb, hc = horizontal_values(base, chal, base_arm.mean, scale, horizontal_trim)
    K = len(looks)
    out = _Path(b, K, J)
    for k, mk in enumerate(looks):
        test = pooled_t(base_arm, summarize(chal[..., :mk]), prior)
        tl = task_look(test, np.float64(tb.nominal[k]), proto, alpha, harm_q)
        breadth, required = None, True
        if J > 1:
            top, required = most_improved(test.delta, scale)
            bb, bc = horizontal_values(without_task(base, top), without_task(chal[..., :mk], top), base_arm.mean,
                                       scale, horizontal_trim)
            breadth = two_sample_horizontal(bb, bc)
        hl = horizontal_look(two_sample_horizontal(hb, hc[:, :mk]), hbnd.upper[k], breadth, required)
        out.record(k, tl, hl, hl.p_up, test, tb.upper[k], k == K - 1, futility_p, spread_ratio_p(hb, hc[:, :mk])[1])
    return out.finish(looks)


def paired_path(
    proto: GateProtocol,
    base: np.ndarray,
    chal: np.ndarray,
    looks: tuple[int, ...],
    *,
    alpha: float = 0.025,
    futility_p: float = 0.30,
    harm_q: float = 0.10,
    horizontal_trim: float = HORIZONTAL_TRIM,
    history: np.ndarray | None = None,
    scale: np.ndarray | None = None,
    pair_history: np.ndarray | None = None,
    base_depth: np.ndarray | None = None,
    arm_history: np.ndarray | None = None,
) -> LookPath:
    """`two_sample_path` for the paired protocol: `pair_history` (b, tasks, comparisons, seeds) is
    the lab's earlier paired differences (the prior), and `base_depth` (b,) the baseline seeds already
    run before this hypothesis (the lazy baseline: at a look of m runs the gate sees max(depth, m, 2)
    of them; None: all n). σ_task is the baseline's and the earlier arms' (`scale` is not used)."""
    b, J, n = base.shape
    trim = horizontal_trim
    if pair_history is None or not (pair_history.shape[-1] and pair_history.shape[-2]):
        pair_history = None
    hist_arm = summarize(history) if history is not None and history.shape[-1] else None
    K = len(looks)
    out = _Path(b, K, J)
    seeds = np.arange(n)
    for k, mk in enumerate(looks):
        depth = np.full(b, n) if base_depth is None else np.maximum(np.asarray(base_depth), max(mk, 2))
        visible = np.where((seeds[None, :] < np.minimum(depth, n)[:, None])[:, None, :], base, np.nan)
        base_arm = summarize(visible)
        scale, _ = task_scale(base_arm, hist_arm, arm_history)
        c = chal[..., :mk]
        hb, hc = horizontal_values(visible, c, base_arm.mean, scale, trim)
        extra = history if hist_arm is not None else None
        if base_depth is not None:  # seeds run before this hypothesis, off this look's pairs: the product's
            off = (seeds[None, :] >= max(mk, 2)) & (seeds[None, :] < np.asarray(base_depth)[:, None])  # `hist`
            ran = np.where(off[:, None, :], base, np.nan)
            extra = ran if extra is None else np.concatenate([ran, extra], axis=-1)
        pt = paired_tests(visible, c, scale, hb, trim, pair_history, arm_history, extra)
        # boundaries: one calibration per bound df (trials, and tasks, differ in their history)
        t_upper, t_nominal = np.full((b, J), np.inf), np.full((b, J), np.nan)
        for w in np.unique(pt.prior.df):
            bnd = _paired_boundaries(proto, n, looks[: k + 1], looks[-1], alpha, int(w))
            if bnd is not None:
                t_upper = np.where(pt.prior.df == w, bnd.upper[-1], t_upper)
                t_nominal = np.where(pt.prior.df == w, bnd.nominal[-1], t_nominal)
        tl = task_look(pt.test, t_nominal, proto, alpha, harm_q)
        breadth, required = None, True
        if J > 1:
            top, required = most_improved(pt.test.delta, scale)
            breadth = paired_tests(without_task(visible, top), without_task(c, top), scale, hb, trim, None,
                                   arms_without_task(arm_history, top),
                                   without_task(extra, top) if extra is not None else None).h
        # the horizontal boundaries: one calibration per bound df (trials differ in their history)
        h_upper = np.full(b, np.inf)
        for w in np.unique(pt.bound.df):
            bnd = _paired_boundaries(proto, n, looks[: k + 1], looks[-1], alpha, int(w))
            if bnd is not None:
                h_upper = np.where(pt.bound.df == w, bnd.upper[-1], h_upper)
        hl = horizontal_look(pt.h, h_upper, breadth, required, pt.h_futility)
        low = spread_ratio_p(hb, hc)[1]
        high = pt.noisier[1]
        with np.errstate(invalid="ignore"):
            held_p = np.fmin(low, high)  # held when either tail is below SEED_SPREAD_P (NaN: untested)
        out.record(k, tl, hl, futility_p_value(hl.p_up, pt.hd), pt.test, t_upper, k == K - 1, futility_p, held_p)
    return out.finish(looks)


def _paired_boundaries(proto: GateProtocol, n: int, looks: tuple[int, ...], planned_max: int, alpha: float,
                       prior_df: int) -> Any:
    """The paired boundaries at `looks` for a bound prior of `prior_df` df (None: no df at the last
    look), as `evaluate` computes them."""
    if proto.df(n, looks[-1], float(bound_weight(prior_df, looks[-1]))) < 1:
        return None
    return proto.boundaries(n, looks, planned_max, alpha, prior_df, 0.0)


class _Path:
    """Accumulates a LookPath look by look."""

    def __init__(self, b: int, K: int, J: int):
        self.codes = np.empty((b, K), dtype=np.int8)
        self.h_up, self.t_up = np.zeros((b, K), bool), np.zeros((b, K, J), bool)
        self.h_delta, self.t_delta = np.zeros((b, K)), np.zeros((b, K, J))
        self.held = np.zeros((b, K), bool)

    def record(self, k: int, tl: Any, hl: Any, p_fut: np.ndarray, test: Any, task_upper: float, last: bool,
               futility_p: float, spread_p: np.ndarray) -> None:
        b = self.codes.shape[0]
        self.codes[:, k] = decide(
            wins=tl.wins, harms=tl.harms, horizontal_up=hl.up, horizontal_breadth=hl.breadth_up,
            horizontal_down=hl.down, horizontal_p=p_fut, failures=np.zeros(b, int),
            last=last, futility_p=futility_p,
        )
        self.h_up[:, k] = hl.up
        self.t_up[:, k] = test.t >= task_upper
        self.h_delta[:, k] = hl.test.delta
        self.t_delta[:, k] = test.delta
        with np.errstate(invalid="ignore"):
            self.held[:, k] = spread_p < SEED_SPREAD_P

    def finish(self, looks: tuple[int, ...]) -> LookPath:
        return LookPath(looks=looks, codes=self.codes, horizontal_up=self.h_up, task_up=self.t_up,
                        horizontal_delta=self.h_delta, task_delta=self.t_delta, held=self.held)
