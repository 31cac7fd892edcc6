"""The lab's git repository after months of the loop, before and after its upkeep.

    nice -n 10 .venv/bin/python benchmarks/repo_upkeep.py [--days 365] [--runs-per-day 1000]
        [--repeat 3] [--workdir DIR] [--keep] [--out benchmarks/results/repo_upkeep.txt]

The repository a busy lab's loop leaves after `--days` at `--runs-per-day` runs a day, built as
`benchmarks/long_run.py` builds it (the same plan of hypotheses and promotions: a real lab from
`autoresearch init`, each hypothesis's commit, branch `hyp/<id>-<slug>` and annotated tag `exp/<id>`,
the baseline's `baseline/vN` tags, in one `git fast-import`), then left as the loop's plumbing
(`commit-tree`, `update-ref`, `git tag`) leaves it: every ref a loose file, and every object loose
(the fast-import pack unpacked with `git unpack-objects`), since no plumbing command runs git's gc.

Then, on that repository, each call the loop and `status` make per hypothesis or per view, timed
as the code was before this benchmark's commit (`old`: GitPython's `repo.tags`, which reads every
tag, and a `cat-file` per commit for the duplicate check) and as it is now (`new`: one ref looked up,
`for-each-ref` on the baseline tags, the trees of every commit in one `git log --no-walk`), first with
the loose repository, then after the loop's upkeep (`LabRepo.maintain`: `git pack-refs --all`, `git
gc --auto`; here with `gc.autoDetach=false`, so its time is measured). `ms`: the median of
`--repeat` calls after the first; the duplicate check is cold each time (its tree cache cleared),
as in a fresh process. Then the disk the refs and objects take, from `du` and `git count-objects`.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


def du_kb(path: Path) -> int:
    return int(subprocess.run(["du", "-sk", str(path)], capture_output=True, text=True, check=True).stdout.split()[0])


def count_objects(root: Path) -> dict[str, int]:
    out = subprocess.run(["git", "count-objects", "-v"], cwd=root, capture_output=True, text=True, check=True).stdout
    return {k: int(v) for k, v in (line.split(": ") for line in out.splitlines()) if v.strip().isdigit()}


def loose_refs(root: Path) -> int:
    return sum(1 for p in (root / ".git" / "refs").rglob("*") if p.is_file())


def timed(fn: Callable[[], Any], repeat: int, before: Callable[[], None] | None = None) -> float:
    """The median of `repeat` calls after a first, in ms."""
    times = []
    for _ in range(repeat + 1):
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times[1:])


def build(work: Path, days: int, runs_per_day: int, seed: int) -> tuple[Path, list[str], str, str]:
    """The lab's repository after `days`, every ref and object loose: (root, every hypothesis's commit,
    the baseline's head, the newest hypothesis's tag name)."""
    import long_run
    from agent.config import open_lab
    from agent.labinit import init_lab
    from pipeline.gate.protocol import get_protocol

    rng = random.Random(seed * 1000 + days)
    root = work / "lab"
    init_lab(root, suite="small", gpus=0.25)
    lab = open_lab(root)
    g = lab.config.gate
    min_base = get_protocol(g.protocol).baseline_runs_at(1, g.baseline_runs)
    hyps, units = long_run.plan(rng, runs_per_day * days, len(lab.tasks()), list(g.looks), g.baseline_runs,
                                g.noise_runs, min_base)
    end = time.time() - 60
    shas = long_run.build_git(root, hyps, end - days * long_run.DAY, (days * long_run.DAY - 600) / units, rng)
    packs = root / ".git" / "objects" / "pack"
    for pack in sorted(packs.glob("*.pack")):  # as the plumbing leaves them: every object loose
        moved = work / pack.name
        shutil.move(pack, moved)
        pack.with_suffix(".idx").unlink()
        with open(moved, "rb") as fh:
            subprocess.run(["git", "unpack-objects", "-q"], cwd=root, stdin=fh, check=True)
        moved.unlink()
    commits = [shas[h.mark] for h in hyps if h.mark is not None]
    head = subprocess.run(["git", "rev-parse", "autoresearch/baseline"], cwd=root, capture_output=True, text=True,
                          check=True).stdout.strip()
    newest = max(h.id for h in hyps if h.mark is not None)
    return root, commits, head, f"exp/{newest}"


def calls(root: Path, commits: list[str], head: str, tag: str, repeat: int) -> dict[str, tuple[float, float]]:
    """(old ms, new ms) of each call."""
    from pipeline import labrepo
    from pipeline.labrepo import LabRepo, baseline_number

    repo = LabRepo(root)

    def old_trees() -> None:  # a `cat-file` per commit (GitPython's persistent one), as before
        for c in commits:
            repo.tree(c)

    def cold() -> None:
        labrepo._trees.clear()

    return {
        f"duplicate check: the trees of {len(commits)} commits (cold)":
            (timed(old_trees, repeat, cold), timed(lambda: repo.trees(commits), repeat, cold)),
        "tag lookup (`tag`, `tagged`: exp/<id> exists?)":
            (timed(lambda: tag in repo.repo.tags, repeat), timed(lambda: repo._tag_commit(tag), repeat)),
        "baseline_tags (web overview, implement, MLflow)":
            (timed(lambda: [t.name for t in repo.repo.tags if baseline_number(t.name) is not None], repeat),
             timed(repo.baseline_tags, repeat)),
        "baseline_tag(head) (status; unchanged code)":
            (timed(lambda: repo.baseline_tag(head), repeat),) * 2,
    }


def disk(root: Path) -> dict[str, int]:
    c = count_objects(root)
    return {"loose refs": loose_refs(root), "refs KB (du)": du_kb(root / ".git" / "refs"),
            "packed-refs KB": (root / ".git" / "packed-refs").stat().st_size // 1024
            if (root / ".git" / "packed-refs").exists() else 0,
            "loose objects": c["count"], "objects KB (du)": du_kb(root / ".git" / "objects"),
            "objects in packs": c["in-pack"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--days", type=int, default=365)
    p.add_argument("--runs-per-day", type=int, default=1000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--keep", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    from pipeline.labrepo import LabRepo

    head_sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=False).stdout.strip()
    if subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                      text=True, check=False).stdout.strip():
        head_sha += " with uncommitted changes"
    work = Path(tempfile.mkdtemp(prefix="repo-upkeep-", dir=args.workdir))
    lines = [f"$ .venv/bin/python benchmarks/repo_upkeep.py {' '.join(sys.argv[1:])}".rstrip()]
    try:
        t = time.perf_counter()
        root, commits, head, tag = build(work, args.days, args.runs_per_day, args.seed)
        lines.append(f"# {time.strftime('%Y-%m-%d %H:%M')} at {head_sha}; {args.days} days at {args.runs_per_day} "
                     f"runs/day: {len(commits)} hypothesis commits, built loose in {time.perf_counter() - t:.0f} s; "
                     f"ms: median of {args.repeat} calls after the first")
        print(lines[-1], flush=True)
        before, disk_before = calls(root, commits, head, tag, args.repeat), disk(root)
        subprocess.run(["git", "config", "gc.autoDetach", "false"], cwd=root, check=True)
        t = time.perf_counter()
        done = LabRepo(root).maintain(timeout_s=3600)
        upkeep_s = time.perf_counter() - t
        after, disk_after = calls(root, commits, head, tag, args.repeat), disk(root)
        w = max(len(k) for k in before)
        lines.append(f"{'call':<{w}} | {'loose (as the loop left it)':>27} | {'after LabRepo.maintain':>23}")
        lines.append(f"{'':<{w}} | {'old ms':>12} {'new ms':>14} | {'old ms':>10} {'new ms':>12}")
        lines.append("-" * len(lines[-1]))
        for k in before:
            (a, b), (c, d) = before[k], after[k]
            lines.append(f"{k:<{w}} | {a:>12.1f} {b:>14.1f} | {c:>10.1f} {d:>12.1f}")
        lines.append("-" * len(lines[-2]))
        for k in disk_before:
            lines.append(f"{k:<{w}} | {disk_before[k]:>27} | {disk_after[k]:>23}")
        lines.append(f"LabRepo.maintain: {upkeep_s:.1f} s ({'; '.join(done)})")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    text = "\n".join(lines)
    print("\n".join(lines[2:]))
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
