"""Harness "transactions": a CPU-sized miniature of a bank's multi-task transaction benchmark.

`prepare` writes the public data a stage sees as `{data}` (train/val labels, test features only)
and, in a separate folder that no stage argument reaches, the sealed test labels that only
`score` reads, with the sealed partition of the test rows into the `gate` split (2/3) and the
`holdout` split (1/3, scored only for champions; see `Harness` in base.py).
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import tempfile
from pathlib import Path

import numpy as np

from pipeline.harness.base import Harness, Prepared
from pipeline.harness.transactions import data as gen

GENERATOR_VERSION = 2  # 2: the test rows are partitioned into gate and holdout
HOLDOUT_FRACTION = 1 / 3


class TransactionsHarness(Harness):
    name = "transactions"
    suites = gen.SUITES
    metrics = {"auc"}

    def dataset_id(self, suite: str, data_seed: int, customers: int | None = None, smoke: bool = False) -> str:
        n = customers or gen.DEFAULT_CUSTOMERS[suite]
        return f"transactions-v{GENERATOR_VERSION}-{suite}{'-smoke' if smoke else ''}-d{data_seed}-n{n}"

    def prepare(self, state_dir: Path, suite: str, data_seed: int, customers: int | None = None, *,
                smoke: bool = False) -> Prepared:
        """Generate once per (suite, data seed, size, smoke or not); later calls, from any process,
        reuse it. A smoke dataset shares no customer with a real one (`data.generate`)."""
        state_dir = Path(state_dir)
        did = self.dataset_id(suite, data_seed, customers, smoke)
        prepared = Prepared(did, state_dir / "data" / did, state_dir / "sealed" / did)
        if (prepared.public / "meta.json").is_file() and (prepared.sealed / "splits.npz").is_file():
            return prepared
        (state_dir / "data").mkdir(parents=True, exist_ok=True)
        with open(state_dir / "data" / f".{did}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (prepared.public / "meta.json").is_file():
                self._write(prepared, suite, data_seed, customers, smoke)
        return prepared

    def _write(self, prepared: Prepared, suite: str, data_seed: int, customers: int | None, smoke: bool) -> None:
        ds = gen.generate(suite, data_seed, customers, smoke)
        test = ds.split == 2
        sealed_tmp = Path(tempfile.mkdtemp(dir=_mk(prepared.sealed.parent)))  # mkdtemp makes it 0700
        np.savez(sealed_tmp / "test_labels.npz", ids=ds.ids[test], **{t: y[test] for t, y in ds.labels.items()})
        # the holdout rows, from secret entropy: the data is public and deterministic by data seed, so a
        # seeded draw could be replayed by branch code; this partition exists only in the seal
        holdout = np.random.default_rng(secrets.randbits(128)).random(int(test.sum())) < HOLDOUT_FRACTION
        np.savez(sealed_tmp / "splits.npz", holdout=holdout)
        shutil.rmtree(prepared.sealed, ignore_errors=True)
        os.replace(sealed_tmp, prepared.sealed)

        tmp = Path(tempfile.mkdtemp(dir=prepared.public.parent))
        np.savez(tmp / "customers.npz", id=ds.ids, split=ds.split, tabular=ds.tabular)
        np.savez(tmp / "events.npz", **ds.events)
        # Test rows carry -1: the labels a stage can read stop at train and val.
        np.savez(tmp / "labels.npz", **{t: np.where(test, -1, y).astype(np.int8) for t, y in ds.labels.items()})
        meta = {
            "dataset_id": prepared.dataset_id,
            "suite": suite,
            "data_seed": data_seed,
            "smoke": smoke,
            "customers": int(len(ds.ids)),
            "tasks": list(ds.labels),
            "sources": gen.SOURCES,
            "categories": gen.N_CATEGORIES,
            "amount_buckets": gen.N_AMOUNT_BUCKETS,
            "window_days": gen.WINDOW_DAYS,
            "tabular": gen.TABULAR,
            "tabular_groups": {"basic": gen.BASIC_TABULAR, "bureau": gen.BUREAU_TABULAR},
            "splits": {"train": int((ds.split == 0).sum()), "val": int((ds.split == 1).sum()), "test": int(test.sum())},
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        os.chmod(tmp, 0o755)
        shutil.rmtree(prepared.public, ignore_errors=True)
        os.replace(tmp, prepared.public)

    def test_ids(self, prepared: Prepared) -> np.ndarray:
        with np.load(prepared.sealed / "test_labels.npz") as z:
            return z["ids"]

    def test_labels(self, prepared: Prepared, task: str) -> np.ndarray:
        with np.load(prepared.sealed / "test_labels.npz") as z:
            if task not in z.files:
                from pipeline.errors import UserError

                raise UserError(f"unknown task {task!r} for dataset {prepared.dataset_id}")
            return z[task]

    def holdout_mask(self, prepared: Prepared) -> np.ndarray | None:
        with np.load(prepared.sealed / "splits.npz") as z:
            return z["holdout"]


def _mk(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path
