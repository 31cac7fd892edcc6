"""How fast is the template pipeline on one core? Targets for `small`: pretrain ≤ 30 s,
fine-tune + predict ≤ 15 s per (task, seed).

Runs the baseline template for SEEDS seeds on the small suite with one thread, in one process
per seed (torch imported once, as in the warm executor), and prints the medians, tokens/s and
the ratio of each to its target. Also prints the per-task test AUC (mean ± seed sd).

    .venv/bin/python benchmarks/pipeline_speed.py [--seeds 1] [--tasks churn_60d ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from headroom import make_lab, run_seed  # noqa: E402

PRETRAIN_TARGET_S, FINETUNE_TARGET_S = 30.0, 15.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=1)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="speed-"))
    lab = make_lab(tmp / "lab", [])
    runs = [run_seed(lab, tmp / "state", tmp / f"w{s}", s, None) for s in range(args.seeds)]
    pre = statistics.median(r["pretrain_s"] for r in runs)
    fts = [v for r in runs for v in r["finetune_s"].values()]
    ft = statistics.median(fts)
    tok = statistics.median(r["pretrain_tokens_per_s"] for r in runs)
    print(f"pretrain            {pre:6.1f} s   (target {PRETRAIN_TARGET_S:.0f} s, ratio {pre / PRETRAIN_TARGET_S:.2f})")
    print(f"finetune+predict    {ft:6.1f} s   median of {len(fts)}, max {max(fts):.1f} s "
          f"(target {FINETUNE_TARGET_S:.0f} s, ratio {ft / FINETUNE_TARGET_S:.2f})")
    print(f"pretrain tokens/s   {tok:8.0f}")
    print("test AUC by task:")
    for task in runs[0]["auc"]:
        vals = [r["auc"][task] for r in runs]
        sd = statistics.stdev(vals) if len(vals) > 1 else float("nan")
        print(f"  {task:20s} {statistics.mean(vals):.4f} ± {sd:.4f}")


if __name__ == "__main__":
    main()
