"""Too good to be true, or seeds that do not vary: a result the loop never promotes on its own
(the plausibility hold, README "The gate").

Seed noise can be tiny, so a huge t says little; what gives a leak away is the size of the gain
against what is possible. A result is held for a human when, on some task, the challenger's mean
is at the metric's perfect value, or closes more than `[gate] implausible_fraction` of the
baseline's remaining distance to it; or (opt-in) when the horizontal Δ exceeds
`[gate] implausible_sigma` σ.
"""

from __future__ import annotations

import math
from typing import Any

from pipeline.gate.report import GateResult

PERFECT_TOLERANCE = 1e-9


def implausible(result: GateResult, config: Any) -> str | None:
    """Why this result is held for a human (too good to be true; its seeds do not vary), or None.
    `config` is the lab's ResearchConfig."""
    bench, gate = config.benchmark, config.gate
    perfect = bench.perfect_value()
    reasons = []
    if perfect is not None:
        for t in result.tasks:
            b, c = t.baseline_mean, t.challenger_mean
            if b is None or c is None or not (math.isfinite(b) and math.isfinite(c)):
                continue
            if abs(c - perfect) <= PERFECT_TOLERANCE * max(1.0, abs(perfect)):
                reasons.append(f"task {t.task}: mean {bench.metric} {c:.4f} is the perfect value {perfect:g}")
                continue
            remaining = abs(perfect - b)
            gained = (c - b) if perfect >= b else (b - c)
            if remaining > 0 and gained / remaining > gate.implausible_fraction:
                reasons.append(f"task {t.task}: {b:.4f} → {c:.4f} closes {gained / remaining:.0%} of the distance "
                               f"to the perfect {perfect:g} in one hypothesis "
                               f"(more than [gate] implausible_fraction = {gate.implausible_fraction:g})")
    h = result.horizontal
    if gate.implausible_sigma is not None and h.delta is not None and h.delta > gate.implausible_sigma:
        reasons.append(f"horizontal Δ {h.delta:+.2f}σ exceeds [gate] implausible_sigma = {gate.implausible_sigma:g}")
    held = [f"too good to be true ({'; '.join(reasons)})"] if reasons else []
    if result.seed_spread is not None and result.seed_spread.held:  # seeds must vary
        held.append(result.seed_spread.reason or "seeds must vary")
    return "; ".join(held) or None
