"""The house's doors: `agent/` reaches the pipeline through `pipeline.api` only, and `pipeline/`
knows nothing of the agent (nor of an LLM)."""

from __future__ import annotations

import ast
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]


def imports(folder: str) -> list[tuple[str, int, str]]:
    """(file, line, module) of every import in `folder`'s Python files, function-level ones too,
    and of every `importlib.import_module("...")` with a literal name."""
    out = []
    for path in sorted((REPO / folder).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        rel = str(path.relative_to(REPO))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                out.append((rel, node.lineno, node.module))
            elif isinstance(node, ast.Import):
                out.extend((rel, node.lineno, a.name) for a in node.names)
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in
                  ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)
                  and isinstance(node.args[0].value, str)):
                out.append((rel, node.lineno, node.args[0].value))
    return out


def test_the_agent_imports_the_pipeline_only_through_its_api() -> None:
    found = imports("agent")
    assert any(m == "pipeline.api" for _, _, m in found)  # the scan sees the imports at all
    wrong = [f"{f}:{n}: {m}" for f, n, m in found if m.split(".")[0] == "pipeline" and m != "pipeline.api"]
    assert wrong == []


def test_every_name_the_agent_takes_at_the_door_is_there() -> None:
    import pipeline.api as api

    taken = set()
    for path in sorted((REPO / "agent").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "pipeline.api":
                taken |= {(str(path.relative_to(REPO)), a.name) for a in node.names}
    assert len(taken) > 40
    assert sorted((f, n) for f, n in taken if n not in api.__all__) == []


def test_the_pipeline_knows_nothing_of_the_agent_or_an_llm() -> None:
    found = imports("pipeline")
    wrong = [f"{f}:{n}: {m}" for f, n, m in found if m.split(".")[0] in ("agent", "openai", "langgraph")]
    assert wrong == []


def test_every_name_of_the_api_resolves_and_nothing_heavy_is_imported_by_naming_one() -> None:
    code = ("import json, sys, pipeline.api as api\n"
            "from pipeline.api import ExecutorOptions, Lab, UserError, check_executor, load_lab  # the CLI at start-up\n"
            "heavy = sorted(m for m in ('numpy', 'scipy', 'torch', 'ray') if m in sys.modules)\n"
            "missing = [n for n in api.__all__ if getattr(api, n, None) is None]  # every name, numpy and all\n"
            "print(json.dumps({'heavy': heavy, 'missing': missing, 'names': len(api.__all__)}))\n")
    out = json.loads(subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                                    check=True).stdout)
    assert out["heavy"] == [] and out["missing"] == [] and out["names"] > 40, out


def test_an_unknown_name_at_the_door_is_an_attribute_error() -> None:
    import pipeline.api as api

    with pytest.raises(AttributeError, match="pipeline.api.*no attribute 'Nope'"):
        api.Nope  # noqa: B018


def test_every_error_of_a_package_has_its_root() -> None:
    import inspect

    import agent.errors
    import pipeline.errors
    from agent.errors import AgentError
    from pipeline.errors import PipelineError

    for module, root in ((pipeline.errors, PipelineError), (agent.errors, AgentError)):
        own = [c for _, c in inspect.getmembers(module, inspect.isclass)
               if issubclass(c, BaseException) and c.__module__ == module.__name__]
        assert own and all(issubclass(c, root) for c in own), [c.__name__ for c in own if not issubclass(c, root)]


def test_each_error_says_its_exit_code() -> None:
    from agent.errors import AgentError, EditRejected, LLMError, LLMUnavailable, NotConfigured
    from pipeline.errors import (
        InfrastructureFailure,
        LabConfigError,
        MethodFailure,
        PipelineError,
        UnsafeTree,
        UserError,
    )

    assert [e.exit_code for e in (UserError("x"), LabConfigError("r.toml", "gate.looks", "x"),
                                  LabConfigError(None, "stage", "x"), LabConfigError(None, None, "x"),
                                  NotConfigured("x"))] == [2] * 5
    assert [e.exit_code for e in (PipelineError("x"), InfrastructureFailure("x"), MethodFailure("x"),
                                  LLMUnavailable("p", 3, "x"), LLMError("x"), AgentError("x"),
                                  EditRejected("smoke_failed", "x"), UnsafeTree(22, "x"))] == [1] * 8
    # the standard library's kinds still catch what they caught
    assert isinstance(LabConfigError(None, "k", "x"), ValueError) and isinstance(UnsafeTree(22, "x"), OSError)
    # one line, where from when known
    assert [str(e) for e in (LabConfigError("r.toml", "gate.looks", "x"), LabConfigError(None, "gate.looks", "x"),
                             LabConfigError(None, None, "x"))] == ["r.toml: gate.looks: x", "gate.looks: x", "x"]


def test_one_class_per_way_a_caller_reacts() -> None:
    """At most 16 error classes in all (issue 35), every one in an `errors.py`."""
    import agent.errors
    import pipeline.errors

    own = [c.__name__ for m in (agent.errors, pipeline.errors) for _, c in inspect.getmembers(m, inspect.isclass)
           if issubclass(c, BaseException) and c.__module__ == m.__name__]
    assert len(own) <= 16, own


def test_every_error_class_lives_in_an_errors_module() -> None:
    """None outside `errors.py`: the sandbox (which travels to Ray nodes alone) raises OSErrors."""
    found = []
    for folder in ("agent", "pipeline"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path.name == "errors.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef) and any(
                        getattr(b, "id", getattr(b, "attr", "")).endswith(("Error", "Exception", "Failure", "Failed"))
                        for b in node.bases):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.name}")
    assert found == []
