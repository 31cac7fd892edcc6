"""The scorer (trusted): log-loss of --predictions against the sealed test labels of --task.

Prints {"value": x} as its last line of stdout. Run by autoresearch in the sandbox, reading only
the predictions file and the sealed folder.

    python score.py --task default --predictions PRED.csv --sealed SEALED
"""

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

sealed = np.load(a.sealed / "test_labels.npz")
with a.predictions.open(newline="") as fh:
    rows = list(csv.reader(fh))
if not rows or rows[0] != ["id", "score"]:
    sys.exit("predictions: expected the header id,score")
got = {int(i): float(s) for i, s in rows[1:]}
missing = [int(i) for i in sealed["id"] if int(i) not in got]
if missing or len(got) != len(sealed["id"]):
    sys.exit(f"predictions: {len(missing)} test ids missing, {len(got)} rows for {len(sealed['id'])} ids")
prob = np.clip(np.array([got[int(i)] for i in sealed["id"]]), 1e-6, 1 - 1e-6)
y = sealed[a.task]
print(json.dumps({"value": float(-np.mean(y * np.log(prob) + (1 - y) * np.log(1 - prob)))}))
