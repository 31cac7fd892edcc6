"""The model (editable): L2-regularised logistic regression, trained by gradient descent.

Fits on a seed-dependent bag of the training rows and writes predictions.csv (id, probability of
label 1) for every test id. Settings are in config.toml. Run by autoresearch as

    python train.py --data DATA --task default --seed 0 --out OUT
"""

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
cfg = tomllib.loads(Path("config.toml").read_text())["train"]


def features(x: np.ndarray) -> np.ndarray:
    parts = [x, x**2] if cfg["features"] == "squares" else [x]
    return np.hstack([np.ones((len(x), 1), dtype=x.dtype), *parts])


train, test = np.load(a.data / "train.npz"), np.load(a.data / "test.npz")
rng = np.random.default_rng(a.seed)
rows = rng.random(len(train["x"])) < cfg["bag"]
x, y = features(train["x"][rows]), train[a.task][rows].astype(np.float64)
w = rng.normal(scale=0.01, size=x.shape[1])
for _ in range(cfg["epochs"]):
    prob = 1 / (1 + np.exp(-x @ w))
    w -= cfg["lr"] * (x.T @ (prob - y) / len(y) + cfg["l2"] * w)

prob = 1 / (1 + np.exp(-features(test["x"]) @ w))
with (a.out / "predictions.csv").open("w") as fh:
    fh.write("id,score\n")
    fh.writelines(f"{i},{s:.6f}\n" for i, s in zip(test["id"], prob))
