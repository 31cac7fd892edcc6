"""Run one template lab for one seed in this process: pretrain once, fine-tune and score each task.

Used by the benchmark scripts (one subprocess per (variant, seed), so torch is imported once per
seed rather than once per stage). Prints one JSON line: timings and per-task test AUC.
"""

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lab", required=True)
    ap.add_argument("--state", required=True)
    ap.add_argument("--suite", default="small")
    ap.add_argument("--customers", type=int, default=None)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--tasks", nargs="*", default=None)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from pipeline.harness import get_harness

    harness = get_harness("transactions")
    prepared = harness.prepare(Path(args.state), args.suite, 0, args.customers)
    sys.path.insert(0, args.lab)
    import train  # the lab's own train.py

    work = Path(args.work)
    t0 = time.perf_counter()
    train.pretrain(argparse.Namespace(data=str(prepared.public), seed=args.seed, out=str(work / "pretrain")))
    pretrain_s = time.perf_counter() - t0
    tokens_per_s = json.loads((work / "pretrain" / "metrics.json").read_text())["tokens_per_s"]
    result = {"seed": args.seed, "pretrain_s": pretrain_s, "pretrain_tokens_per_s": tokens_per_s,
              "finetune_s": {}, "auc": {}}
    for task in args.tasks or harness.tasks(args.suite):
        t0 = time.perf_counter()
        out = work / f"finetune-{task}"
        train.finetune(argparse.Namespace(data=str(prepared.public), task=task, seed=args.seed,
                                          pretrained=str(work / "pretrain"), out=str(out)))
        result["finetune_s"][task] = time.perf_counter() - t0
        result["auc"][task] = harness.score(prepared, task, out / "predictions.csv")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
