"""How much a lab's decisions depend on its secret holdout partition (issue 21: `make run` between
fresh clones).

    .venv/bin/python benchmarks/holdout_draws.py [--lab runs/demo-lab] [--draws 200] [--seed 0]

The transactions harness draws the sealed holdout (a third of the test rows) from secret entropy
when a lab's data is first prepared, so branch code cannot replay it; the gate scores every run on
the other two thirds. Two fresh labs therefore score the same predictions on different rows, and a
comparison near a boundary can land on either side of it. This script measures that, on a lab the
loop has already run (`make run`'s, by default), without running anything:

- every finished run's predictions are read back from the stage cache (its final stage's key);
- each draw is a new partition from the same rule (each test row in the holdout with probability
  1/3), and every run is re-scored on that draw's gate rows;
- each decided hypothesis is replayed on a copy of the store holding the re-scored values, through
  `Experiment.judge_look` (the same gate, seeds, baseline and priors), look after look as the
  offline policy follows the verdicts, up to the deepest look it reached in the lab; a replay that
  would need a deeper look than the lab ran is counted as "needs more runs".

Prints, per hypothesis, the lab's own outcome and how the draws decided it. The lab's own partition
is replayed first as a check: it must give the lab's recorded verdicts.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import sqlite3
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.experiment import Experiment  # noqa: E402
from pipeline.harness.base import auc, read_predictions  # noqa: E402
from pipeline.lab import load_lab  # noqa: E402
from pipeline.store import Store  # noqa: E402

HOLDOUT_FRACTION = 1 / 3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lab", default="runs/demo-lab")
    ap.add_argument("--draws", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    lab = load_lab(args.lab)
    harness = lab.harness()
    b = lab.config.benchmark
    prepared = harness.prepare(lab.state, b.suite, b.data_seed, **({"customers": b.customers} if b.customers else {}))
    ids = harness.test_ids(prepared)
    own_mask = harness.holdout_mask(prepared)
    if own_mask is None:
        raise SystemExit(f"{lab.root}: its harness has no holdout partition")
    db = lab.state / "autoresearch.db"
    con = sqlite3.connect(db)
    final = lab.stages_in_order()[-1].name
    runs = con.execute(
        "select r.run_id, r.task, r.value, e.key from result r join stage_exec e on e.run_id = r.run_id "
        "where r.value is not null and e.stage = ? and r.dataset_id = ? group by r.run_id",
        (final, prepared.dataset_id)).fetchall()
    labels = {t: harness.test_labels(prepared, t) for t in {r[1] for r in runs}}
    scores = {rid: (task, read_predictions(lab.state / "cache" / key / "predictions.csv", ids)) for rid, task, _, key in runs}
    # the check that these are the scored predictions: re-scored on the lab's own partition, each
    # run gives the value the driver stored
    drift = max((abs(auc(labels[t][~own_mask], scores[rid][1][~own_mask]) - v) for rid, t, v, _ in runs), default=0.0)
    hyps = con.execute("select id, title, base_commit, \"commit\", look, verdict, decision from hypothesis "
                       "where status = 'done' and decision in ('promote', 'abandon') order by id").fetchall()
    con.close()
    print(f"lab {lab.root}: {len(scores)} scored runs, {len(ids)} test rows, {len(hyps)} decided hypotheses, "
          f"{args.draws} draws; re-scored on the lab's own partition, the largest difference from a stored value is {drift:.2e}")

    tmp = Path(tempfile.mkdtemp(prefix="holdout-draws-"))
    try:
        copy = tmp / "store.db"
        shutil.copy(db, copy)
        store = Store(f"sqlite:///{copy}")

        def replay(mask: np.ndarray) -> dict[int, tuple[str, int]]:
            keep = ~mask
            values = [(auc(labels[t][keep], s[keep]), rid) for rid, (t, s) in scores.items()]
            c = sqlite3.connect(copy)
            c.executemany("update result set value = ? where run_id = ?", values)
            c.commit()
            c.close()
            exp = Experiment(lab, store)  # a fresh one: no frozen histories from the last draw
            out = {}
            looks = lab.config.gate.looks
            for hid, _title, base, commit, deepest, _v, _d in hyps:
                for look in looks:
                    verdict = exp.judge_look(base, commit, look).verdict
                    verdict = verdict.value if verdict is not None else "inconclusive"
                    if verdict != "escalate" or look == looks[-1]:
                        out[hid] = (verdict, look)
                        break
                    if look >= deepest:
                        out[hid] = ("needs more runs", look)
                        break
            return out

        own = replay(own_mask)
        rng = np.random.default_rng(args.seed)
        tally: dict[int, collections.Counter[str]] = {h[0]: collections.Counter() for h in hyps}
        for _ in range(args.draws):
            for hid, (verdict, look) in replay(rng.random(len(ids)) < HOLDOUT_FRACTION).items():
                tally[hid][f"{verdict}@{look}"] += 1
        store.dispose()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    ok = True
    for hid, title, _base, _commit, deepest, verdict, decision in hyps:
        mine = own.get(hid)
        same = mine == (verdict, deepest)
        ok &= same
        promoted = sum(n for k, n in tally[hid].items() if k.startswith("improvement@"))
        print(f"#{hid} {title!r}: lab {verdict}@{deepest} ({decision}); replayed on the lab's partition "
              f"{mine[0]}@{mine[1]}{'' if same else '  <-- differs'}")
        print(f"    {args.draws} draws: improvement (promoted) in {promoted} ({100 * promoted / args.draws:.1f} %); "
              + ", ".join(f"{k} {n}" for k, n in tally[hid].most_common()))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
