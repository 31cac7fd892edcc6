"""The simulated lab's one stage: sleep, then report a planted metric (standard library only).

value = 0.7 + 0.01 * task_index + sigma * (effect + sqrt(pair_rho) * shared + sqrt(1 - pair_rho) * own)

- effect: the sum of `effect` over every effect_*.toml in this directory (plus its `[task]` entry
  for this task and its `[seed]` entry for this seed, if any: a gain that shows on some seeds only,
  as a lucky selection does), in σ units;
- shared: seed k's draw for this task, the same for every commit (so both arms of a comparison at
  seed k share it), itself sqrt(task_rho) * a draw for seed k common to every task + the rest;
- own: a draw for (task, seed, the effect files' contents): a no-op commit reproduces its parent.
"""

import argparse
import hashlib
import json
import math
import random
import time
import tomllib
from pathlib import Path


def draw(*key) -> float:
    return random.Random(hashlib.sha256(repr(key).encode()).digest()).gauss(0.0, 1.0)


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("--data", "--task", "--out"):
        p.add_argument(name, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--sleep", type=float, default=2.0)
    p.add_argument("--sigma", type=float, default=0.01)
    p.add_argument("--pair-rho", type=float, default=0.76)
    p.add_argument("--task-rho", type=float, default=0.02)
    a = p.parse_args()
    meta = json.loads((Path(a.data) / "sim.json").read_text())
    effect, texts = 0.0, []
    for f in sorted(Path(".").glob("effect_*.toml")):
        text = f.read_text()
        texts.append((f.name, text))
        doc = tomllib.loads(text)
        effect += (float(doc.get("effect", 0.0)) + float(doc.get("task", {}).get(a.task, 0.0))
                   + float(doc.get("seed", {}).get(str(a.seed), 0.0)))
    index = int(a.task[1:]) if a.task[1:].isdigit() else 0
    shared = math.sqrt(a.task_rho) * draw("seed", a.seed) + math.sqrt(1 - a.task_rho) * draw("task", a.task, a.seed)
    own = draw("own", a.task, a.seed, tuple(texts))
    value = 0.7 + 0.01 * index + a.sigma * (effect + math.sqrt(a.pair_rho) * shared + math.sqrt(1 - a.pair_rho) * own)
    if not meta.get("smoke"):
        time.sleep(a.sleep)
    out = Path(a.out)
    (out / "predictions.csv").write_text(f"id,score\n0,{value!r}\n")


if __name__ == "__main__":
    main()
