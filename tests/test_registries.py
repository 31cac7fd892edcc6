"""The seams: a harness, an executor, a gate protocol and a policy are each one class registered by
name in a `pipeline.registry.Registry`; a toy of each, defined here, plugs in through `register()`
and runs through the real driver, the real gate and the real loop."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agent.policy import POLICIES, Choice, Proposal

from agent.policy_offline import OfflinePolicy
from support import serial_executor
from support.tiny import TASKS, TinyHarness, make_lab
from pipeline import runner
from pipeline.executors import EXECUTORS, ExecutorOptions, make_executor
from pipeline.harness import HARNESSES
from pipeline import experiment

pytestmark = pytest.mark.integration

BASE = "autoresearch/baseline"


@pytest.fixture
def registered():
    EXECUTORS.register("serial", serial_executor.make)
    HARNESSES.register("tiny", TinyHarness)
    yield
    EXECUTORS.unregister("serial")
    HARNESSES.unregister("tiny")


def test_a_registered_harness_and_executor_measure_like_the_local_executor(registered, tmp_path: Path) -> None:
    from pipeline.lab import load_lab

    made = make_lab(tmp_path / "lab")
    lab = load_lab(made.root)  # "tiny" is now a harness by name: the lab validates and loads
    assert lab.tasks()[:3] == TASKS
    store = experiment.open_store(lab)
    ids = experiment.ensure_runs(store, lab, BASE, TASKS, [0, 1])
    executor = make_executor(ExecutorOptions("serial", extra={"interpreter": sys.executable}), lab)
    assert executor.interpreter == sys.executable  # its own option reached it, through one options object
    with runner.Driver(lab, store, executor) as d:
        d.drive(until=ids, timeout_s=120)
    serial = experiment.results(store, lab, BASE, TASKS)
    assert executor.submitted == 2 + 6  # one pretraining per seed, one fine-tuning per run

    other = make_lab(tmp_path / "reference")
    ref_store = experiment.open_store(other)
    ids = experiment.ensure_runs(ref_store, other, BASE, TASKS, [0, 1])
    with runner.Driver(other, ref_store, make_executor("local", other, preload=("numpy",))) as d:
        d.drive(until=ids, timeout_s=120)
    assert serial == experiment.results(ref_store, other, BASE, TASKS)
    assert all(isinstance(v, float) for seeds in serial.values() for v in seeds.values())


def test_an_executor_option_it_does_not_know_is_one_line(registered, tmp_path: Path) -> None:
    from pipeline.errors import UserError

    lab = make_lab(tmp_path / "lab")
    with pytest.raises(UserError, match=r"executor serial: unknown option 'partition'"):
        make_executor(ExecutorOptions("serial", extra={"partition": "gpu"}), lab)
    with pytest.raises(UserError, match=r"executor local: unknown option 'partition'; it takes none"):
        make_executor(ExecutorOptions("local", extra={"partition": "gpu"}), lab)


def test_an_unknown_executor_is_one_line(registered, tmp_path: Path) -> None:
    from pipeline.errors import UserError

    with pytest.raises(UserError, match=r"unknown executor 'nope'; expected one of \['local', 'ray', 'serial'\]"):
        make_executor("nope", make_lab(tmp_path / "lab"))


class OneIdea:
    """A toy policy: one idea (a config edit), decisions as the gate says, no LLM."""

    name = "one-idea"
    can_repair = False

    def __init__(self) -> None:
        self.proposed = False

    def propose(self, ctx: Any) -> Proposal | None:
        if self.proposed:
            return None
        self.proposed = True
        from agent.policy_offline import config_edit

        return Proposal(title="Squared features", rationale="The labels bend.", expected_effect="lower logloss",
                        expected_tasks=list(ctx.tasks), change={"train.features": "squares"},
                        plan=[config_edit(ctx.files["config.toml"], "train.features", "squares").to_dict()])

    def implement(self, ctx: Any, hyp: Any, feedback: Any) -> list:
        raise AssertionError("the plan carries the edits")

    def decide(self, ctx: Any, hyp: Any, verdict: str, evidence: str, allowed: list[str], look: str) -> Choice:
        return OfflinePolicy().decide(ctx, hyp, verdict, evidence, allowed, look)


def test_a_registered_policy_is_made_by_name() -> None:
    from agent.policy import make_policy

    POLICIES.register("one-idea", lambda lab, store: OneIdea())
    try:
        assert isinstance(make_policy(None, None, "one-idea"), OneIdea)
    finally:
        POLICIES.unregister("one-idea")
    assert "one-idea" not in POLICIES


@pytest.mark.system  # the real loop end to end (about a minute): not in make test-fast
def test_a_registered_policy_drives_the_real_loop(tmp_path: Path) -> None:
    from agent.labinit import init_lab
    from agent.loop import Loop, LoopOptions
    from pipeline.lab import load_lab

    POLICIES.register("one-idea", lambda lab, store: OneIdea())
    root = init_lab(tmp_path / "lab", harness="command")
    loop = Loop(load_lab(root), LoopOptions(max_hypotheses=1, policy="one-idea", executor=ExecutorOptions(workers=2)))
    try:
        loop.run()
    finally:
        loop.close()
        POLICIES.unregister("one-idea")
    h = loop.records.get(1)
    assert (h.origin, h.title, h.status) == ("one-idea", "Squared features", "done")
    assert h.verdict == "improvement" and h.decision == "promote", (h.verdict, h.decision)


from pipeline.gate.protocol.base import GateProtocol  # noqa: E402


class Bonferroni(GateProtocol):
    """A toy gate protocol: the fixed protocol's boundaries, per-task calls at α / tasks."""

    name = "bonferroni"
    moderated = False

    def boundaries(self, n_baseline, looks, planned_max, alpha, prior_df=0, prior_weight=0.0):
        from pipeline.gate.boundaries import fixed_boundaries

        return fixed_boundaries(n_baseline, looks, alpha, prior_weight)

    def flags(self, p_up, p_down, q, t, alpha, harm_q):
        k = t.shape[-1]
        return p_up < alpha / k, p_down < alpha / k

    def harm_rule(self, harm_q):
        return "Bonferroni p"


def test_a_registered_gate_protocol_judges_a_look() -> None:
    from pipeline.gate import evaluate
    from pipeline.gate.protocol import PROTOCOLS, get_protocol
    from pipeline.lab import parse_config

    PROTOCOLS.register("bonferroni", "test_registries:Bonferroni")  # lazy, as the bundled ones are
    get_protocol.cache_clear()
    try:
        toml = '[lab]\nname = "x"\neditable = ["a.py"]\n[[stage]]\nname = "s"\nrun = "python a.py {out}"\n'
        assert parse_config(toml + '[gate]\nprotocol = "bonferroni"\n').gate.protocol == "bonferroni"
        base = [0.70, 0.71, 0.69, 0.70, 0.71]
        tasks = [{"task": "a", "baseline": base, "challenger": [0.60, 0.61]},
                 {"task": "b", "baseline": base, "challenger": [0.70, 0.71]},
                 {"task": "c", "baseline": base, "challenger": [0.71, 0.70]}]
        result = evaluate({"config": {"protocol": "bonferroni", "looks": [2, 5, 10]}, "tasks": tasks,
                           "looks_done": [], "at_look": True})
        assert result.protocol == "bonferroni" and result.verdict.value == "harm", result.reasons
        assert "harm on a (Bonferroni p)" in result.reasons
        assert [t.flags for t in result.tasks][0] == ["harm"]
    finally:
        PROTOCOLS.unregister("bonferroni")
        get_protocol.cache_clear()


def test_every_registry_names_its_choices_in_one_line() -> None:
    from pipeline.errors import UserError
    from pipeline.gate.protocol import PROTOCOLS

    for registry, kind, names in [(HARNESSES, "harness", ["command", "sim", "transactions"]),
                                  (EXECUTORS, "executor", ["local", "ray"]),
                                  (PROTOCOLS, "protocol", ["fixed", "paired", "sequential"]),
                                  (POLICIES, "policy", ["llm", "offline"])]:
        with pytest.raises(UserError) as e:
            registry.get("nope")
        assert str(e.value) == f"unknown {kind} 'nope'; expected one of {names}"


def test_a_lazy_entry_is_imported_by_get_only() -> None:
    from pipeline.registry import Registry

    reg = Registry("thing", {"later": "no_such_module_here:Thing", "now": OneIdea})
    assert "later" in reg and reg.names() == ["later", "now"] and list(reg) == ["later", "now"]
    assert reg.get("now") is OneIdea
    with pytest.raises(ModuleNotFoundError):
        reg.get("later")
    with pytest.raises(ValueError, match="a lazy entry is 'module:attr'"):
        reg.register("bad", "no_colon")


def test_executor_options_on_the_cli_reach_the_factory_or_are_one_line(tmp_path: Path) -> None:
    """`--executor-option KEY=VALUE` travels in `ExecutorOptions.extra` to the executor's factory: the
    built-in ones take none, so naming one is a mistake said in one line (exit 2), before any run."""
    from agent.labinit import init_lab

    root = init_lab(tmp_path / "lab", harness="command")
    for extra, said in ((["--executor-option", "partition"], "--executor-option 'partition': expected KEY=VALUE"),
                        (["--executor-option", "partition=gpu"], "executor local: unknown option 'partition'")):
        out = subprocess.run([sys.executable, "-m", "agent.cli", "--repo", str(root), "run", "--offline",
                              "--max-hypotheses", "1", *extra], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and said in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    from pipeline.api import open_store
    from pipeline.lab import load_lab

    assert open_store(load_lab(root)).queue_counts()["queued"] == 0  # nothing was queued
