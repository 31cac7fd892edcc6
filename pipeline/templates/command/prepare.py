"""Data preparation (trusted): writes what the model may see to --out and the test labels to --sealed.

A stand-in for your own: replace the generator with reading your data. Run by autoresearch once
per (trusted commit, data seed), in the sandbox, with --out and --sealed its only writable folders.

    python prepare.py --seed 0 --out DATA --sealed SEALED [--smoke 1]

--smoke 1 is autoresearch's smoke run (a candidate's whole pipeline on tiny data before it is
measured): give it a small dataset whose rows and ids are apart from the real ones.
"""

import argparse
import secrets
from pathlib import Path

import numpy as np

TASKS = ["default", "churn", "fraud"]
ROWS, SMOKE_ROWS, FEATURES = 4000, 1000, 10

p = argparse.ArgumentParser()
p.add_argument("--seed", type=int, required=True)
p.add_argument("--out", type=Path, required=True)
p.add_argument("--sealed", type=Path, required=True)
p.add_argument("--smoke", type=int, default=0)  # its seed is apart too: 2**31 + the lab's data_seed
a = p.parse_args()
if a.smoke:
    ROWS = SMOKE_ROWS

rng = np.random.default_rng(a.seed)
x = rng.normal(size=(ROWS, FEATURES)).astype(np.float32)
split = rng.choice([0, 1, 2], size=ROWS, p=[0.6, 0.1, 0.3])  # train, val, test
labels = {}
for i, task in enumerate(TASKS):
    w = np.random.default_rng(100 + i).normal(size=FEATURES)
    bend = np.random.default_rng(200 + i).normal(size=FEATURES)
    logit = 0.7 * x @ w + 0.6 * (x**2 - 1) @ bend - 0.5  # a non-linear part the raw features miss
    labels[task] = (rng.random(ROWS) < 1 / (1 + np.exp(-logit))).astype(np.int8)

ids = np.arange(ROWS) + (10**9 if a.smoke else 0)
test = split == 2
np.savez(a.out / "train.npz", x=x[~test], split=split[~test], **{t: y[~test] for t, y in labels.items()})
np.savez(a.out / "test.npz", id=ids[test], x=x[test])
np.savez(a.sealed / "test_labels.npz", id=ids[test], **{t: y[test] for t, y in labels.items()})
# a third of the test rows are the holdout: scored only for champions, never seen by the gate; drawn
# from secret entropy, so code that sees the public data cannot replay which rows they are
holdout = np.random.default_rng(secrets.randbits(128)).random(int(test.sum())) < 1 / 3
np.savez(a.sealed / "splits.npz", holdout=holdout)
