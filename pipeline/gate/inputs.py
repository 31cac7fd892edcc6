"""What the gate is given: the runs of one hypothesis at one look, and the gate's configuration.

The execution layer builds a `GateInput` from its run records and calls `evaluate`. Shape:

- one `TaskRuns` per task: `baseline` and `challenger` metric values **by seed** (position k is
  seed k; seed k of an arm is one run on every task, so positions pair up across tasks), and
  `history`, runs of the current baseline commit on that task (the variance prior; `judge_look`
  gives the ones the look waits for and those finished before the comparison was first recorded);
- a failed challenger run (method failure: NaN, divergence, crash in branch code) is `None` or NaN
  at its seed's position; a run not finished yet is simply absent (a shorter list);
- `config`: the `[gate]` section plus the benchmark's `higher_is_better`.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from pipeline.errors import UserError
from pipeline.gate.protocol import PROTOCOLS, check_name, get_protocol

DEFAULT_PROTOCOL = "paired"  # `[gate] protocol` unset; looks, alpha and futility_p unset take its defaults
NOISE_RUNS = 5  # `[gate] noise_runs` unset: the lab's first comparison waits for this many baseline runs per task
REPLICATE_RUNS = 0  # `[gate] replicate_runs` unset (paired): no replication step
MIN_REPLICATE_RUNS = 2  # the replication's t test needs a spread within each task
MIN_NOISE_RUNS = 4  # the lazy baseline's 2 seeds at looks 1-2 plus 2 more: an arm's spread needs 2 runs off the pairs



class GateConfig(BaseModel):
    """The gate's configuration: research.toml's `[gate]` section, one model for both (the lab's
    loader fills `higher_is_better` from `[benchmark]`; a `[gate]` key of that name is refused).

    `implausible_*` are the hold rule of `pipeline.gate.plausibility`: a verdict they flag is never
    promoted without a human. `protocol` is a name in `pipeline.gate.protocol.PROTOCOLS`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    # `paired`: the arms share seed k, so the test is on the paired differences
    protocol: str = DEFAULT_PROTOCOL
    # at most: the baseline is measured once and serves every challenger of it; with `paired` its
    # seed k is run only when a challenger first needs seed k (the lazy baseline). 10 instead of 5,
    # with the trimmed mean below, lifted `sequential`'s power at 0.5σ from 0.42 to 0.66 (gate-sim, ρ 0.02)
    baseline_runs: int = Field(default=10, ge=2)
    # challenger runs per task at each look; default (1, 2, 5, 10) for `paired` (a look at one pair
    # can stop a hypothesis, never promote it), (2, 5, 10) for the two-sample protocols
    looks: tuple[int, ...] = get_protocol(DEFAULT_PROTOCOL).default_looks
    # baseline runs per task a lab's first comparison waits for when the lab has measured no noise yet
    # (no comparison, no variance study), so its first looks stand on a measured σ instead of one pair's
    # 1 df (`Experiment.noise_study`; paired only: the two-sample protocols run every baseline seed up
    # front). Default min(5, baseline_runs); 0: no wait. Under 4 it adds nothing to a look of 1-2 pairs.
    noise_runs: int = Field(default=NOISE_RUNS, ge=0)
    # a promotion the gate granted is first repeated on this many fresh seeds per task (old baseline and
    # challenger, paired), and carried out only if a one-sided t test of their horizontal mean Δ passes
    # at `replicate_alpha` (`pipeline.gate.replication`); paired only; 0: promote on the gate's verdict
    replicate_runs: int = Field(default=REPLICATE_RUNS, ge=0)
    replicate_alpha: float = Field(default=0.10, gt=0, lt=0.5)
    # one-sided, improvement side; default the protocol's (paired 0.01, the two-sample ones 0.025)
    alpha: float = Field(default=get_protocol(DEFAULT_PROTOCOL).default_alpha, gt=0, lt=0.5)
    # "lond": each comparison is the next test of the lab's stream, at LOND's α_i (never above alpha),
    # so the stream's false discovery rate stays under `fdr` (pipeline.gate.online_fdr); "off": alpha each
    online_fdr: Literal["off", "lond"] = "off"
    fdr: float = Field(default=0.05, gt=0, lt=0.5)
    # a look escalates only while the horizontal one-sided p is below this; default the protocol's
    # (paired 0.20, the two-sample ones 0.30)
    futility_p: float = Field(default=get_protocol(DEFAULT_PROTOCOL).default_futility_p, gt=0, lt=1)
    harm_q: float = Field(default=0.10, gt=0, lt=1)
    # the horizontal statistic's trim at each end of the tasks (0.25: the interquartile mean)
    horizontal_trim: float = Field(default=0.125, ge=0, lt=0.5)
    implausible_fraction: float = Field(default=0.5, gt=0, le=1)
    implausible_sigma: float | None = Field(default=None, gt=0)
    higher_is_better: bool = True

    @field_validator("protocol")
    @classmethod
    def _known(cls, name: str) -> str:
        return check_name(name)

    @model_validator(mode="before")
    @classmethod
    def _protocol_defaults(cls, data: Any) -> Any:
        """looks, alpha and futility_p left unset take the protocol's own (an unknown one: said below)."""
        if not isinstance(data, dict):
            return data
        name = data.get("protocol", DEFAULT_PROTOCOL)
        if not (isinstance(name, str) and name in PROTOCOLS):
            return data
        proto = get_protocol(name)
        own = {"looks": proto.default_looks, "alpha": proto.default_alpha, "futility_p": proto.default_futility_p}
        data = {**data, **{k: v for k, v in own.items() if data.get(k) is None}}
        if data.get("noise_runs") is None:
            b = data.get("baseline_runs", 10)  # TOML may say 10.0: coerced to 10 below, and so here
            if not proto.reads_lab_history():
                data["noise_runs"] = 0  # the two-sample protocols run every baseline seed at their first look
            elif isinstance(b, int | float) and not isinstance(b, bool) and float(b).is_integer():
                n = min(NOISE_RUNS, int(b))
                data["noise_runs"] = n if n >= MIN_NOISE_RUNS else 0
        if data.get("replicate_runs") is None:
            data["replicate_runs"] = REPLICATE_RUNS if proto.reads_lab_history() else 0
        return data

    @field_validator("looks")
    @classmethod
    def _increasing(cls, looks: tuple[int, ...]) -> tuple[int, ...]:
        if not looks or looks[0] < 1 or any(b <= a for a, b in zip(looks, looks[1:])):
            raise ValueError("expected strictly increasing run counts, the first at least 1 (2 unless paired)")
        return tuple(looks)

    @model_validator(mode="after")
    def _fits_protocol(self) -> "GateConfig":
        problem = get_protocol(self.protocol).looks_problem(self.looks, self.baseline_runs)
        if problem is not None:
            raise ValueError(problem)
        if self.noise_runs and get_protocol(self.protocol).reads_lab_history():
            if self.baseline_runs < MIN_NOISE_RUNS:
                raise ValueError(f"expected noise_runs 0 (baseline_runs {self.baseline_runs} is under "
                                 f"{MIN_NOISE_RUNS}, too few for a noise study), got {self.noise_runs}")
            if not MIN_NOISE_RUNS <= self.noise_runs <= self.baseline_runs:
                raise ValueError(f"expected noise_runs 0 (no noise study) or {MIN_NOISE_RUNS} to baseline_runs "
                                 f"({self.baseline_runs}), got {self.noise_runs}")
        if self.replicate_runs:
            if not get_protocol(self.protocol).reads_lab_history():
                raise ValueError(f"expected replicate_runs 0: protocol {self.protocol!r} does not pair the arms "
                                 f"(the replication step is the paired protocol's), got {self.replicate_runs}")
            if not MIN_REPLICATE_RUNS <= self.replicate_runs <= self.baseline_runs:
                raise ValueError(f"expected replicate_runs 0 (no replication) or {MIN_REPLICATE_RUNS} to "
                                 f"baseline_runs ({self.baseline_runs}), got {self.replicate_runs}")
        return self


def _value(v: float | None) -> float:
    return math.nan if v is None else float(v)


class TaskRuns(BaseModel):
    """One task's runs. Lists are by seed; None or NaN marks a failed (or lost) run."""

    model_config = ConfigDict(extra="forbid")

    task: str = Field(min_length=1)
    baseline: list[float | None]
    challenger: list[float | None] = Field(default_factory=list)
    history: list[float | None] = Field(default_factory=list)

    @field_validator("baseline", "challenger", "history")
    @classmethod
    def _no_infinity(cls, values: list[float | None]) -> list[float | None]:
        if any(v is not None and math.isinf(v) for v in values):
            raise ValueError("expected finite metric values (None or NaN for a failed run)")
        return values

    @field_validator("baseline")
    @classmethod
    def _two_baseline_runs(cls, values: list[float | None]) -> list[float | None]:
        if sum(1 for v in values if v is not None and not math.isnan(v)) < 2:
            raise ValueError("expected at least 2 successful baseline runs")
        return values

    def baseline_values(self) -> list[float]:
        return [_value(v) for v in self.baseline]

    def challenger_values(self) -> list[float]:
        return [_value(v) for v in self.challenger]

    def failed(self) -> int:
        """Method failures among this task's challenger runs."""
        return sum(1 for v in self.challenger_values() if math.isnan(v))

    def extra_history(self) -> list[float]:
        """History runs that are not among the baseline runs, so none is counted twice.

        The history is "all runs of the baseline commit", which includes the comparison's own
        baseline runs; they are matched by value (the same run gives the same float) and removed.
        """
        pool = [_value(v) for v in self.history if v is not None and not math.isnan(_value(v))]
        for v in self.baseline_values():
            if not math.isnan(v) and v in pool:
                pool.remove(v)
        return pool


class GateInput(BaseModel):
    """Everything `evaluate` needs for one look of one hypothesis."""

    model_config = ConfigDict(extra="forbid")

    config: GateConfig = GateConfig()
    tasks: list[TaskRuns] = Field(min_length=1)
    # `paired`: the lab's earlier comparisons, each {task: [challenger_k - baseline_k by seed]}
    # (None = no pair), the variance prior of the paired differences
    pair_history: list[dict[str, list[float | None]]] = Field(default_factory=list)
    # `paired`: runs of the lab's earlier arms (commits other than this comparison's), each
    # {task: [metric by seed]} (None = no run): the unpaired bound on the paired variance, and σ_task
    arm_history: list[dict[str, list[float | None]]] = Field(default_factory=list)
    looks_done: list[int] | None = None  # earlier looks' challenger counts; default: planned looks below now
    at_look: bool | None = None  # None: a look iff all tasks have the same count and it is planned

    @model_validator(mode="after")
    def _unique_tasks(self) -> "GateInput":
        names = [t.task for t in self.tasks]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"expected unique task names, got duplicates {dupes}")
        if max(len(t.challenger) for t in self.tasks) < 1:
            raise ValueError("expected at least one challenger run")
        return self

    @property
    def challenger_count(self) -> int:
        """The look's challenger run count: the longest task's seed count (failed runs included)."""
        return max(len(t.challenger) for t in self.tasks)


def parse_input(data: Any) -> GateInput:
    """Validate a dict (e.g. from JSON) into a `GateInput`; errors become one-line `UserError`s."""
    try:
        return data if isinstance(data, GateInput) else GateInput.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "input"
        raise UserError(f"gate input: {where}: {err['msg'].removeprefix('Value error, ')}") from None
