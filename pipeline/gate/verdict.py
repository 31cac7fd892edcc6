"""The gate's verdict at a look, from the tests' outcomes: one vectorised rule table.

Order matters and is the product's policy (README, "The gate"):

1. `harm` — a task harmed (BH on the harm tail) or the horizontal test crossed its lower
   boundary: whatever else happened, the agent must not promote, and should know why.
2. `futile` — 2 or more method failures (NaN, divergence, crash) among the look's challenger
   runs: a method that breaks is not promising, whatever its surviving runs say.
3. `improvement` — the horizontal statistic crossed its improvement boundary, and still crosses
   with the single most-improved task left out (one task moving hugely is not horizontal).
4. `escalate` — not the last look and the horizontal one-sided p < futility_p: worth more runs.
5. `single_task` — per-task wins only (BH on the win tail), no horizontal improvement.
6. `inconclusive` at the last look, `futile` before it.
"""

from __future__ import annotations

import numpy as np

from pipeline.outcomes import Verdict


ORDER: tuple[Verdict, ...] = tuple(Verdict)
CODE = {v: i for i, v in enumerate(ORDER)}
FAILURE_LIMIT = 2  # this many method failures in a look's runs make a hypothesis not promising


def decide(
    *,
    wins: np.ndarray,
    harms: np.ndarray,
    horizontal_up: np.ndarray,
    horizontal_breadth: np.ndarray,
    horizontal_down: np.ndarray,
    horizontal_p: np.ndarray,
    failures: np.ndarray,
    last: bool,
    futility_p: float,
) -> np.ndarray:
    """Verdict codes (index into ORDER) for a batch of looks.

    `wins`/`harms` are (..., tasks) booleans; the horizontal arrays and `failures` are (...).
    NaN p-values (no usable runs) never escalate.
    """
    any_harm = harms.any(axis=-1) | horizontal_down
    any_win = wins.any(axis=-1)
    failed = failures >= FAILURE_LIMIT
    improved = horizontal_up & horizontal_breadth
    with np.errstate(invalid="ignore"):
        promising = (~np.asarray(last)) & (horizontal_p < futility_p)
    tail = CODE[Verdict.inconclusive] if last else CODE[Verdict.futile]
    out = np.full(np.shape(any_harm), tail, dtype=np.int8)
    # assign from lowest to highest priority so later lines win
    out = np.where(any_win, CODE[Verdict.single_task], out)
    out = np.where(promising, CODE[Verdict.escalate], out)
    out = np.where(improved, CODE[Verdict.improvement], out)
    out = np.where(failed, CODE[Verdict.futile], out)
    out = np.where(any_harm, CODE[Verdict.harm], out)
    return out
