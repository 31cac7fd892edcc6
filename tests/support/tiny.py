"""A tiny real benchmark for the execution layer's tests: a harness and a lab built in a git repo.

The harness is a real `Harness` (data on disk, sealed labels apart, the shared AUC scorer); the
lab's stages are real Python scripts run by the real executors. They need only numpy, so a test
runs in a fraction of a second, and they are deterministic by seed, so results can be compared
exactly across executors and restarts. Task names double as behaviours (crash, hang, nan...).
"""

from __future__ import annotations

import json
import os
import shutil
import textwrap
import uuid
from pathlib import Path

import numpy as np

from support import git  # noqa: F401 (re-exported)

from pipeline.harness.base import Harness, Prepared
from pipeline.lab import CONFIG_NAME, Lab, parse_config

TASKS = ["a", "b", "c"]
FAILING = ["crash", "hang", "nan", "garbage", "missing", "segv"]


class TinyHarness(Harness):
    name = "tiny"
    suites = {"tiny": [*TASKS, *FAILING, "env", "slow", "sealed"]}

    def prepare(self, state_dir: Path, suite: str, data_seed: int, customers: int | None = None, *,
                smoke: bool = False) -> Prepared:
        n = customers or 400
        dataset_id = f"tiny{'-smoke' if smoke else ''}-s{data_seed}-n{n}"
        public = Path(state_dir) / "data" / dataset_id
        sealed = Path(state_dir) / "sealed" / dataset_id
        if not (public / "meta.json").exists():
            # a smoke dataset: a seed stream and ids of its own
            rng = np.random.default_rng([data_seed, 7]) if smoke else np.random.default_rng(data_seed)
            first = 1_000_000_000 if smoke else 1000
            ids = np.arange(first, first + n, dtype=np.int64)
            split = rng.choice(np.array([0, 1, 2], dtype=np.int8), size=n, p=[0.6, 0.1, 0.3])
            tab = rng.normal(size=(n, 5)).astype(np.float32)
            labels = {}
            for i, task in enumerate(self.suites[suite]):
                w = np.random.default_rng(1000 + i).normal(size=5)
                p = 1 / (1 + np.exp(-(tab @ w) + rng.normal(scale=1.0, size=n)))
                labels[task] = (rng.random(n) < p).astype(np.int8)
            for root in (public, sealed):
                root.parent.mkdir(parents=True, exist_ok=True)
            tmp_pub, tmp_seal = Path(f"{public}.tmp-{uuid.uuid4().hex[:6]}"), Path(f"{sealed}.tmp-{uuid.uuid4().hex[:6]}")
            tmp_pub.mkdir()
            tmp_seal.mkdir()
            np.savez(tmp_pub / "customers.npz", id=ids, split=split, tabular=tab)
            np.savez(tmp_pub / "labels.npz", **{t: np.where(split == 2, -1, y).astype(np.int8) for t, y in labels.items()})
            np.savez(tmp_seal / "labels.npz", **labels)
            (tmp_pub / "meta.json").write_text(json.dumps({"dataset_id": dataset_id}))
            for tmp, final in ((tmp_seal, sealed), (tmp_pub, public)):
                try:
                    os.rename(tmp, final)
                except OSError:
                    shutil.rmtree(tmp, ignore_errors=True)
        return Prepared(dataset_id, public, sealed)

    def test_ids(self, prepared: Prepared) -> np.ndarray:
        c = np.load(prepared.public / "customers.npz")
        return c["id"][c["split"] == 2]

    def test_labels(self, prepared: Prepared, task: str) -> np.ndarray:
        c = np.load(prepared.public / "customers.npz")
        return np.load(prepared.sealed / "labels.npz")[task][c["split"] == 2]


# `python -m pipeline.runner` with the tiny harness registered by name, as a plugin would
TINY_RUNNER = ("from support.tiny import TinyHarness; from pipeline.harness import HARNESSES; "
               "HARNESSES.register('tiny', TinyHarness); from pipeline.runner import main; raise SystemExit(main())")

RESEARCH_TOML = """
[lab]
name = "tiny"
editable = ["model.py", "pretrain.py", "finetune.py", "config.toml"]

[benchmark]
harness = "tiny"
suite = "tiny"

[[stage]]
name = "pretrain"
run = "python pretrain.py --data {data} --seed {seed} --out {out}"
scope = "seed"
inputs = ["model.py", "pretrain.py", "config.toml#pretrain"]

[[stage]]
name = "finetune"
run = "python finetune.py --data {data} --task {task} --seed {seed} --pretrained {pretrain} --out {out}"
scope = "run"
needs = ["pretrain"]
inputs = ["model.py", "finetune.py", "config.toml#finetune"]

[run]
timeout_s = %(timeout_s)s
cpus = 1
env = ["SLOW_S", "EXEC_LEDGER", "EXEC_TEST_CANARY"]  # the knobs the fixture stages read
retries = %(retries)s
"""

MODEL_PY = """
SCALE = 1.0
"""

CONFIG_TOML = """
[pretrain]
sleep = %(pretrain_sleep)s

[finetune]
sleep = %(finetune_sleep)s
shrink = 0.1
"""

PRETRAIN_PY = '''
"""Pretend pretraining: a seeded random direction, scaled by model.SCALE."""
import argparse, os, time, tomllib
from pathlib import Path
import numpy as np
import model

p = argparse.ArgumentParser()
p.add_argument("--data"); p.add_argument("--seed", type=int); p.add_argument("--out")
a = p.parse_args()
cfg = tomllib.loads(Path("config.toml").read_text())["pretrain"]
time.sleep(cfg["sleep"])
tab = np.load(Path(a.data) / "customers.npz")["tabular"]
w = np.random.default_rng(a.seed).normal(size=tab.shape[1]) * model.SCALE
np.save(Path(a.out) / "w.npy", w)
(Path(a.out) / "cwd.txt").write_text(os.getcwd())
if os.environ.get("EXEC_LEDGER"):  # into the stage log: a sandboxed stage writes nowhere else
    print("ledger:", f"pretrain {a.seed}")
'''

FINETUNE_PY = '''
"""Pretend fine-tuning: least squares on train rows, pulled toward the pretrained direction."""
import argparse, json, os, signal, sys, time, tomllib
from pathlib import Path
import numpy as np

p = argparse.ArgumentParser()
p.add_argument("--data"); p.add_argument("--task"); p.add_argument("--seed", type=int)
p.add_argument("--pretrained"); p.add_argument("--out")
a = p.parse_args()
cfg = tomllib.loads(Path("config.toml").read_text())["finetune"]
time.sleep(cfg["sleep"])
out = Path(a.out)
if a.task == "crash":
    raise RuntimeError("diverged")
if a.task == "hang":
    time.sleep(600)
if a.task == "segv":
    os.kill(os.getpid(), signal.SIGSEGV)
if a.task == "slow":
    time.sleep(float(os.environ.get("SLOW_S", "3")))
if a.task == "env":
    (out / "env.json").write_text(json.dumps(dict(os.environ)))
    import socket
    try:
        socket.create_connection(("127.0.0.1", 5432), timeout=2).close()
        net = "connected"
    except OSError as e:
        net = e.strerror
    seen = {"pid1": open("/proc/1/cmdline").read().split("\\0")[0], "net": net, "uid": os.getuid(),
            "state": sorted(os.listdir(Path.cwd().parents[1]))}  # runs/ of the lab (or the Ray node's copy)
    (out / "sandbox.json").write_text(json.dumps(seen))
c = np.load(Path(a.data) / "customers.npz")
y = np.load(Path(a.data) / "labels.npz")[a.task if a.task in ("a", "b", "c") else "a"]
w0 = np.load(Path(a.pretrained) / "w.npy")
tr = c["split"] == 0
x = c["tabular"]
beta, *_ = np.linalg.lstsq(x[tr], y[tr] - y[tr].mean(), rcond=None)
rng = np.random.default_rng(a.seed)
w = beta + cfg["shrink"] * w0 + rng.normal(scale=0.05, size=w0.shape)
test = c["split"] == 2
scores = x[test] @ w
if a.task == "nan":
    scores[3] = float("nan")
if a.task == "missing":
    sys.exit(0)
with open(out / "predictions.csv", "w") as fh:
    if a.task == "garbage":
        fh.write("hello world\\n")
    else:
        fh.write("id,score\\n")
        for i, s in zip(c["id"][test], scores):
            fh.write(f"{int(i)},{float(s)!r}\\n")
if os.environ.get("EXEC_LEDGER"):  # into the stage log: a sandboxed stage writes nowhere else
    print("ledger:", f"finetune {a.task} {a.seed}")
'''


def make_lab(root: Path, *, timeout_s: float = 20, retries: int = 1, pretrain_sleep: float = 0.0,
             finetune_sleep: float = 0.0) -> Lab:
    """A lab in a fresh git repo with one commit on `autoresearch/baseline`."""
    root.mkdir(parents=True, exist_ok=True)
    files = {
        CONFIG_NAME: RESEARCH_TOML % {"timeout_s": timeout_s, "retries": retries},
        "program.md": "# Tiny lab\nMake the AUC go up.\n",
        "model.py": MODEL_PY,
        "config.toml": CONFIG_TOML % {"pretrain_sleep": pretrain_sleep, "finetune_sleep": finetune_sleep},
        "pretrain.py": PRETRAIN_PY,
        "finetune.py": FINETUNE_PY,
        ".gitignore": "runs/\n__pycache__/\n",
    }
    for name, text in files.items():
        (root / name).write_text(textwrap.dedent(text).lstrip())
    git(root, "init", "-q", "-b", "autoresearch/baseline")
    git(root, "config", "user.email", "lab@example.com")
    git(root, "config", "user.name", "lab")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "baseline")
    return open_tiny_lab(root)


def open_tiny_lab(root: Path) -> Lab:
    return Lab(root.resolve(), parse_config((root / CONFIG_NAME).read_text(), root / CONFIG_NAME))


def commit_change(root: Path, branch: str, path: str, old: str, new: str) -> str:
    """Create `branch` from the baseline with one edit; return its sha. The checkout stays on baseline."""
    git(root, "checkout", "-q", "-b", branch, "autoresearch/baseline")
    text = (root / path).read_text()
    assert old in text, f"{old!r} not in {path}"
    (root / path).write_text(text.replace(old, new))
    git(root, "commit", "-q", "-am", f"{branch}: edit {path}")
    sha = git(root, "rev-parse", "HEAD")
    git(root, "checkout", "-q", "autoresearch/baseline")
    return sha


def require_sandbox() -> None:
    """Skip a sandboxed test where the kernel refuses the sandbox's namespaces; in CI fail instead."""
    import pytest

    from pipeline import isolation

    isolation._probe.cache_clear()
    why = isolation._probe()
    if why is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"the sandbox is required in CI: {why}")
    # platform limit: a kernel without user namespaces (some containers); CI fails above instead
    pytest.skip(f"no sandbox here: {why}")
