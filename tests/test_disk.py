"""Bounded disk: LRU eviction of the stage cache under a cap set low enough to evict, never an entry
the baseline or a commit in flight needs, and an evicted entry recomputed rather than missing;
log rotation; disk use in `status`. Real driver, real warm executor, real git and SQLite."""

from __future__ import annotations

import os
import time
from pathlib import Path

from exec_fixtures import TASKS, TinyHarness, commit_change, git, make_lab, open_tiny_lab

from pipeline import runner
from pipeline.dag import Cache
from pipeline.disk import DiskKeeper

BASE = "autoresearch/baseline"
SEEDS = [0, 1]
PRETRAIN = ("[pretrain]\nsleep = 0.0", "[pretrain]\nsleep = 0.01")  # a change that re-runs pretraining


def drive(lab, store, rev: str) -> list[int]:
    ids = runner.ensure_runs(store, lab, rev, TASKS, SEEDS, harness=TinyHarness())
    with runner.Driver(lab, store, runner.make_executor("local", lab, workers=2, preload=("numpy",)),
                       harness=TinyHarness()) as d:
        d.drive(until=ids, timeout_s=180)
    return ids


def bounded(lab_root: Path, gb: float):
    path = lab_root / "research.toml"
    path.write_text(path.read_text().replace("cpus = 1\n", f"cpus = 1\ncache_max_gb = {gb}\n"))
    git(lab_root, "commit", "-qam", "cache cap")
    return open_tiny_lab(lab_root)


def test_eviction_keeps_what_is_needed_and_an_evicted_entry_is_recomputed(tmp_path: Path) -> None:
    lab = bounded(make_lab(tmp_path / "lab").root, 1e-6)  # ~1 KB: every entry not needed goes
    store = runner.open_store(lab)
    base_ids = drive(lab, store, BASE)
    ch1 = commit_change(lab.root, "ch1", "config.toml", *PRETRAIN)
    drive(lab, store, ch1)
    ch1_keys = store.keys_of([ch1]) - store.keys_of([runner.resolve_commit(lab, BASE)])
    assert ch1_keys  # its own pretraining and fine-tuning outputs
    ch2 = commit_change(lab.root, "ch2", "config.toml", "shrink = 0.1", "shrink = 0.3")
    drive(lab, store, ch2)

    cache = Cache(lab.state / "cache")
    base_keys = store.keys_of([runner.resolve_commit(lab, BASE)])
    assert base_keys and all(cache.has(k) for k in base_keys)  # the baseline's entries are never evicted
    assert not any(cache.has(k) for k in ch1_keys), "ch1 is decided and not in flight: its entries go"

    # a commit that needs ch1's evicted pretraining outputs again: recomputed, every run done
    git(lab.root, "checkout", "-q", "-b", "ch3", "ch1")
    text = (lab.root / "config.toml").read_text()
    (lab.root / "config.toml").write_text(text.replace("shrink = 0.1", "shrink = 0.2"))
    git(lab.root, "commit", "-qam", "ch3")
    ch3 = git(lab.root, "rev-parse", "HEAD")
    git(lab.root, "checkout", "-q", BASE)
    ids = drive(lab, store, ch3)
    runs = store.runs(ids)
    assert all(r.status == "done" for r in runs)
    assert all(r.outcome == "ok" for r in store.results_for(ch3))
    pretrain_keys = {e.key for e in store.stage_execs(ids) if e.stage == "pretrain"}
    assert pretrain_keys & ch1_keys  # the same inputs as ch1's pretraining: the same keys...
    executed = [e for e in store.stage_execs() if e.key in pretrain_keys & ch1_keys and e.outcome == "ok"]
    assert len(executed) >= 2 * len(pretrain_keys & ch1_keys)  # ...executed again after their eviction
    assert store.runs(base_ids)[0].status == "done"


def test_the_cache_without_a_cap_keeps_everything_and_status_shows_disk_use(tmp_path: Path) -> None:
    lab = make_lab(tmp_path / "lab")
    path = lab.root / "research.toml"
    store = runner.open_store(lab)
    drive(lab, store, BASE)
    ch1 = commit_change(lab.root, "ch1", "config.toml", *PRETRAIN)
    drive(lab, store, ch1)
    uses = store.cache_uses()
    assert uses and all(u.size_bytes > 0 for u in uses)  # 50 GB by default: nothing evicted here
    cache = Cache(lab.state / "cache")
    assert all(cache.has(u.key) for u in uses)
    from pipeline.disk import usage

    du = usage(lab, store)
    assert du["cache_mb"] > 0 and du["cache_max_gb"] == 50.0 and du["worktrees_mb"] > 0 and "logs_mb" in du
    assert "cache_max_gb" not in path.read_text()


def test_logs_are_rotated_oldest_first_but_never_one_in_use(tmp_path: Path) -> None:
    lab = make_lab(tmp_path / "lab")
    store = runner.open_store(lab)
    logs = lab.state / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    now = time.time()
    paths = []
    for i in range(6):
        p = logs / f"stage-{i}.log"
        p.write_bytes(b"x" * (400 * 1024))  # 6 × 400 KB against a 1 MB cap
        os.utime(p, (now - 100 + i, now - 100 + i))
        paths.append(p)
    keeper = DiskKeeper(lab, store, Cache(lab.state / "cache"), logs)
    keeper.logs_max = 1 << 20
    removed = keeper.rotate_logs(keep=[paths[0]])  # the oldest is in use by a running stage
    assert removed == 4
    assert [p.exists() for p in paths] == [True, False, False, False, False, True]  # 800 KB left
