"""A tiny real lab and hypotheses with real gate records, for the summary, review, picture and digest tests.

The lab is the bundled transactions template made small (300 customers, 2 tasks, 3 baseline runs,
looks at 2 and 3). Most tests need no training: a hypothesis is proposed and implemented by the
real offline policy (a real branch and commit), and the gate's real `evaluate` turns made-up
per-seed metrics into the record the store keeps, so every number in a summary is a gate number.
`run_loop` runs the real loop for the end-to-end tests.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import support
from support.lab import TASKS, cli_env, make_template

from agent.graph import Nodes, Services
from agent.policy_offline import OfflinePolicy
from agent.records import Hypothesis, Records
from agent.workspace import Workspace
from pipeline import experiment
from pipeline.lab import load_lab

BASELINE = {"default_90d": [0.60, 0.61, 0.59], "churn_60d": [0.70, 0.72, 0.71]}
BETTER = {"default_90d": [0.70, 0.71, 0.705], "churn_60d": [0.80, 0.815, 0.81]}
SAME = {"default_90d": [0.595, 0.612, 0.60], "churn_60d": [0.705, 0.71, 0.718]}


def make_lab(path: Path) -> Path:
    """The shared tiny lab (agent_fixtures.make_template): one recipe for every agent-level test."""
    return make_template(path)


def services(root: Path, policy: Any = None, supervised: bool = False) -> Services:
    lab = load_lab(root)
    store = experiment.open_store(lab, None)
    return Services(lab, store, Records(store), Workspace(lab), policy or OfflinePolicy(), supervised, smoke=False)


def implemented(svc: Services) -> Hypothesis:
    """A hypothesis proposed and implemented by the offline policy: a real branch and commit."""
    policy, svc.policy = svc.policy, OfflinePolicy()
    try:
        h = svc.records.add(Hypothesis(status="proposing", origin="offline"))
        nodes = Nodes(svc)
        nodes.propose({"hypothesis_id": h.id})
        assert nodes.implement({"hypothesis_id": h.id})["phase"] == "measuring"
    finally:
        svc.policy = policy
    return svc.records.get(h.id)


def gate_result(challenger: dict[str, list[float | None]], look: int, baseline: dict[str, list[float]] = BASELINE):
    from pipeline.gate import GateConfig, evaluate

    lab_cfg = {"protocol": "sequential", "baseline_runs": 3, "looks": [2, 3], "alpha": 0.025, "futility_p": 0.30,
               "harm_q": 0.10, "higher_is_better": True}
    cfg = GateConfig(**lab_cfg).model_dump()
    tasks = [{"task": t, "baseline": baseline[t], "challenger": challenger[t][:look], "history": baseline[t]}
             for t in TASKS]
    return evaluate({"config": cfg, "tasks": tasks, "looks_done": None, "at_look": True})


def measured(svc: Services, h: Hypothesis, challenger: dict[str, list[float | None]], look: int = 2,
             baseline: dict[str, list[float]] = BASELINE) -> Hypothesis:
    """Store the gate's record of a look and leave the hypothesis where `evaluate` leaves it: deciding."""
    result = gate_result(challenger, look, baseline)
    svc.store.put_gate_record(str(h.id), look, result)
    return svc.records.update(h.id, look=look, verdict=result.verdict.value, status="deciding")


def decided(svc: Services, h: Hypothesis, summary_policy: Any = None) -> Hypothesis:
    """Run the graph's real nodes from where the row stands (`decide`) in the order its routers give (decide → promote →
    summarize, or decide → summarize for a hold), up to where the thread would wait or end;
    `summary_policy` (an LLMPolicy) writes the summary only."""
    from agent.graph import END, from_start, graph_spec, thread_input

    spec = graph_spec(svc)
    state: dict[str, Any] = dict(thread_input(svc.records.get(h.id)))  # as the loop starts a thread
    node = from_start(state)  # decide, or summarize for one rejected before any run
    while node not in (END, "hold", "reverify", "evaluate"):
        policy, svc.policy = svc.policy, (summary_policy or svc.policy) if node == "summarize" else svc.policy
        try:
            state |= spec.nodes[node](state)
        finally:
            svc.policy = policy
        node = spec.routes[node](state)
    return svc.records.get(h.id)


def cli(root: Path, *args: str, check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`support.cli` with `env` added to `cli_env()`, and (unless `check=False`) asserted to succeed."""
    proc = support.cli(root, *args, env=cli_env(**(env or {})), timeout=600)
    if check:
        assert proc.returncode == 0, f"{args}: rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def run_loop(root: Path, max_hypotheses: int = 2, *extra: str) -> subprocess.CompletedProcess:
    t0 = time.monotonic()
    proc = cli(root, "run", "--offline", "--json", "--max-hypotheses", str(max_hypotheses), *extra,
               env={"OPENAI_API_KEY": "", "OPENAI_BASE_URL": ""})
    proc.elapsed = time.monotonic() - t0  # type: ignore[attr-defined]
    return proc
