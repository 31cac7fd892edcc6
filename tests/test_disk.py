"""Bounded disk: LRU eviction of the stage cache under a cap set low enough to evict, never an entry
the baseline or a commit in flight needs, and an evicted entry recomputed rather than missing;
log rotation; disk use in `status`. Real driver, real warm executor, real git and SQLite."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from support.tiny import TASKS, TinyHarness, commit_change, git, make_lab, open_tiny_lab

from pipeline import experiment, labrepo, runner
from pipeline.dag import Cache
from pipeline.disk import DiskKeeper

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BASE = "autoresearch/baseline"
SEEDS = [0, 1]
PRETRAIN = ("[pretrain]\nsleep = 0.0", "[pretrain]\nsleep = 0.01")  # a change that re-runs pretraining


def drive(lab, store, rev: str) -> list[int]:
    ids = experiment.ensure_runs(store, lab, rev, TASKS, SEEDS, harness=TinyHarness())
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
    store = experiment.open_store(lab)
    base_ids = drive(lab, store, BASE)
    ch1 = commit_change(lab.root, "ch1", "config.toml", *PRETRAIN)
    drive(lab, store, ch1)
    ch1_keys = store.keys_of([ch1]) - store.keys_of([labrepo.resolve_commit(lab, BASE)])
    assert ch1_keys  # its own pretraining and fine-tuning outputs
    ch2 = commit_change(lab.root, "ch2", "config.toml", "shrink = 0.1", "shrink = 0.3")
    drive(lab, store, ch2)

    cache = Cache(lab.state / "cache")
    base_keys = store.keys_of([labrepo.resolve_commit(lab, BASE)])
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
    store = experiment.open_store(lab)
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
    store = experiment.open_store(lab)
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


def test_smoke_logs_rotate_with_the_stage_logs_but_never_a_fresh_one(lab: Path) -> None:
    """Real smoke runs (the tiny transactions lab, each stage a flood of output and exit 1) leave their
    logs in runs/logs/smoke/<run>/; they count against `logs_max_mb` with the stage logs, oldest first,
    and a smoke run's folder written in the last SMOKE_FRESH_S (it may be in use) is kept."""
    import pytest

    from pipeline.disk import SMOKE_FRESH_S
    from pipeline.errors import MethodFailure
    from pipeline.lab import load_lab
    from pipeline.smoke import SmokeRunner, smoke_run

    the_lab = load_lab(lab)
    flood = "import sys\nsys.stderr.write('x' * (400 * 1024))\nsys.exit(1)\n"
    smoke = SmokeRunner(the_lab)
    try:
        for _ in range(3):
            with pytest.raises(MethodFailure, match="exited with 1"):
                smoke_run(the_lab, "autoresearch/baseline", {"train.py": flood}, runner=smoke)
    finally:
        smoke.close()
    logs = the_lab.state / "logs"
    runs = sorted((logs / "smoke").iterdir())
    assert len(runs) == 3 and all(sum(p.stat().st_size for p in d.glob("*.log")) >= 400 * 1024 for d in runs)
    now = time.time()
    for i, d in enumerate(runs):  # the first two are old, the last one was just written
        age = now - 10 * SMOKE_FRESH_S + i if i < 2 else now
        for p in [*d.glob("*.log"), d]:
            os.utime(p, (age, age))
    stage_log = logs / "stage-old.log"
    stage_log.write_bytes(b"y" * (400 * 1024))
    os.utime(stage_log, (now - SMOKE_FRESH_S, now - SMOKE_FRESH_S))
    keeper = DiskKeeper(the_lab, experiment.open_store(the_lab), Cache(the_lab.state / "cache"), logs)
    keeper.logs_max = 1 << 20  # ~1.6 MB of logs against a 1 MB cap
    assert keeper.rotate_logs() >= 2
    assert [d.exists() for d in runs] == [False, False, True]  # the oldest smoke runs went first, folders too
    assert stage_log.exists()  # newer than them: it stays
    keeper.logs_max = 0
    keeper.rotate_logs()
    assert runs[2].is_dir() and not stage_log.exists()  # a fresh smoke run's logs are never removed


def test_a_new_smoke_folder_without_logs_is_fresh_and_stays(lab: Path) -> None:
    """The race: smoke_run makes its folder, then opens its first stage's log. A rotation in between
    saw a folder with no log, not fresh, and removed it (the stage's log then had no folder). The
    folder's own mtime now counts; it goes once older than SMOKE_FRESH_S, at least twice a smoke
    stage's limit."""
    from pipeline.disk import SMOKE_FRESH_S
    from pipeline.lab import load_lab
    from pipeline.smoke import SMOKE_TIMEOUT_S

    assert SMOKE_FRESH_S >= 2 * SMOKE_TIMEOUT_S
    the_lab = load_lab(lab)
    logs = the_lab.state / "logs"
    new = logs / "smoke" / "20990101-000000-abcdef"
    new.mkdir(parents=True)  # as smoke_run does, before any stage starts
    old = logs / "smoke" / "20000101-000000-012345"
    old.mkdir()
    (old / "train.log").write_bytes(b"z" * 1000)
    aged = time.time() - SMOKE_FRESH_S - 5
    for p in (old / "train.log", old):
        os.utime(p, (aged, aged))
    keeper = DiskKeeper(the_lab, experiment.open_store(the_lab), Cache(the_lab.state / "cache"), logs)
    keeper.logs_max = 0
    assert keeper.rotate_logs() == 1
    assert new.is_dir() and not old.exists()  # the new folder stays, the old one is emptied and removed
    (new / "train.log").write_text("the first stage's output\n")  # the stage can open its log
    # a folder whose logs look old but which was written to just now (a stage's log opened) stays whole
    os.utime(new / "train.log", (aged, aged))
    assert keeper.rotate_logs() == 0 and (new / "train.log").exists()
    os.utime(new, (aged, aged))  # then, aged past SMOKE_FRESH_S, it goes
    assert keeper.rotate_logs() == 1 and not new.exists()
