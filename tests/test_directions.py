"""agent.directions on a real lab repo: a branch's config.toml cannot break the grouping.

The grouping runs on every proposal (the LLM's context), on the web page and in the MLflow export,
so a hostile commit that made it raise would stop the loop from proposing for good."""

import subprocess

import pytest

from agent.directions import MAX_CONFIG_BYTES, changed_keys, direction_of
from agent.labinit import init_lab
from agent.workspace import Workspace
from pipeline.lab import load_lab

pytestmark = pytest.mark.integration


@pytest.fixture
def ws(tmp_path):
    return Workspace(load_lab(init_lab(tmp_path / "lab")))


class Hyp:
    def __init__(self, base: str, commit: str):
        self.base_commit, self.commit, self.change = base, commit, None


def commit_bytes(ws: Workspace, branch: str, data: bytes) -> str:
    """A commit on `branch` off the baseline whose config.toml is `data`, made with git itself."""
    root = ws.lab.root
    run = lambda *a: subprocess.run(["git", *a], cwd=root, check=True, capture_output=True, text=True).stdout  # noqa: E731
    blob = subprocess.run(["git", "hash-object", "-w", "--stdin"], cwd=root, input=data, check=True,
                          capture_output=True).stdout.decode().strip()
    base = ws.baseline_head()
    tree_lines = [ln if not ln.endswith("\tconfig.toml") else f"100644 blob {blob}\tconfig.toml"
                  for ln in run("ls-tree", base).splitlines()]
    tree = subprocess.run(["git", "mktree"], cwd=root, input="\n".join(tree_lines) + "\n", check=True,
                          capture_output=True, text=True).stdout.strip()
    sha = run("commit-tree", tree, "-p", base, "-m", branch).strip()
    run("branch", branch, sha)
    return sha


def test_an_honest_change_is_grouped_by_its_key(ws):
    base = ws.baseline_head()
    text = ws.read(base, "config.toml").replace("lr = 3e-4", "lr = 3e-3")
    sha = commit_bytes(ws, "hyp/1-lr", text.encode())
    assert changed_keys(ws, base, sha) == {"finetune.lr": "0.003"}
    assert direction_of(ws, Hyp(base, sha)) == ("finetune.lr",)


@pytest.mark.parametrize("data", [
    ("." .join(["k"] * 1000) + " = 1\n").encode(),  # 1000 nested tables: a recursive flatten overflowed
    b"[finetune]\nlr = \xff\xfe\n",  # not UTF-8
    b"x = 1\n" + b"#" * (MAX_CONFIG_BYTES + 10),  # past the read bound
    b"[[[[not toml",
    b"x = " + b"[" * 5000 + b"]" * 5000 + b"\n",  # arrays nested past the interpreter's recursion limit
], ids=["deep", "not-utf8", "huge", "garbage", "deep-array"])
def test_a_hostile_config_is_grouped_by_its_path_and_never_raises(ws, data):
    base = ws.baseline_head()
    sha = commit_bytes(ws, "hyp/2-hostile", data)
    direction = direction_of(ws, Hyp(base, sha))
    if data.startswith(b"k.k"):  # parses: one key, its nesting capped instead of recursing
        (key,) = [k for k in changed_keys(ws, base, sha) if k.startswith("k.")]
        assert key.count(".") <= 40
    else:
        assert direction == ("config.toml",)
