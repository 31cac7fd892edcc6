"""A team's own lab, written here from scratch (not the bundled template), run end to end.

The lab: `harness = "command"`, three regression tasks scored by mean squared error (lower is
better), numpy only. Its prepare.py draws y = x·w + (x² − 1)·bend + noise, so a model with squared
features truly helps (it removes the (x² − 1)·bend error) and a huge ridge penalty truly hurts
(it shrinks every weight towards zero). The offline policy searches `[search_space]` over its
config.toml; `autoresearch run --offline` is a real subprocess with a real sandbox, git, SQLite.
What each hypothesis should get is computed from the data-generating process, not from the run.
"""

from __future__ import annotations

import json
import math
import stat
import textwrap
import tomllib
from pathlib import Path

import numpy as np
import pytest

from support.lab import BASELINE, cli, cli_json, git, open_lab, records

pytestmark = pytest.mark.system

TASKS = ["north", "south", "east"]
ROWS, FEATURES, NOISE, TEST_FRACTION, BAG = 3000, 6, 1.2, 1 / 3, 0.8
BEND = 0.2  # |coefficient| of every (x_j² − 1) term
EFFECT = 0.3  # a true change of the expected MSE this large on every task is one the gate must see
TRUSTED_TAG = "autoresearch/trusted"

PREPARE = f'''\
"""Data preparation (trusted): public train/test features to --out, test targets to --sealed."""
import argparse
from pathlib import Path

import numpy as np

TASKS = {TASKS!r}
ROWS, FEATURES, NOISE, BEND = {ROWS}, {FEATURES}, {NOISE}, {BEND}

p = argparse.ArgumentParser()
p.add_argument("--seed", type=int, required=True)
p.add_argument("--out", type=Path, required=True)
p.add_argument("--sealed", type=Path, required=True)
a = p.parse_args()

rng = np.random.default_rng(a.seed)
x = rng.normal(size=(ROWS, FEATURES))
test = rng.random(ROWS) < {TEST_FRACTION!r}
ys = {{}}
for i, task in enumerate(TASKS):
    w = np.random.default_rng(10 + i).normal(scale=0.4, size=FEATURES)
    bend = BEND * np.where(np.arange(FEATURES) % 2 == i % 2, 1.0, -1.0)
    ys[task] = x @ w + (x**2 - 1) @ bend + rng.normal(scale=NOISE, size=ROWS)
ids = np.arange(ROWS)
np.savez(a.out / "train.npz", x=x[~test], **{{t: y[~test] for t, y in ys.items()}})
np.savez(a.out / "test.npz", id=ids[test], x=x[test])
np.savez(a.sealed / "targets.npz", id=ids[test], **{{t: y[test] for t, y in ys.items()}})
'''

SCORE = '''\
"""Scorer (trusted): mean squared error of --predictions (id,y) against the sealed targets."""
import argparse
import csv
import json
import sys
from pathlib import Path

import numpy as np

p = argparse.ArgumentParser()
p.add_argument("--task", required=True)
p.add_argument("--predictions", type=Path, required=True)
p.add_argument("--sealed", type=Path, required=True)
a = p.parse_args()

sealed = np.load(a.sealed / "targets.npz")
with a.predictions.open(newline="") as fh:
    rows = list(csv.reader(fh))
if not rows or rows[0] != ["id", "y"]:
    sys.exit("predictions: expected the header id,y")
got = {int(i): float(v) for i, v in rows[1:]}
if sorted(got) != sorted(int(i) for i in sealed["id"]):
    sys.exit("predictions: expected exactly one row per test id")
pred = np.array([got[int(i)] for i in sealed["id"]])
print(json.dumps({"value": float(np.mean((pred - sealed[a.task]) ** 2))}))
'''

TRAIN = '''\
"""Model (editable): ridge regression in closed form on a seed-dependent bag of the training rows."""
import argparse
import tomllib
from pathlib import Path

import numpy as np

p = argparse.ArgumentParser()
p.add_argument("--data", type=Path, required=True)
p.add_argument("--task", required=True)
p.add_argument("--seed", type=int, required=True)
p.add_argument("--out", type=Path, required=True)
a = p.parse_args()
cfg = tomllib.loads(Path("config.toml").read_text())["model"]


def design(x):
    parts = [np.ones((len(x), 1)), x] + ([x**2] if cfg["features"] == "quadratic" else [])
    return np.hstack(parts)


train, test = np.load(a.data / "train.npz"), np.load(a.data / "test.npz")
rows = np.random.default_rng(a.seed).random(len(train["x"])) < cfg["bag"]
X, y = design(train["x"][rows]), train[a.task][rows]
penalty = cfg["ridge"] * np.eye(X.shape[1])
penalty[0, 0] = 0.0  # never the intercept
w = np.linalg.solve(X.T @ X + penalty, X.T @ y)
with (a.out / "predictions.csv").open("w") as fh:
    fh.write("id,y\\n")
    fh.writelines(f"{i},{v:.8f}\\n" for i, v in zip(test["id"], design(test["x"]) @ w))
'''

CONFIG = f'''\
[model]
features = "linear"   # "linear" or "quadratic" (adds x**2 of every feature)
ridge = 0.1           # L2 penalty on the weights (never the intercept)
bag = {BAG}             # fraction of the training rows each seed fits on
'''

RESEARCH = '''\
[lab]
name = "ownlab"
program = "program.md"
editable = ["train.py", "config.toml"]

[benchmark]
harness = "command"
metric = "mse"
higher_is_better = false
perfect = 0.0
tasks = ["north", "south", "east"]
trusted = ["prepare.py", "score.py"]
prepare = "python prepare.py --seed {data_seed} --out {data} --sealed {sealed}"
score = "python score.py --task {task} --predictions {predictions} --sealed {sealed}"
data_seed = 0

[[stage]]
name = "fit"
run = "python train.py --data {data} --task {task} --seed {seed} --out {out}"
scope = "run"
inputs = ["train.py", "config.toml"]

[run]
timeout_s = 120
cpus = 1
retries = 1

[gate]
baseline_runs = 3
looks = [2, 3]

[search_space]
"model.features" = ["linear", "quadratic"]
"model.ridge" = [0.1, 30000.0]
'''

PROGRAM = """\
# Research program

Lower the mean squared error of the regressors on all three tasks. You may change train.py and
config.toml; prepare.py and score.py are the trusted harness.
"""


def true_mse(config_text: str, task: int) -> float:
    """The expected test MSE of a configuration, from the data-generating process of PREPARE.

    With X'X ≈ n·diag(var), ridge shrinks each coefficient by s = n·var / (n·var + λ); the error is
    what the model leaves of x·w (var 1 per feature) and of (x² − 1)·bend (var 2), plus the noise.
    Estimation noise (p/n·σ², about 0.01) is left out.
    """
    cfg = tomllib.loads(config_text)["model"]
    n = ROWS * (1 - TEST_FRACTION) * cfg["bag"]
    w2 = float(np.sum(np.random.default_rng(10 + task).normal(scale=0.4, size=FEATURES) ** 2))
    b2 = FEATURES * BEND**2
    s_lin = n / (n + cfg["ridge"])
    s_sq = 2 * n / (2 * n + cfg["ridge"]) if cfg["features"] == "quadratic" else 0.0
    return (1 - s_lin) ** 2 * w2 + 2 * (1 - s_sq) ** 2 * b2 + NOISE**2


def write_lab(root: Path) -> str:
    root.mkdir(parents=True)
    for name, text in {"prepare.py": PREPARE, "score.py": SCORE, "train.py": TRAIN, "config.toml": CONFIG,
                       "research.toml": RESEARCH, "program.md": PROGRAM, ".gitignore": "runs/\n__pycache__/\n"}.items():
        (root / name).write_text(textwrap.dedent(text))
    git(root, "init", "-q", "-b", "main")
    git(root, "config", "user.name", "own lab test")
    git(root, "config", "user.email", "own-lab@localhost")
    git(root, "add", ".")
    git(root, "commit", "-qm", "ownlab: ridge regression on three tasks")
    git(root, "branch", BASELINE, "HEAD")
    return git(root, "rev-parse", "HEAD")


@pytest.fixture
def own_lab(tmp_path: Path) -> tuple[Path, str]:
    root = tmp_path / "ownlab"
    return root, write_lab(root)


def test_the_truth_the_lab_is_built_on() -> None:
    """The planted effects are large against seed noise and below the plausibility hold (50%)."""
    lin, quad = CONFIG, CONFIG.replace('"linear"', '"quadratic"', 1)
    for t in range(len(TASKS)):
        base = true_mse(lin, t)
        assert base - true_mse(quad, t) > EFFECT  # squared features remove 2·6·0.2² = 0.48
        assert (base - true_mse(quad, t)) / base < 0.35  # far from "too good to be true"
        assert true_mse(lin.replace("ridge = 0.1", "ridge = 30000.0"), t) - base > EFFECT
        assert true_mse(quad.replace("ridge = 0.1", "ridge = 30000.0"), t) - true_mse(quad, t) > EFFECT


def test_own_lab_runs_offline_measures_gates_promotes_the_true_gain_and_abandons_the_harm(own_lab) -> None:
    from pipeline import experiment

    root, first = own_lab
    assert cli(root, "check").returncode == 0

    run = cli(root, "run", "--offline", "--json", "--max-hypotheses", "3", timeout=240)  # bounds its wall time
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout)
    assert out["started"] == 3 and len(out["hypotheses"]) == 3, out
    assert "Traceback" not in run.stderr

    # the trusted commit was set at the first run, at the baseline's head
    assert git(root, "rev-parse", f"{TRUSTED_TAG}^{{commit}}") == first
    assert cli_json(root, "trust", "--json")["commit"] == first

    # prepared data where the stages read it, targets sealed where only the scorer reads them
    did = f"command-{first[:12]}-d0"
    public, sealed = root / "runs" / "data" / did, root / "runs" / "sealed" / did
    assert json.loads((public / ".prepared").read_text()) == {"trusted": first, "data_seed": 0}
    assert sorted(p.name for p in public.iterdir()) == [".prepared", "test.npz", "train.npz"]
    assert sorted(p.name for p in sealed.iterdir()) == ["targets.npz"]
    assert stat.S_IMODE((root / "runs" / "sealed").stat().st_mode) == 0o700
    with np.load(public / "test.npz") as test, np.load(sealed / "targets.npz") as targets:
        assert set(test.files) == {"id", "x"}  # no target reaches {data}
        assert set(targets.files) == {"id", *TASKS}
        assert list(test["id"]) == list(targets["id"]) and 800 < len(test["id"]) < 1200

    from pipeline.experiment import Experiment, seed_block

    lab = open_lab(root)
    store = experiment.open_store(lab)
    exp = Experiment(lab, store)
    hs = sorted(records(root).all(), key=lambda h: h.id)
    assert [h.id for h in hs] == out["hypotheses"]
    base_results = {}
    promoted = []
    for h in hs:
        assert h.origin == "offline" and h.status == "done" and h.commit and h.base_commit, h
        # an offline hypothesis changes config.toml only: never a trusted file
        assert git(root, "diff", "--name-only", h.base_commit, h.commit) == "config.toml"
        base_cfg = git(root, "show", f"{h.base_commit}:config.toml")
        new_cfg = git(root, "show", f"{h.commit}:config.toml")

        # measured: one finite result per (task, challenger seed) of its look, and its baseline's runs
        results = store.results_for(h.commit)
        challenger = [r for r in results if r.seed in exp.challenger_seeds(h.base_commit, h.look)]
        assert h.look in (2, 3) and len(challenger) == h.look * len(TASKS), (h.id, len(challenger))
        assert {r.task for r in challenger} == set(TASKS)
        assert all(math.isfinite(r.value) for r in challenger)
        own = seed_block(exp.generation(h.base_commit))  # the baseline's own runs: its block
        baseline = [r for r in store.results_for(h.base_commit) if r.seed in own]
        # the lazy baseline: its seed k once a challenger reached seed k (the paired protocol's default)
        assert len(baseline) >= max(h.look, 2) * len(TASKS), (h.id, h.look, h.status, h.verdict, h.decision,
                                                              sorted({r.seed for r in baseline}))
        assert {r.seed for r in baseline} >= set(exp.challenger_seeds(h.base_commit, h.look))
        base_results[h.base_commit] = baseline

        for t, task in enumerate(TASKS):  # what was measured is what the data says it should be
            c = [r.value for r in challenger if r.task == task]
            b = [r.value for r in baseline if r.task == task]
            assert abs(np.mean(c) - true_mse(new_cfg, t)) < 0.3, (h.id, task, np.mean(c), true_mse(new_cfg, t))
            assert abs(np.mean(b) - true_mse(base_cfg, t)) < 0.3, (h.id, task, np.mean(b), true_mse(base_cfg, t))

        gain = [true_mse(base_cfg, t) - true_mse(new_cfg, t) for t in range(len(TASKS))]
        assert h.verdict, h
        if min(gain) > EFFECT:  # truly better on every task: the gate must see it, the loop promote it
            assert (h.verdict, h.decision) == ("improvement", "promote"), h
            promoted.append(h)
        elif max(gain) < -EFFECT:  # truly worse on every task
            assert h.verdict == "harm" and h.decision == "abandon" and h.promoted_tag is None, h
        else:
            assert h.decision != "promote", h

        summary = root / "runs" / "summaries" / f"{h.id}.md"
        text = summary.read_text()
        assert text.startswith(f"# Hypothesis {h.id}: {h.title}\n")
        assert "- **Metric:** mse, lower is better\n" in text
        assert f"verdict: {h.verdict}" in text
        n = h.look * len(TASKS)
        assert f"- **Runs:** {n} challenger runs ({n} done, 0 failed)" in text

    # the truth: squared features help, the huge ridge hurts; the offline search tries both
    changes = [tomllib.loads(git(root, "show", f"{h.commit}:config.toml"))["model"] for h in hs]
    assert any(c["features"] == "quadratic" and c["ridge"] == 0.1 for c in changes)
    assert any(c["ridge"] == 30000.0 for c in changes)
    assert len(promoted) == 1
    champion = promoted[0]
    assert champion.promoted_tag == "baseline/v1"
    assert git(root, "tag", "--list", "baseline/v*").split() == ["baseline/v1"]
    head = git(root, "rev-parse", BASELINE)
    assert head != first and head == git(root, "rev-parse", "baseline/v1^{commit}")
    assert tomllib.loads(git(root, "show", f"{BASELINE}:config.toml"))["model"]["features"] == "quadratic"
    git(root, "merge-base", "--is-ancestor", champion.commit, head)
    # the champion re-verified on fresh baseline seeds before its challengers were judged against it
    later = [h for h in hs if h.id > champion.id]
    assert later and all(h.base_commit == head for h in later)
    # lazily: the first look's seeds at its promotion, then as deep as its challengers' looks went
    assert len(base_results[head]) >= max([2] + [h.look for h in later]) * len(TASKS)

    st = cli_json(root, "status", "--json")
    assert st["lab"] == "ownlab" and st["sandbox"] == "on"
    assert st["baseline"] == {"commit": head, "tag": "baseline/v1"}
    assert [(x["id"], x["verdict"], x["decision"]) for x in st["hypotheses"]] == [
        (h.id, h.verdict, h.decision) for h in hs]
    assert st["queue"]["failed"] == 0 and st["queue"]["running"] == 0
    assert st["compute"]["useful_cpu_s"] > 0
