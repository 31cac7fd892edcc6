"""`evaluate`: runs in, one look's `GateResult` out.

A look goes through five pieces, each a function below: its runs as arrays (`_look_data`), the
protocol's tests (`GateProtocol.look_tests`: two samples, or the paired differences of seed k —
pipeline.gate.looks), the per-task boundaries and flags (`_task_look`), the horizontal test
against its boundary (`_horizontal_look`), the verdict table (`_verdict`); then the record. What
differs between protocols is asked of the protocol object (pipeline.gate.protocol), never its name.

Everything is oriented internally so that "+" means better (lower-is-better metrics are negated);
records report raw Δ = challenger - baseline in metric units.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import stats as sps

from pipeline.gate.boundaries import Boundaries, normalize_schedule
from pipeline.gate.inputs import GateConfig, GateInput, TaskRuns, parse_input
from pipeline.gate.looks import (
    SEED_SPREAD_P,
    HorizontalLook,
    LookData,
    LookTests,
    TaskLook,
    horizontal_look,
    task_look,
)
from pipeline.gate.power import DEFAULT_POWER, mde_at
from pipeline.gate.protocol import get_protocol
from pipeline.gate.protocol.base import GateProtocol
from pipeline.gate.report import (
    FailureReport,
    GateResult,
    HorizontalResult,
    SeedSpread,
    TaskResult,
    WelchResult,
)
from pipeline.gate.stats import Arm, TwoSample, spread_ratio_p, variance_ratio_p, welch_t
from pipeline.gate.verdict import ORDER, Verdict, decide

UNSTABLE_P = 0.05  # F-test level for "challenger variance ≫ baseline variance"


# ---------------------------------------------------------------- vectorised look statistics


# ---------------------------------------------------------------- evaluate: one hypothesis


def _pad(rows: list[list[float]], width: int) -> np.ndarray:
    out = np.full((len(rows), max(width, 1)), np.nan)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


@dataclass(frozen=True)
class _Schedule:
    planned: tuple[int, ...]
    seeds: tuple[int, ...]  # challenger seed counts of the looks taken, this one last
    is_look: bool
    last: bool
    next_look: int | None


def _schedule(inp: GateInput) -> _Schedule:
    cfg, m = inp.config, inp.challenger_count
    complete = all(len(t.challenger) == m for t in inp.tasks)
    planned = cfg.looks
    is_look = inp.at_look if inp.at_look is not None else complete and (m in planned or m >= planned[-1])
    done = sorted({l for l in (inp.looks_done if inp.looks_done is not None else planned) if 0 < l < m})
    later = [l for l in planned if l > m]
    return _Schedule(
        planned=planned,
        seeds=tuple(done) + (m,),
        is_look=bool(is_look),
        last=m >= planned[-1],
        next_look=later[0] if later else None,
    )


def _counts_at(values: np.ndarray, seeds: tuple[int, ...]) -> tuple[int, ...]:
    """Successful runs among the first k seeds, for each look's seed count k."""
    ok = np.isfinite(values)
    return tuple(int(ok[:k].sum()) for k in seeds)


def _boundaries(
    cfg: GateConfig, n: int, counts: tuple[int, ...], planned_max: int, prior_df: int, weight: float
) -> Boundaries | None:
    counts = tuple(c for c in counts if c >= 1)
    proto = get_protocol(cfg.protocol)
    if n < 1 or not counts or proto.df(n, counts[-1], weight) < 1:
        return None
    sched = normalize_schedule(counts)
    return proto.boundaries(n, sched, planned_max, cfg.alpha, int(prior_df), float(weight))


def _by_seed(records: list[dict[str, list[float | None]]], names: list[str], sign: float) -> np.ndarray | None:
    """(records, tasks, seeds) of {task: [value by seed]} records (None = no value), NaN-padded and
    oriented; None without any value."""
    width = max((len(v) for r in records for v in r.values()), default=0)
    if width == 0:
        return None
    out = np.full((len(records), len(names), width), np.nan)
    for i, rec in enumerate(records):
        for j, name in enumerate(names):
            row = [math.nan if v is None else float(v) for v in rec.get(name, [])]
            out[i, j, : len(row)] = row
    return sign * out


def _pair_history(inp: GateInput, names: list[str], sign: float) -> np.ndarray | None:
    """(tasks, comparisons, seeds) paired differences of the lab's earlier comparisons, oriented."""
    out = _by_seed(inp.pair_history, names, sign)
    return None if out is None else np.moveaxis(out, 0, 1)


def _arm_history(inp: GateInput, names: list[str], sign: float) -> np.ndarray | None:
    """(arms, tasks, seeds) runs of the lab's earlier arms, oriented (the unpaired bound's history)."""
    return _by_seed(inp.arm_history, names, sign)


def evaluate(inp: GateInput | dict[str, Any]) -> GateResult:
    """Judge one look of one hypothesis (see `pipeline.gate` for the input shape)."""
    return _evaluate(parse_input(inp), with_sensitivity=True)


def _evaluate(inp: GateInput, with_sensitivity: bool) -> GateResult:
    """The look's data → the protocol's tests → boundaries → the verdict → the record."""
    cfg = inp.config
    proto = get_protocol(cfg.protocol)
    sign = 1.0 if cfg.higher_is_better else -1.0
    names = [t.task for t in inp.tasks]
    sched = _schedule(inp)
    failed = np.array([t.failed() for t in inp.tasks])
    lt = proto.look_tests(_look_data(inp, names, sign))
    tl, upper, bounds = _task_look(proto, cfg, sched, inp.challenger_count, lt, failed)
    hl, h_upper = _horizontal_look(proto, cfg, sched, lt)
    total_failed = int(failed.sum())
    verdict = _verdict(proto, cfg, sched, tl, hl, lt, total_failed)
    sensitivity, sens_verdict = _sensitivity(inp, total_failed) if with_sensitivity else (None, None)
    reasons = _reasons(verdict, tl, hl, h_upper, names, total_failed, cfg, sched, lt.top)
    if verdict is not None and proto.no_variance(float(hl.p_up), lt.h_values):
        reasons.append("one pair and no history of paired differences in this lab: no variance yet, "
                       f"so no futility test: run to {sched.next_look}")
    dropped = int(lt.pairs_dropped.sum())
    if verdict is not None and dropped:
        reasons.append(f"{dropped} challenger run(s) without a baseline result on the same seed: "
                       "dropped from the paired tests")
    m = inp.challenger_count
    f_p = variance_ratio_p(lt.scale**2, lt.scale_df, lt.chal_arm)  # unstable challengers, Welch beside
    welch = welch_t(lt.base_arm, lt.chal_arm)
    weight, prior_df = _prior_of(lt, len(names))
    tasks = [
        _task_record(j, name, sign, cfg, sched, m, lt.test, tl, lt.base_arm, lt.chal_arm, failed, upper, bounds,
                     prior_df, weight, f_p, welch, int(lt.counts[j]), int(lt.pairs_dropped[j]))
        for j, name in enumerate(names)
    ]
    return GateResult(
        protocol=cfg.protocol,
        alpha=cfg.alpha,
        higher_is_better=cfg.higher_is_better,
        look=m,
        looks_done=list(sched.seeds),
        planned_looks=list(sched.planned),
        is_look=sched.is_look,
        last_look=sched.last,
        next_look=sched.next_look,
        verdict=verdict,
        reasons=reasons,
        tasks=tasks,
        horizontal=_horizontal_record(proto, cfg, sched, lt, hl, h_upper, names),
        failures=FailureReport(
            failed_runs=total_failed,
            not_promising=total_failed >= 2,
            sensitivity=sensitivity,
            sensitivity_verdict=sens_verdict,
        ),
        seed_spread=_seed_spread(lt.hb, lt.hc, lt.noisier),
        baseline_runs_used=int(lt.base_arm.count.sum()),
        challenger_runs_used=int(sum(len(t.challenger) for t in inp.tasks)),
        mde_power=DEFAULT_POWER,
    )


def _look_data(inp: GateInput, names: list[str], sign: float) -> LookData:
    """The look's runs as oriented arrays (NaN: a failed or missing run), and the lab's histories."""
    base = sign * _pad([t.baseline_values() for t in inp.tasks], max(len(t.baseline) for t in inp.tasks))
    chal = sign * _pad([t.challenger_values() for t in inp.tasks], inp.challenger_count)
    extra = [t.extra_history() for t in inp.tasks]
    hist = sign * _pad(extra, max(len(h) for h in extra)) if any(extra) else None
    return LookData(base=base, chal=chal, hist=hist, pair_history=_pair_history(inp, names, sign),
                    arm_history=_arm_history(inp, names, sign), trim=inp.config.horizontal_trim)


def _prior_of(lt: LookTests, n_tasks: int) -> tuple[np.ndarray, np.ndarray]:
    """(weight, df) of each task's variance prior (zeros: none)."""
    if lt.prior is None:
        return np.zeros(n_tasks), np.zeros(n_tasks, dtype=int)
    return lt.prior.weight, lt.prior.df


def _task_look(proto: GateProtocol, cfg: GateConfig, sched: _Schedule, m: int, lt: LookTests,
               failed: np.ndarray) -> tuple[TaskLook, np.ndarray, list[Boundaries | None]]:
    """Per-task boundaries, each task on its own schedule (failed runs and dropped pairs add no
    information), and the tests' flags against them."""
    weight, prior_df = _prior_of(lt, len(failed))
    bounds = [
        _boundaries(cfg, int(lt.base_arm.count[j]), _counts_at(lt.task_values[j], sched.seeds),
                    proto.task_planned(sched.planned[-1], m, int(lt.counts[j]), int(failed[j])),
                    int(prior_df[j]), float(weight[j]))
        for j in range(len(failed))
    ]
    upper = np.array([b.upper[-1] if b else np.inf for b in bounds])
    nominal = np.array([b.nominal[-1] if b else np.nan for b in bounds])
    return task_look(lt.test, nominal, proto, cfg.alpha, cfg.harm_q), upper, bounds


def _horizontal_look(proto: GateProtocol, cfg: GateConfig, sched: _Schedule,
                     lt: LookTests) -> tuple[HorizontalLook, float]:
    """The horizontal test against its boundary (which borrows only the unpaired bound, where the
    protocol has one: never the history of pairs), with the breadth check."""
    h_df = int(lt.h_prior.df) if lt.h_prior is not None else 0
    h_weight = float(lt.h_prior.weight) if lt.h_prior is not None else 0.0
    hbounds = _boundaries(cfg, int(np.isfinite(lt.hb).sum()), _counts_at(lt.h_values, sched.seeds),
                          sched.planned[-1], h_df, h_weight)
    h_upper = hbounds.upper[-1] if hbounds else np.inf
    return horizontal_look(lt.h, h_upper, lt.h_breadth, lt.stands_out, lt.h_futility), h_upper


def _verdict(proto: GateProtocol, cfg: GateConfig, sched: _Schedule, tl: TaskLook, hl: HorizontalLook,
             lt: LookTests, total_failed: int) -> Verdict | None:
    """The verdict table (`pipeline.gate.verdict.decide`) at a look; None between looks."""
    code = decide(
        wins=tl.wins[None, :],
        harms=tl.harms[None, :],
        horizontal_up=np.atleast_1d(hl.up),
        horizontal_breadth=np.atleast_1d(hl.breadth_up),
        horizontal_down=np.atleast_1d(hl.down),
        horizontal_p=np.atleast_1d(proto.futility_p(hl.p_up, lt.h_values)),
        failures=np.array([total_failed]),
        last=sched.last,
        futility_p=cfg.futility_p,
    )[0]
    return ORDER[int(code)] if sched.is_look else None


def _horizontal_record(proto: GateProtocol, cfg: GateConfig, sched: _Schedule, lt: LookTests, hl: HorizontalLook,
                       h_upper: float, names: list[str]) -> HorizontalResult:
    hb, hc = lt.hb, lt.hc
    ci = _interval(float(hl.test.delta), h_upper * float(hl.test.se), 1.0)
    return HorizontalResult(
        baseline_seeds=int(np.isfinite(hb).sum()),
        challenger_seeds=int(np.isfinite(hc).sum()),
        baseline_mean=float(np.nanmean(hb)) if np.isfinite(hb).any() else None,
        challenger_mean=float(np.nanmean(hc)) if np.isfinite(hc).any() else None,
        delta=hl.test.delta,
        ci_low=ci[0],
        ci_high=ci[1],
        df=hl.test.df,
        t=hl.test.t,
        boundary=h_upper,
        p_one_sided=hl.p_up,
        breadth_t=hl.breadth.t if hl.breadth is not None else None,
        breadth_task=names[lt.top] if hl.breadth is not None else None,
        breadth_required=lt.stands_out if hl.breadth is not None else False,
        mde_next=_horizontal_mde(proto, cfg, sched, hb, lt.h_values, hl.test),
        pairs=proto.pairs(int(np.isfinite(lt.h_values).sum())),
    )


def _sensitivity(inp: GateInput, total_failed: int) -> tuple[str | None, Verdict | None]:
    """With failed runs: the verdict were each scored as its task's worst observed value."""
    if not total_failed:
        return None, None
    worst = _worst_case(inp)
    return (f"worst case: {total_failed} failed run(s) scored as their task's worst observed value → "
            f"{worst.verdict.value if worst.verdict else 'no verdict (between looks)'}, horizontal Δ "
            f"{_fmt(worst.horizontal.delta)}σ, t {_fmt(worst.horizontal.t)}"), worst.verdict


def _seed_spread(hb: np.ndarray, hc: np.ndarray,
                 noisier: tuple[np.ndarray, np.ndarray] | None = None) -> SeedSpread | None:
    """Seeds must vary: the challenger's per-seed horizontal values against the baseline's spread;
    where the protocol reads the lab's earlier arms (`noisier`: the challenger's horizontal spread over
    one lab arm's, and its F p): and not far above the lab's either."""
    ratio, p = spread_ratio_p(hb, hc)
    up_ratio, p_up = noisier if noisier is not None else (np.nan, np.nan)
    if not np.isfinite(p) and not np.isfinite(p_up):
        return None
    ratio, p, up_ratio, p_up = float(ratio), float(p), float(up_ratio), float(p_up)
    low = bool(np.isfinite(p) and p < SEED_SPREAD_P)
    high = bool(np.isfinite(p_up) and p_up < SEED_SPREAD_P)
    reasons = []
    if low:
        what = ("its runs do not vary with the seed" if ratio == 0 else
                f"its spread across seeds is {ratio:.3g}× the baseline's (lower-tail F p {p:.2g} < {SEED_SPREAD_P})")
        reasons.append(f"seeds must vary: {what} while the baseline's do; a branch that ignores or hard-codes "
                       "the seed repeats one draw, and replication over seeds is what the gate stands on")
    if high:
        reasons.append(f"noisier than the lab: its spread across seeds is {up_ratio:.3g}× that of the lab's earlier "
                       f"arms (upper-tail F p {p_up:.2g} < {SEED_SPREAD_P}); the paired gate's bound assumes a "
                       "challenger no noisier than them, and a noisier branch buys more chances at a lucky draw")
    return SeedSpread(ratio=ratio if np.isfinite(ratio) else None, p_lower=p if np.isfinite(p) else None,
                      held=low or high, reason="; ".join(reasons) or None,
                      noisier_ratio=up_ratio if np.isfinite(up_ratio) else None,
                      p_upper=p_up if np.isfinite(p_up) else None)


def _interval(delta: float, half: float, sign: float) -> tuple[float | None, float | None]:
    """delta ± half in raw metric units (None when undefined, e.g. no boundary can be crossed)."""
    if not (math.isfinite(delta) and math.isfinite(half)):
        return None, None
    a, b = sign * (delta - half), sign * (delta + half)
    return min(a, b), max(a, b)


def _task_record(
    j: int,
    name: str,
    sign: float,
    cfg: GateConfig,
    sched: _Schedule,
    m: int,
    test: TwoSample,
    tl: TaskLook,
    base: Arm,
    chal: Arm,
    failed: np.ndarray,
    upper: np.ndarray,
    bounds: list[Boundaries | None],
    prior_df: np.ndarray,
    weight: np.ndarray,
    f_p: np.ndarray,
    welch: TwoSample,
    count: int,
    pairs_dropped: int,
) -> TaskResult:
    """One task's row: arm means, Δ with its (repeated) interval, p, q, flags, Welch, next-look MDE.
    `count` is what the test stands on: challenger runs, or pairs for `paired`."""
    ci = _interval(float(test.delta[j]), float(upper[j] * test.se[j]), sign)
    flags = []
    if sched.is_look and tl.wins[j]:
        flags.append("win")
    if sched.is_look and tl.harms[j]:
        flags.append("harm")
    unstable = bool(np.isfinite(f_p[j]) and f_p[j] < UNSTABLE_P)
    if unstable:
        flags.append("unstable")
    n, c = int(base.count[j]), int(chal.count[j])
    proto = get_protocol(cfg.protocol)
    return TaskResult(
        task=name,
        baseline_runs=n,
        challenger_runs=c,
        failed_runs=int(failed[j]),
        baseline_mean=sign * base.mean[j],
        challenger_mean=sign * chal.mean[j],
        delta=sign * test.delta[j],
        ci_low=ci[0],
        ci_high=ci[1],
        sigma=test.se[j] / proto.se_factor(n, count) if n and count else None,
        prior_df=int(prior_df[j]),
        df=test.df[j],
        t=test.t[j],
        boundary=upper[j],
        p_nominal=tl.p_nominal[j],
        p=tl.p[j],
        q=tl.q[j],
        flags=flags,
        variance_ratio_p=f_p[j],
        welch=_welch_record(welch, j, sign, cfg.alpha) if unstable else None,
        mde_next=_task_mde(cfg, sched, bounds[j], test, base, count, weight[j], prior_df[j], j, m),
        pairs=proto.pairs(count),
        pairs_dropped=pairs_dropped,
    )


def _fmt(v: float | None) -> str:
    return "—" if v is None else f"{v:+.3f}"


def _welch_record(w: TwoSample, j: int, sign: float, alpha: float) -> WelchResult:
    crit = float(sps.t.isf(alpha, w.df[j])) if np.isfinite(w.df[j]) else math.nan
    lo, hi = w.delta[j] - crit * w.se[j], w.delta[j] + crit * w.se[j]
    p = float(2 * sps.t.sf(abs(w.t[j]), w.df[j])) if np.isfinite(w.t[j]) else math.nan
    return WelchResult(
        delta=sign * w.delta[j], ci_low=min(sign * lo, sign * hi), ci_high=max(sign * lo, sign * hi), df=w.df[j], p=p
    )


def _next_crit(cfg: GateConfig, n: int, counts: tuple[int, ...], planned_max: int, prior_df: int, weight: float) -> float | None:
    """The next look's boundary, for the minimum detectable effect (a report: nothing decides on it).
    Its prior df is rounded down to a power of two, so the hypothetical schedule's calibration is
    shared by every look of a lab whose history grows (a slightly larger, conservative MDE)."""
    prior_df = 1 << (int(prior_df).bit_length() - 1) if prior_df > 0 else 0
    b = _boundaries(cfg, n, counts, planned_max, prior_df, weight)
    return b.upper[-1] if b else None


def _task_mde(
    cfg: GateConfig,
    sched: _Schedule,
    bounds: Boundaries | None,
    test: TwoSample,
    base: Arm,
    count: int,
    weight: float,
    prior_df: int,
    j: int,
    m: int,
) -> float | None:
    """Smallest improvement (metric units) the task's test would detect at the next planned look.
    `count`: the challenger runs (pairs for `paired`) the test stands on now."""
    if sched.next_look is None or bounds is None or not np.isfinite(test.se[j]) or count < 1:
        return None
    proto = get_protocol(cfg.protocol)
    n, c = int(base.count[j]), count
    m_next = c + (sched.next_look - m)
    n_next = proto.next_baseline_runs(n, m_next)
    sigma = test.se[j] / proto.se_factor(n, c)
    crit = _next_crit(cfg, n_next, bounds.looks + (m_next,), sched.planned[-1] - (m - c), prior_df, weight)
    if crit is None or not np.isfinite(crit) or sigma <= 0:
        return None
    return mde_at(sigma * proto.se_factor(n_next, m_next), proto.df(n_next, m_next, weight), crit, False,
                  DEFAULT_POWER)


def _horizontal_mde(proto: GateProtocol, cfg: GateConfig, sched: _Schedule, hb: np.ndarray, hc: np.ndarray,
                    test: TwoSample) -> float | None:
    """Smallest horizontal improvement (σ units) detectable at the next planned look. `hc`: what the
    horizontal test stands on (the challenger's per-seed values, or their paired differences)."""
    n, c = int(np.isfinite(hb).sum()), int(np.isfinite(hc).sum())
    if sched.next_look is None or c < 1 or not np.isfinite(test.se) or test.se <= 0:
        return None
    m_next = c + (sched.next_look - int(hc.shape[-1]))
    n_next = proto.next_baseline_runs(n, m_next)
    sigma = float(test.se) / proto.se_factor(n, c)
    counts = _counts_at(hc, sched.seeds) + (m_next,)
    crit = _next_crit(cfg, n_next, counts, sched.planned[-1], 0, 0.0)
    if crit is None or not np.isfinite(crit):
        return None
    return mde_at(sigma * proto.se_factor(n_next, m_next), proto.df(n_next, m_next, 0.0), crit, False,
                  DEFAULT_POWER)


def _worst_case(inp: GateInput) -> GateResult:
    """The same look with every failed challenger run replaced by its task's worst observed value."""
    hib = inp.config.higher_is_better
    tasks = []
    for t in inp.tasks:
        seen = [v for v in t.baseline_values() + t.challenger_values() + t.extra_history() if not math.isnan(v)]
        worst = (min(seen) if hib else max(seen)) if seen else math.nan
        chal = [worst if math.isnan(v) else v for v in t.challenger_values()]
        tasks.append(TaskRuns(task=t.task, baseline=t.baseline, challenger=chal, history=t.history))
    return _evaluate(inp.model_copy(update={"tasks": tasks}), with_sensitivity=False)


def _reasons(
    verdict: Verdict | None,
    tl: TaskLook,
    hl: HorizontalLook,
    h_upper: float,
    names: list[str],
    failed: int,
    cfg: GateConfig,
    sched: _Schedule,
    top: int,
) -> list[str]:
    """Plain-language grounds for the verdict (empty between looks: no verdict, no labels)."""
    if verdict is None:
        return []
    t, out = float(hl.test.t), []
    harms = [names[j] for j in np.flatnonzero(tl.harms)]
    wins = [names[j] for j in np.flatnonzero(tl.wins)]
    if harms:
        out.append(f"harm on {', '.join(harms)} ({get_protocol(cfg.protocol).harm_rule(cfg.harm_q)})")
    if hl.down:
        out.append(f"horizontal t {t:.2f} ≤ -{h_upper:.2f}: the tasks got worse together")
    if failed >= 2:
        out.append(f"{failed} failed challenger runs: not promising")
    if hl.up and not hl.breadth_up:
        out.append(
            f"horizontal t {t:.2f} crossed {h_upper:.2f} but not without {names[top]}, which stands out "
            f"(t {float(hl.breadth.t):.2f}): driven by one task"
        )
    elif hl.up:
        out.append(f"horizontal t {t:.2f} ≥ boundary {h_upper:.2f}")
    else:
        out.append(f"horizontal t {t:.2f} < boundary {h_upper:.2f}")
    if verdict is Verdict.escalate:
        out.append(f"horizontal one-sided p {float(hl.p_up):.3f} < futility_p {cfg.futility_p}: run to {sched.next_look}")
    elif verdict is Verdict.futile and failed < 2:
        out.append(f"horizontal one-sided p {float(hl.p_up):.3f} ≥ futility_p {cfg.futility_p}")
    if wins:
        out.append(f"per-task wins: {', '.join(wins)}")
    return out
