"""A non-editable install works: a wheel built from this checkout, installed into a fresh venv
outside it, runs the LLM policy (prompts and templates come from the installed package) against
the fake OpenAI server, and the sandbox hides the installed package from stages.

The fresh venv gets the wheel without dependencies; it reaches the dependencies already installed
in this checkout's venv through a plain path entry (a `.pth` line, which adds the folder but does
not run the editable install's finder), so the package itself can only come from the wheel. numpy
is copied into the fresh venv's own site-packages, beside the wheel, as a cluster image has it: a
stage must see it there while our own packages, in the same folder, stay hidden.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from support.lab import REPO, RoutedOpenAI, cli_env, decision, edit, edits, git, llm_env, proposal
from support.fake_openai import content

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `python` of a fresh venv holding only the wheel of this checkout."""
    base = tmp_path_factory.mktemp("wheel")
    wheels = base / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(wheels), str(REPO)], check=True, capture_output=True, cwd=base)
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    deps = Path(sysconfig.get_paths()["purelib"])
    (site / "deps.pth").write_text(f"{deps}\n")
    for found in [*deps.glob("numpy"), *deps.glob("numpy.libs"), *deps.glob("numpy-*.dist-info")]:
        shutil.copytree(found, site / found.name, symlinks=True)
    wheel = next(wheels.glob("autoresearch-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", str(wheel)],
                   check=True, capture_output=True)
    return py


def _env(**extra: str) -> dict[str, str]:
    env = cli_env(**extra)
    env.pop("PYTHONPATH", None)  # nothing of the checkout on the path
    return env


def test_the_installed_package_has_its_prompts_and_templates(installed: Path, tmp_path: Path) -> None:
    code = ("import agent, pipeline, agent.prompts as p; "
            "import json; print(json.dumps([agent.__file__, pipeline.__file__, str(p.PROMPTS_DIR), p.names()]))")
    out = subprocess.run([str(installed), "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    agent_file, pipeline_file, prompts_dir, names = json.loads(out.stdout)
    venv = str(installed.parent.parent)
    assert agent_file.startswith(venv) and pipeline_file.startswith(venv) and prompts_dir.startswith(venv)
    assert {"propose", "implement", "decide", "summarize", "system"} <= set(names)


def test_the_llm_policy_runs_from_the_wheel(installed: Path, tmp_path: Path) -> None:
    autoresearch = [str(installed), "-m", "agent.cli"]
    lab = tmp_path / "lab"
    out = subprocess.run([*autoresearch, "init", str(lab), "--harness", "command"], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    server = RoutedOpenAI()
    with server:
        server.on("hypothesis", content({**proposal("Add squared features", "config.toml: train.features"),
                                         "tasks_expected": ["default", "churn", "fraud"]}))
        server.on("edits", content(edits(edit("config.toml", 'features = "raw"', 'features = "squares"'))))
        server.on("decision", content(decision("abandon", "Scripted.")))
        run = subprocess.run([*autoresearch, "--repo", str(lab), "run", "--max-hypotheses", "1"], cwd=tmp_path,
                             env=_env(**llm_env(server)), capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        propose = server.asked("hypothesis")
    assert propose, server.requests
    sent = json.dumps(propose[0]["messages"])
    template = re.sub(r"\A\s*<!--.*?-->", "", (REPO / "prompts" / "propose.md").read_text(), flags=re.DOTALL)
    line = next(ln for ln in template.splitlines() if len(ln.strip()) > 20 and "{" not in ln)
    assert json.dumps(line.strip())[1:-1] in sent  # the installed copy of prompts/propose.md was sent
    status = subprocess.run([*autoresearch, "--repo", str(lab), "status", "--json"], cwd=tmp_path, env=_env(),
                            capture_output=True, text=True)
    h = json.loads(status.stdout)["hypotheses"][0]
    assert h["title"] == "Add squared features" and h["origin"] == "llm" and h["verdict"], h
    assert git(lab, "show", f"exp/{h['id']}:config.toml").count('features = "squares"') == 1


def test_a_numpy_lab_runs_a_hypothesis_from_the_wheel(installed: Path, tmp_path: Path) -> None:
    """The command lab's prepare, train and score import numpy from the site-packages that also holds
    our packages: each stage sees numpy and not `pipeline` (the wheel-install finding of issue 33)."""
    autoresearch = [str(installed), "-m", "agent.cli"]
    lab = tmp_path / "lab"
    out = subprocess.run([*autoresearch, "init", str(lab), "--harness", "command"], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    probe = "import importlib.util as u; print('own packages visible:', u.find_spec('pipeline') is not None)\n"
    train = lab / "train.py"
    train.write_text(probe + train.read_text())
    git(lab, "commit", "-qam", "probe what a stage sees")
    git(lab, "branch", "-f", "autoresearch/baseline", "HEAD")
    run = subprocess.run([*autoresearch, "--repo", str(lab), "run", "--offline", "--max-hypotheses", "1"],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    status = json.loads(subprocess.run([*autoresearch, "--repo", str(lab), "status", "--json"], cwd=tmp_path,
                                       env=_env(), capture_output=True, text=True).stdout)
    h = status["hypotheses"][0]
    assert h["verdict"] and h["status"] != "rejected", h
    logs = [p.read_text() for p in (lab / "runs" / "logs").rglob("*.log")]
    assert not any("No module named 'numpy'" in text for text in logs)
    seen = [line for text in logs for line in text.splitlines() if line.startswith("own packages visible:")]
    assert seen and set(seen) == {"own packages visible: False"}, seen
