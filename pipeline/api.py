"""The pipeline's one door: everything a client of the measurement layer (the agent, a notebook, a
plugin) may use, and nothing else. `agent/` imports `pipeline` only from here
(`tests/test_door.py` holds it to that).

    from pipeline.api import Experiment, GateResult, Lab, load_lab, open_store

    lab = load_lab("runs/demo-lab")
    exp = Experiment(lab, open_store(lab))
    ids = exp.queue_look(base, commit, look)            # run ids, queued idempotently
    result: GateResult = exp.judge_look(base, commit, look, record_as="12")

What stands here, by the question it answers:
- the lab: `Lab`, `load_lab`, `parse_config`, the names a lab's repository uses (`BASELINE_BRANCH`,
  `CONFIG_NAME`, `SEED_BLOCK`, `glob_match`), its git history (`LabRepo`, `baseline_number`,
  `generation`, `seed_block`), its memory plan, its harnesses' suites;
- measuring: `Experiment` (the measurement protocol: looks, verdicts, champions, smoke runs, the
  execution layer), `ExecutorOptions`, `check_executor`, `open_store`, `Store`; the variance study
  and what the seeds buy (`variance_study`, `pairing_study`, `lab_pairing`);
- the gate's answers: `GateResult` and its renderers, `Replication` (`render_replication`), `Verdict`, `implausible`, the planning tables
  (`power_plan`, `simulate`, `power_table`, `sim_table`);
- the vocabularies: `RunStatus`, `StageOutcome`;
- the machine: `lease` (one driver per lab), `disk_usage`, `read_tail`, `is_sandboxed`,
  `UNSANDBOXED`, `mps_running`;
- the store's seams a client keeps its own tables in: `create_schema`, `rekey`, `GateRecord`;
- `Registry`, the one shape of every seam chosen by name;
- the errors: `PipelineError` is the root of every error the pipeline raises on purpose;
  `UserError` (bad input: one line, exit code 2) and its kinds, `MethodFailure` (the branch's
  code failed), `InfrastructureFailure` (the machine's fault, retried), `Interrupted`.

Every name is imported on first use (PEP 562): `from pipeline.api import Lab` imports the lab's
module only, so the CLI starts without numpy, scipy or torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name → (module, attribute in it)
_WHERE: dict[str, tuple[str, str]] = {
    # the lab
    **{n: ("pipeline.lab", n) for n in ("BASELINE_BRANCH", "CONFIG_NAME", "ENV_NAME", "SEED_BLOCK", "Lab",
                                        "glob_match", "load_lab", "parse_client_tables",
                                        "parse_config")},
    **{n: ("pipeline.labrepo", n) for n in ("LabRepo", "baseline_number")},
    # measuring
    **{n: ("pipeline.experiment", n) for n in ("Experiment", "Reverification", "generation",
                                               "harness_suites", "open_store", "seed_block")},
    "memory_plan": ("pipeline.memory", "memory_plan"),
    "environment_here": ("pipeline.environment", "here"),  # this machine's facts (`RunSection.environment_of`)
    "environment_facts": ("pipeline.environment", "node_facts"),  # ... read again now
    "environment_change": ("pipeline.environment", "change"),
    "environment_unmatched": ("pipeline.environment", "unmatched"),
    "ExecutorOptions": ("pipeline.executors", "ExecutorOptions"),
    "variance_study": ("pipeline.variance", "study"),
    "pairing_study": ("pipeline.variance", "pairing"),
    "lab_pairing": ("pipeline.variance", "lab_pairing"),
    "check_executor": ("pipeline.executors", "check_executor"),
    "Store": ("pipeline.store", "Store"),
    "Goodput": ("pipeline.store.tables", "Goodput"),
    # the gate
    "GateResult": ("pipeline.gate.report", "GateResult"),
    "render_markdown": ("pipeline.gate.report", "render_markdown"),
    "render_table": ("pipeline.gate.report", "render_table"),
    "Replication": ("pipeline.gate.replication", "Replication"),
    "render_replication": ("pipeline.gate.replication", "render_markdown"),
    "Verdict": ("pipeline.outcomes", "Verdict"),
    "gate_protocol": ("pipeline.gate.protocol", "get_protocol"),
    "implausible": ("pipeline.gate.plausibility", "implausible"),
    "power_plan": ("pipeline.gate.power", "plan"),
    "simulate": ("pipeline.gate.sim", "simulate"),
    "power_table": ("pipeline.gate.cli_views", "power_table"),
    "sim_table": ("pipeline.gate.cli_views", "sim_table"),
    # vocabularies
    "RunStatus": ("pipeline.outcomes", "RunStatus"),
    "StageOutcome": ("pipeline.outcomes", "StageOutcome"),
    # the machine
    "lease": ("pipeline", "lease"),
    "disk_usage": ("pipeline.disk", "usage"),
    "read_tail": ("pipeline.disk", "read_tail"),
    "is_sandboxed": ("pipeline.isolation", "is_sandboxed"),
    "UNSANDBOXED": ("pipeline.isolation", "UNSANDBOXED"),
    "mps_running": ("pipeline.executors.gpus", "mps_running"),
    # the store's seams
    "GateRecord": ("pipeline.store", "GateRecord"),
    "create_schema": ("pipeline.store", "create_schema"),
    "rekey": ("pipeline.store.reads", "rekey"),
    "Registry": ("pipeline.registry", "Registry"),
    # errors
    **{n: ("pipeline.errors", n) for n in ("PipelineError", "UserError", "LabConfigError", "MethodFailure",
                                           "InfrastructureFailure", "Interrupted", "PromotionConflict", "UnsafeTree")},
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'pipeline.api' has no attribute {name!r}")
    module, attr = _WHERE[name]
    mod = importlib.import_module(module)
    value = getattr(mod, attr) if hasattr(mod, attr) else importlib.import_module(f"{module}.{attr}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(_WHERE)


__all__ = sorted(_WHERE)

if TYPE_CHECKING:  # the same names, for type checkers and editors
    from pipeline import lease  # noqa: F401
    from pipeline.disk import read_tail  # noqa: F401
    from pipeline.disk import usage as disk_usage  # noqa: F401
    from pipeline.errors import (  # noqa: F401
        InfrastructureFailure,
        Interrupted,
        LabConfigError,
        MethodFailure,
        PipelineError,
        PromotionConflict,
        UnsafeTree,
        UserError,
    )
    from pipeline.executors import ExecutorOptions, check_executor  # noqa: F401
    from pipeline.environment import change as environment_change  # noqa: F401
    from pipeline.environment import here as environment_here  # noqa: F401
    from pipeline.environment import node_facts as environment_facts  # noqa: F401
    from pipeline.environment import unmatched as environment_unmatched  # noqa: F401
    from pipeline.executors.gpus import mps_running  # noqa: F401
    from pipeline.experiment import (  # noqa: F401
        Experiment,
        Reverification,
        generation,
        harness_suites,
        open_store,
        seed_block,
    )
    from pipeline.gate.cli_views import power_table, sim_table  # noqa: F401
    from pipeline.gate.plausibility import implausible  # noqa: F401
    from pipeline.gate.power import plan as power_plan  # noqa: F401
    from pipeline.gate.protocol import get_protocol as gate_protocol  # noqa: F401
    from pipeline.gate.replication import Replication  # noqa: F401
    from pipeline.gate.replication import render_markdown as render_replication  # noqa: F401
    from pipeline.gate.report import GateResult, render_markdown, render_table  # noqa: F401
    from pipeline.gate.sim import simulate  # noqa: F401
    from pipeline.isolation import UNSANDBOXED, is_sandboxed  # noqa: F401
    from pipeline.lab import (  # noqa: F401
        BASELINE_BRANCH,
        CONFIG_NAME,
        ENV_NAME,
        SEED_BLOCK,
        Lab,
        glob_match,
        load_lab,
        parse_client_tables,
        parse_config,
    )
    from pipeline.labrepo import LabRepo, baseline_number  # noqa: F401
    from pipeline.memory import memory_plan  # noqa: F401
    from pipeline.outcomes import (  # noqa: F401
        RunStatus,
        StageOutcome,
        Verdict,
    )
    from pipeline.registry import Registry  # noqa: F401
    from pipeline.store import GateRecord, Store, create_schema  # noqa: F401
    from pipeline.store.reads import rekey  # noqa: F401
    from pipeline.store.tables import Goodput  # noqa: F401
    from pipeline.variance import lab_pairing  # noqa: F401
    from pipeline.variance import pairing as pairing_study  # noqa: F401
    from pipeline.variance import study as variance_study  # noqa: F401
