"""The template's own pipeline, run for real on a tiny dataset: pretrain, finetune, score."""

import math
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import tomli_w

from pipeline.harness import get_harness
from pipeline.harness.transactions.variants import NOOPS, apply_edit

pytestmark = pytest.mark.system

TEMPLATE = Path(__file__).resolve().parent.parent / "pipeline" / "templates" / "transactions"
TINY = {"data": {"max_events": 8}, "model": {"d_model": 16, "n_layers": 1, "n_heads": 2},
        "pretrain": {"epochs": 1}, "finetune": {"epochs": 1}}


def tiny_lab(dst: Path, sources=None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in ("model.py", "train.py", "config.toml"):
        shutil.copy(TEMPLATE / f, dst / f)
    cfg = tomllib.loads((dst / "config.toml").read_text())
    for section, values in TINY.items():
        cfg[section].update(values)
    if sources:
        cfg["data"]["sources"] = sources
    (dst / "config.toml").write_text(tomli_w.dumps(cfg))
    return dst


def run(lab: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "train.py", *args], cwd=lab, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return get_harness("transactions").prepare(tmp_path_factory.mktemp("state"), "small", 0, customers=400)


def test_tiny_pretrain_finetune_and_score(prepared, tmp_path):
    lab = tiny_lab(tmp_path / "lab", sources=["card", "pix", "app", "bill"])
    run(lab, "pretrain", "--data", str(prepared.public), "--seed", "3", "--out", str(tmp_path / "pre"))
    assert (tmp_path / "pre" / "model.pt").is_file()
    run(lab, "finetune", "--data", str(prepared.public), "--task", "churn_60d", "--seed", "3",
        "--pretrained", str(tmp_path / "pre"), "--out", str(tmp_path / "ft"))
    value = get_harness("transactions").score(prepared, "churn_60d", tmp_path / "ft" / "predictions.csv")
    assert math.isfinite(value) and 0.0 <= value <= 1.0


def run_in_process(lab: Path, prepared, work: Path, seed: int = 1, task: str = "default_90d") -> str:
    """Pretrain and fine-tune the lab's own code in this process; return predictions.csv's text."""
    import argparse
    import importlib

    sys.path.insert(0, str(lab))
    try:
        for mod in ("train", "model"):
            sys.modules.pop(mod, None)
        train = importlib.import_module("train")
        pre, ft = work / "pre", work / "ft"
        train.pretrain(argparse.Namespace(data=str(prepared.public), seed=seed, out=str(pre)))
        train.finetune(argparse.Namespace(data=str(prepared.public), task=task, seed=seed, pretrained=str(pre), out=str(ft)))
        return (ft / "predictions.csv").read_text()
    finally:
        sys.path.remove(str(lab))
        for mod in ("train", "model"):
            sys.modules.pop(mod, None)


def test_same_seed_same_predictions_and_noops_change_nothing(prepared, tmp_path):
    """Seeds make runs reproducible, and the known no-op edits really are behaviour-preserving:
    a sound gate can then never promote them."""
    base = run_in_process(tiny_lab(tmp_path / "lab"), prepared, tmp_path / "w0")
    assert run_in_process(tiny_lab(tmp_path / "again"), prepared, tmp_path / "w1") == base
    for name, edits in NOOPS.items():
        lab = tiny_lab(tmp_path / name)
        for edit in edits:
            apply_edit(lab, edit)
        assert run_in_process(lab, prepared, tmp_path / f"w-{name}") == base, name


@pytest.mark.parametrize("name", sorted(NOOPS))
def test_noop_variants_apply_to_the_template(name, tmp_path):
    lab = tiny_lab(tmp_path / "lab")
    for edit in NOOPS[name]:
        apply_edit(lab, edit)
    compile((lab / "model.py").read_text(), "model.py", "exec")
    tomllib.loads((lab / "config.toml").read_text())
