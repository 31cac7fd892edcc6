"""The lab contract: `research.toml` loaded into typed models, checked before anything runs.

Every mistake becomes a `LabConfigError` naming the file, the key and what was expected, so the
CLI can print one line and exit 2 instead of failing halfway through a night of runs.
"""

from __future__ import annotations

import functools
import glob
import re
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator, model_validator

from pipeline.errors import LabConfigError, UserError
from pipeline.gate.inputs import GateConfig
from pipeline.labnames import BASELINE_BRANCH, CONFIG_NAME, PLACEHOLDER  # noqa: F401 (re-exported)
from pipeline.tomlview import Seen

if TYPE_CHECKING:
    from pipeline.harness import Harness
    from pipeline.environment import Environment

BUILTIN_PLACEHOLDERS = {"data", "task", "seed", "out"}
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
DRIVER_ONLY_ENV = {"DATABASE_URL", "RAY_ADDRESS", "MLFLOW_TRACKING_URI"}  # `[run] env` may not name these
# the executor names the GPUs it gives a stage (and the sandbox binds their nodes from them): never the lab
GPU_VISIBILITY_ENV = {"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LabSection(_Strict):
    name: str = Field(min_length=1)
    program: str = "program.md"
    editable: list[str] = Field(min_length=1)


# The metric's best possible value where it is known: a task there is too good to be true.
PERFECT = {"auc": 1.0, "accuracy": 1.0, "logloss": 0.0, "rmse": 0.0, "mae": 0.0}


class BenchmarkSection(_Strict):
    harness: str = "transactions"
    suite: str = "small"
    metric: str = "auc"
    higher_is_better: StrictBool = True  # strict: a string like "no" is a mistake, not a bool
    perfect: float | None = None  # the metric's best value; known for PERFECT's metrics
    data_seed: int = Field(default=0, ge=0)
    tasks: list[str] | None = None  # a subset of the suite (bundled harness); the task list (command)
    customers: int | None = Field(default=None, ge=200)  # dataset size override (tests, smoke runs)
    # harness = "command" (a lab's own data preparation and scorer, from the trusted commit)
    trusted: list[str] = Field(default_factory=list)
    prepare: str | None = None
    score: str | None = None

    def perfect_value(self) -> float | None:
        return self.perfect if self.perfect is not None else PERFECT.get(self.metric)


class StageSpec(_Strict):
    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_-]*$")
    run: str = Field(min_length=1)
    scope: Literal["seed", "run"] = "run"
    needs: list[str] = Field(default_factory=list)
    inputs: list[str] = Field(default_factory=list)


# A stage with the network shares the host's network namespace: loopback included, so it can reach
# `autoresearch serve` and a store's PostgreSQL on this machine (their own checks are all that stand)
NETWORK_WARNING = ("[run] network = true: stages share the host's network and can reach the review page "
                   "(autoresearch serve) and a PostgreSQL store on this machine; prefer network = false")


MAX_GPUS = 8  # GPUs one stage may hold (one machine's)
SHM_MB = 64  # a stage's private /dev/shm without a GPU (sandbox.DEFAULTS["shm_max_mb"]): tmpfs, so RAM
MIN_GPU_SHARE = 0.01  # a finer share is a typo (and would make `capacity` count for ever)
SHM_GPU_MIN_MB = 1024  # a stage given a share of a GPU: a DataLoader's batches still pass through it
SHM_GPU_MB = 2048  # per GPU a stage holds: NCCL's shared-memory transport and DataLoader workers
MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class RunSection(_Strict):
    timeout_s: float = Field(default=900, gt=0)
    cpus: int = Field(default=1, ge=1)
    # a share of one GPU (0.25: four stages on one GPU) or whole GPUs (1..8) per stage
    gpus: float = Field(default=0, ge=0, le=MAX_GPUS)
    # `prepare` and `score` (run once, by the harness): no GPU unless the lab gives them one
    prepare_gpus: float = Field(default=0, ge=0, le=MAX_GPUS)
    score_gpus: float = Field(default=0, ge=0, le=MAX_GPUS)
    shm_mb: int | None = Field(default=None, gt=0)  # a stage's /dev/shm; None: from gpus (`shm_size_mb`)
    retries: int = Field(default=2, ge=0)
    memory_mb: int | None = Field(default=None, gt=0)
    sandbox: Literal["auto", "off"] = "auto"  # "off": an explicit opt-out, shown as UNSANDBOXED
    network: StrictBool = False  # strict: `network = "yes"` must not open the network by coercion
    out_max_mb: int = Field(default=4096, gt=0)  # size of a stage's {out}
    tmp_max_mb: int = Field(default=1024, gt=0)  # size of a stage's private /tmp
    max_procs: int = Field(default=256, ge=8)  # processes (and threads) one stage may run
    cache_max_gb: float | None = Field(default=50.0, gt=0)  # the stage cache, LRU-evicted past it
    logs_max_mb: int = Field(default=2048, gt=0)  # stage logs, oldest removed past it
    # the driver's variables a stage may see beyond the allow-list (PATH, locale, threads: executors.base)
    env: tuple[str, ...] = ()
    # the modules a warm worker imports once, before it forks stages (None: numpy, torch and peft)
    preload: list[str] | None = None
    # the distributions whose versions make the measurement environment (`pipeline.environment`);
    # None: the numerical stack (`DEFAULT_PACKAGES`), ["*"]: every installed distribution
    environment: list[Annotated[str, Field(min_length=1)]] | None = None
    # re-measure the baseline when the loop starts in another environment than its runs' (an empty commit)
    remeasure_on_change: StrictBool = True

    def environment_of(self, facts: dict[str, Any]) -> "Environment":
        """The measurement environment `facts` (`environment.node_facts`) make for this lab."""
        from pipeline.environment import DEFAULT_PACKAGES, Environment
        from pipeline.executors.base import STAGE_ENV_VERSION

        gpu = max(self.gpus, self.prepare_gpus, self.score_gpus) > 0
        return Environment.of(facts, DEFAULT_PACKAGES if self.environment is None else self.environment, gpu=gpu,
                              stage_env=STAGE_ENV_VERSION)

    @field_validator("preload")
    @classmethod
    def _module_names(cls, names: list[str] | None) -> list[str] | None:
        for name in names or []:
            if not MODULE_NAME.match(name):
                raise ValueError(f"a module name such as \"torch\" or \"my_pkg.models\", not {name!r}")
        return names

    @field_validator("gpus", "prepare_gpus", "score_gpus")
    @classmethod
    def _gpu_share(cls, share: float) -> float:
        if share > 1 and share != int(share):
            raise ValueError(f"a share of one GPU (0 < gpus <= 1, e.g. 0.25) or a whole number of GPUs, not {share:g}")
        if 0 < share < MIN_GPU_SHARE:
            raise ValueError(f"a share of at least {MIN_GPU_SHARE:g} of one GPU (0 for none), not {share:g}")
        return share

    def shm_size_mb(self) -> int:
        """A stage's /dev/shm: `shm_mb`, else SHM_MB without a GPU and SHM_GPU_MB per GPU it holds
        (a share of one: its part, at least SHM_GPU_MIN_MB; NCCL and DataLoader workers pass tensors
        through it; tmpfs takes RAM only as it fills, and four stages sharing a GPU must not take four
        GPUs' worth)."""
        if self.shm_mb is not None:
            return self.shm_mb
        return SHM_MB if not self.gpus else max(SHM_GPU_MIN_MB, int(SHM_GPU_MB * self.gpus))

    @field_validator("env", mode="before")
    @classmethod
    def _env_names(cls, names: Any) -> Any:
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError("a list of environment variable names, e.g. env = [\"HF_HOME\"]")
        for name in names:
            if not ENV_NAME.match(name):
                raise ValueError(f"an environment variable name (letters, digits, _), not {name!r}")
            if name in DRIVER_ONLY_ENV or name.startswith(("AUTORESEARCH_", "OPENAI_")):
                raise ValueError(f"a name other than {name}: the driver's own (store, LLM, cluster) stay hidden")
            if name in GPU_VISIBILITY_ENV:
                raise ValueError(f"a name other than {name}: the executor sets it to the GPUs it gives a stage "
                                 "([run] gpus)")
        return tuple(names)


# Seeds (the scheme is pipeline.experiment's): a baseline with g promotions owns the block
# g * SEED_BLOCK + i (g modulo SEED_BLOCKS): its own runs and its challengers' first seeds.
SEED_BLOCK = 1000
SEED_BLOCKS = 1000


# `[gate]` is the gate's own configuration model (one model, one set of bounds)
GateSection = GateConfig


# research.toml's tables that belong to the pipeline's client (the agent's `[agent]` and `[notify]`):
# kept raw, never read here, validated by the client's own model (`parse_client_tables`)
CLIENT_TABLES = ("agent", "notify")


class ResearchConfig(_Strict):
    lab: LabSection
    benchmark: BenchmarkSection = BenchmarkSection()
    stage: list[StageSpec] = Field(min_length=1)
    run: RunSection = RunSection()
    gate: GateSection = GateSection()
    search_space: dict[str, list[Any]] = Field(default_factory=dict)
    # the client's tables, raw: `parse_client_tables` validates them with the client's model
    agent: dict[str, Any] = Field(default_factory=dict)
    notify: dict[str, Any] = Field(default_factory=dict)

    @field_validator("search_space")
    @classmethod
    def _space(cls, space: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for key, values in space.items():
            if not re.fullmatch(r"[A-Za-z_][\w-]*\.[A-Za-z_][\w-]*", key):
                raise ValueError(f"key {key!r}: expected 'section.key' of config.toml")
            if not values:
                raise ValueError(f"key {key!r}: expected a non-empty list of values")
        return space

    @model_validator(mode="before")
    @classmethod
    def _direction(cls, raw: Any) -> Any:
        """The gate reads the metric's direction from `[benchmark]`, never from `[gate]`."""
        if not isinstance(raw, dict) or not isinstance(raw.get("gate", {}), dict):
            return raw
        gate = raw.get("gate", {})
        if "higher_is_better" in gate:
            raise LabConfigError(None, "gate.higher_is_better",
                                   "not a [gate] key: the metric's direction is [benchmark] higher_is_better")
        bench = raw.get("benchmark", {})
        hib = bench.get("higher_is_better", True) if isinstance(bench, dict) else True
        return {**raw, "gate": {**gate, "higher_is_better": hib}} if isinstance(hib, bool) else raw

    @model_validator(mode="after")
    def _dag(self) -> "ResearchConfig":
        check_stage_graph(self.stage)
        if self.gate.looks[-1] > SEED_BLOCK:
            raise LabConfigError(None, "gate.looks", f"expected at most {SEED_BLOCK} runs at the last look")
        if self.gate.baseline_runs > SEED_BLOCK:
            raise LabConfigError(None, "gate.baseline_runs", f"expected at most {SEED_BLOCK}")
        return self


def check_stage_graph(stages: list[StageSpec]) -> list[StageSpec]:
    """Unique names, known needs, placeholders that exist, no cycles, exactly one final stage.

    Returns the stages in a topological order.
    """
    names = [s.name for s in stages]
    by_name = {s.name: s for s in stages}
    for i, s in enumerate(stages):
        key = f"stage[{i}]"
        if s.name in names[:i]:
            raise LabConfigError(None, f"{key}.name", f"duplicate stage name {s.name!r}")
        if s.name in BUILTIN_PLACEHOLDERS:
            raise LabConfigError(None, f"{key}.name", f"{s.name!r} is reserved; expected another name")
        for need in s.needs:
            if need not in by_name:
                raise LabConfigError(None, f"{key}.needs", f"unknown stage {need!r}; expected one of {names}")
            if s.scope == "seed" and by_name[need].scope == "run":
                raise LabConfigError(
                    None, f"{key}.needs", f"seed-scoped stage {s.name!r} cannot need run-scoped {need!r}"
                )
        for ph in PLACEHOLDER.findall(s.run):
            if ph in BUILTIN_PLACEHOLDERS:
                if ph == "task" and s.scope == "seed":
                    raise LabConfigError(
                        None, f"{key}.run", "{task} in a seed-scoped stage; expected scope = \"run\""
                    )
                continue
            if ph not in s.needs:
                raise LabConfigError(
                    None, f"{key}.run",
                    f"placeholder {{{ph}}} is not a built-in ({', '.join(sorted(BUILTIN_PLACEHOLDERS))}) "
                    f"or a stage listed in needs",
                )
    order: list[StageSpec] = []
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            cycle = " -> ".join(path[path.index(name):] + [name])
            raise LabConfigError(None, "stage.needs", f"stage cycle {cycle}; expected a DAG")
        state[name] = 1
        for need in by_name[name].needs:
            visit(need, path + [name])
        state[name] = 2
        order.append(by_name[name])

    for name in names:
        visit(name, [])
    needed = {n for s in stages for n in s.needs}
    finals = [s.name for s in stages if s.name not in needed]
    if len(finals) != 1:
        raise LabConfigError(None, "stage", f"expected exactly one final stage (writing predictions.csv), found {finals}")
    if by_name[finals[0]].scope != "run":
        raise LabConfigError(None, "stage", f"final stage {finals[0]!r} must have scope = \"run\"")
    return order


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.startswith("function-") or part in {"literal_error"}:
            continue
        else:
            out += ("." if out else "") + str(part)
    return out


def _known_keys(loc: tuple[Any, ...], root: type[BaseModel] | None = None) -> list[str]:
    """The keys of the table at `loc` (e.g. ("benchmark",), ("stage", 0)) of `root` (default: the whole
    `ResearchConfig`), or [] if it is not a model."""
    model: Any = root or ResearchConfig
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return []
        inner = [a for a in (field.annotation, *get_args(field.annotation))
                 if isinstance(a, type) and issubclass(a, BaseModel)]
        if not inner:
            return []
        model = inner[0]
    return list(model.model_fields)


def _explain(err: dict[str, Any], root: type[BaseModel] | None = None) -> str:
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        known = _known_keys(err["loc"][:-1], root)
        return (f"unknown key; expected one of {', '.join(known)}" if known else "unknown key") + \
            " (README: The lab)"
    if err["type"] == "missing":
        return "missing; this key is required"
    msg = msg.removeprefix("Value error, ")
    got = err.get("input")
    if err["type"] not in {"value_error"} and not isinstance(got, (dict, list)):
        msg += f", got {got!r}"
    return "expected " + msg[0].lower() + msg[1:] if not msg.startswith("expected") else msg


def parse_config(text: str, path: str | Path = CONFIG_NAME) -> ResearchConfig:
    """Parse and validate research.toml text; raise `LabConfigError` on any problem."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise LabConfigError(path, "", f"not valid TOML ({e})") from None
    return _validated(ResearchConfig, raw, path)


M = TypeVar("M", bound=BaseModel)


def _validated(model: type[M], raw: Any, path: str | Path) -> M:
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        ctx = err.get("ctx", {}).get("error")
        if isinstance(ctx, LabConfigError):
            raise LabConfigError(path, ctx.key, str(ctx)) from None
        raise LabConfigError(path, _loc(err["loc"]), _explain(err, model)) from None


def parse_client_tables(model: type[M], config: ResearchConfig, path: str | Path = CONFIG_NAME) -> M:
    """A client's own tables of research.toml (`CLIENT_TABLES`: the agent's `[agent]` and `[notify]`),
    validated with the client's model: a mistake is the same one-line `LabConfigError` as one in the
    pipeline's tables (the file, the key, what was expected)."""
    raw = {t: getattr(config, t) for t in CLIENT_TABLES if t in model.model_fields}
    return _validated(model, raw, path)


class Lab:
    """A lab on disk: its root, its parsed config and the paths of its state folder (`runs/`)."""

    def __init__(self, root: Path, config: ResearchConfig):
        self.root = root
        self.config = config

    @property
    def config_path(self) -> Path:
        return self.root / CONFIG_NAME

    @property
    def state(self) -> Path:
        return self.root / "runs"

    def stages_in_order(self) -> list[StageSpec]:
        return check_stage_graph(list(self.config.stage))

    def is_editable(self, path: str) -> bool:
        return any(glob_match(path, g) for g in self.config.lab.editable)

    def is_trusted(self, path: str) -> bool:
        return any(glob_match(path, g) for g in self.config.benchmark.trusted)

    def stage_sees(self, stage: StageSpec, path: str) -> Seen | None:
        """What `stage` sees of the file at `path`, the one rule every view of a stage follows (the
        driver's, `Worktrees.view`; the smoke run's). Hermetic stages: of the editable files, only
        those its `inputs` declare; the trusted harness files never (a stage that could run
        `prepare` would regenerate the labels), None for both. A file its inputs name only by tables
        (`config.toml#pretrain`: that exact path) is seen as a TOML file of just those tables, all
        its cache key covers; any other file whole."""
        if self.is_trusted(path):
            return None
        if any("#" not in p and glob_match(path, p) for p in stage.inputs):
            return Seen()
        tables = tuple(t for f, sep, t in (p.partition("#") for p in stage.inputs) if sep and f == path)
        if tables:
            return Seen(tables)
        return None if self.is_editable(path) else Seen()

    def config_warnings(self) -> list[str]:
        """One line each for what the configuration allows and the sandbox cannot prevent (`check`)."""
        run = self.config.run
        out = []
        if run.network:
            out.append(NETWORK_WARNING)
        return out

    def undeclared_editable(self, paths: list[str]) -> list[str]:
        """Editable files no stage declares as an input: no stage can read them (`check` says so)."""
        return [p for p in paths if self.is_editable(p)
                and not any(self.stage_sees(s, p) for s in self.config.stage)]

    def harness(self) -> "Harness":
        """The lab's harness, bound to this lab."""
        from pipeline.harness import get_harness

        return get_harness(self.config.benchmark.harness).bind(self)

    def tasks(self) -> list[str]:
        return self.harness().tasks(self.config.benchmark.suite, self.config.benchmark.tasks)


def load_lab(root: str | Path, check_files: bool = True) -> Lab:
    """Load and fully validate the lab at `root`: config, harness, suite, tasks, editable files."""
    root = Path(root).resolve()
    path = root / CONFIG_NAME
    if not path.is_file():
        raise UserError(f"{root}: no {CONFIG_NAME} here; create a lab with `autoresearch init DIR`")
    config = parse_config(path.read_text(encoding="utf-8"), path)
    validate_against_harness(config, path)
    if check_files:
        _check_files(root, config, path)
    return Lab(root, config)


def validate_against_harness(config: ResearchConfig, path: str | Path) -> None:
    from pipeline.harness import HARNESSES, get_harness

    bench = config.benchmark
    if bench.harness not in HARNESSES:
        raise LabConfigError(path, "benchmark.harness", f"unknown harness {bench.harness!r}; expected one of {sorted(HARNESSES)}")
    get_harness(bench.harness).validate(config, Path(path))


def glob_match(path: str, pattern: str) -> bool:
    """Match a POSIX lab-relative path against a glob: `*` and `?` stay within one folder, `**/`
    spans folders. The one definition used for `editable` and stage `inputs`."""
    return _glob_regex(pattern).match(path) is not None


@functools.lru_cache(maxsize=256)
def _glob_regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        else:
            out, i = out + {"*": "[^/]*", "?": "[^/]"}.get(pattern[i], re.escape(pattern[i])), i + 1
    return re.compile(out + r"\Z")


def _check_files(root: Path, config: ResearchConfig, path: Path) -> None:
    if not (root / config.lab.program).is_file():
        raise LabConfigError(path, "lab.program", f"file {config.lab.program!r} not found in the lab")
    for pattern in config.lab.editable:
        _check_glob(root, pattern, path, "lab.editable")
    for i, stage in enumerate(config.stage):
        for pattern in stage.inputs:  # `file.toml#table` keys the stage on one table of the file
            file, sep, _ = pattern.partition("#")
            if sep and ("*" in file or "?" in file):
                raise LabConfigError(path, f"stage[{i}].inputs", f"{pattern!r}: expected one file's path before '#', "
                                     "not a glob (the stage sees, and is keyed on, that file's tables)")
            _check_glob(root, file, path, f"stage[{i}].inputs")
    for pattern in config.benchmark.trusted:
        _check_glob(root, pattern, path, "benchmark.trusted")
        for f in _glob_files(root, pattern):
            rel = Path(f).relative_to(root).as_posix()
            if any(glob_match(rel, g) for g in config.lab.editable):
                raise LabConfigError(path, "benchmark.trusted", f"{rel} is both trusted and editable; "
                                     "expected harness files outside lab.editable")


def _check_glob(root: Path, pattern: str, path: Path, key: str) -> None:
    if Path(pattern).is_absolute() or ".." in Path(pattern).parts:
        raise LabConfigError(path, key, f"{pattern!r} leaves the lab; expected a path relative to the lab root")
    if not _glob_files(root, pattern):
        raise LabConfigError(path, key, f"{pattern!r} matches no file in the lab; expected an existing file")


def _glob_files(root: Path, pattern: str) -> list[str]:
    """The files a lab glob matches. Only files: `glob("data/**", recursive=True)` returns "data/"
    itself even when there is no folder `data`, which would let a glob that matches nothing pass."""
    return [f for f in glob.glob(str(root / pattern), recursive=True) if Path(f).is_file()]
