"""The driver's peak RSS when a stage writes a huge predictions.csv or a huge log (issue 20).

    .venv/bin/python benchmarks/driver_rss.py [--gib 4] [--limit-mb 300] [--kill-mb 2048]
                                             [--cases control,predictions,stdout,stderr,predictions-64m]

Each case is a fresh lab from `autoresearch init LAB --harness command` (one task, `default`), in a
temporary folder, whose baseline's `train.py` (editable, committed) is made hostile:

- `control`: the template's train.py as it is;
- `predictions`: the valid header and a row per test id, then junk rows (`999999999,0.5`) up to
  `--gib` GiB of `{out}/predictions.csv`; exit 0;
- `predictions-64m`: the same with 64 MiB (small enough to let the driver finish: what the run is
  recorded as, and how the driver's RSS grows with the file);
- `stdout`: valid predictions, then `--gib` GiB of `y\\n` on stdout (the stage's log); exit 0;
- `stderr`: `--gib` GiB on stderr, then exit 1 (the failure path).

The lab's `research.toml` gets `[run] out_max_mb` = 4.5 GiB (which also sets the stage's
RLIMIT_FSIZE, so its log, to that size), `memory_mb = 2048`, `timeout_s = 900`, and its trusted
`score.py` is replaced by a streaming one that stops at the first row past the test ids (so no
process but the driver holds the file; the template's `list(csv.reader(fh))` would be the scorer's
problem, not the driver's). Then, through the real CLI,

    /usr/bin/time -v .venv/bin/autoresearch --repo LAB variance --runs 2 --workers 1 --json

(2 is `variance`'s least; one worker, so one hostile stage at a time). Two peaks are reported:

- `driver MB`: the driver process's own peak RSS (VmHWM of its /proc/PID/status, polled every
  20 ms until it exits): what the target is about;
- `time -v MB`: `/usr/bin/time -v`'s "Maximum resident set size", which on Linux is the largest
  of the driver *and every descendant it reaped* (the warm worker, stage and scorer processes);
  the largest descendant seen is given too.

A watchdog guards the machine: a driver over `--kill-mb` gets SIGABRT (with PYTHONFAULTHANDLER=1
it prints where it was), then SIGKILL, and the case reads "killed". Exit 1 if any case's driver
peak exceeds `--limit-mb`, or the driver was killed. Every lab is deleted when its case is done.
Needs about `--gib` × 2 GiB of free RAM (the stage's {out} tmpfs and the page cache) and
`--gib` × 3 GiB of disk under the temporary folder.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO)]
CLI = [str(REPO / ".venv" / "bin" / "autoresearch")] if (REPO / ".venv" / "bin" / "autoresearch").exists() \
    else [sys.executable, "-m", "agent.cli"]
BASELINE = "autoresearch/baseline"
MiB = 1 << 20

SCORE = '''\
"""Scorer (trusted): log-loss of --predictions, read as a stream that stops past the test ids."""
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
p.add_argument("--split", choices=["gate", "holdout"], default="gate")
a = p.parse_args()

sealed = np.load(a.sealed / "test_labels.npz")
ids = {int(i) for i in sealed["id"]}
got = {}
with a.predictions.open(newline="") as fh:
    rows = csv.reader(fh)
    if next(rows, None) != ["id", "score"]:
        sys.exit("predictions: expected the header id,score")
    for n, row in enumerate(rows, start=2):
        if len(got) == len(ids):
            sys.exit(f"predictions:{n}: more rows than the {len(ids)} test ids")
        i, s = int(row[0]), float(row[1])
        if i not in ids or i in got:
            sys.exit(f"predictions:{n}: id {i} is not a test id, or twice")
        got[i] = s
if len(got) != len(ids):
    sys.exit(f"predictions: {len(ids) - len(got)} test ids missing")
holdout = np.load(a.sealed / "splits.npz")["holdout"]
keep = holdout if a.split == "holdout" else ~holdout
prob = np.clip(np.array([got[int(i)] for i in sealed["id"][keep]]), 1e-6, 1 - 1e-6)
y = sealed[a.task][keep]
print(json.dumps({"value": float(-np.mean(y * np.log(prob) + (1 - y) * np.log(1 - prob)))}))
'''

# appended to the template's train.py, after it has written a valid predictions.csv
HOSTILE = {
    "control": "",
    "predictions": '''
row = b"999999999,0.5\\n"
chunk = row * ((8 << 20) // len(row))
with (a.out / "predictions.csv").open("ab") as fh:
    left = {size} - fh.tell()
    while left > 0:
        left -= fh.write(chunk[:left])
''',
    "stdout": '''
import sys
chunk = b"y\\n" * (4 << 20)
left = {size}
while left > 0:
    left -= sys.stdout.buffer.write(chunk[:left])
sys.stdout.flush()
''',
    "stderr": '''
import sys
chunk = b"e\\n" * (4 << 20)
left = {size}
while left > 0:
    left -= sys.stderr.buffer.write(chunk[:left])
sys.stderr.flush()
sys.exit(1)
''',
}
WHAT = {
    "control": "template train.py",
    "predictions": "{gib} predictions.csv",
    "stdout": "{gib} to stdout, exit 0",
    "stderr": "{gib} to stderr, exit 1",
}


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout.strip()


def cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OPENAI_", "AUTORESEARCH_")) and k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    env["PYTHONFAULTHANDLER"] = "1"
    return env


def make_lab(root: Path, case: str, size: int) -> None:
    subprocess.run([*CLI, "init", str(root), "--harness", "command"], check=True, capture_output=True,
                   env=cli_env(), text=True)
    toml = (root / "research.toml").read_text()
    toml = re.sub(r'(?m)^tasks = .*$', 'tasks = ["default"]', toml)
    toml = re.sub(r'(?m)^timeout_s = .*$', 'timeout_s = 900\nout_max_mb = 4608\nmemory_mb = 2048', toml)
    (root / "research.toml").write_text(toml)
    (root / "score.py").write_text(SCORE)
    kind = case.split("-")[0]
    (root / "train.py").write_text((root / "train.py").read_text() + HOSTILE[kind].format(size=size))
    git(root, "config", "user.name", "driver rss benchmark")
    git(root, "config", "user.email", "driver-rss@localhost")
    git(root, "commit", "-qam", f"driver_rss: {case}")
    git(root, "branch", "-f", BASELINE, "HEAD")


def proc_table() -> dict[int, int]:
    """pid → ppid of every process."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
                out[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return out


def status_kb(pid: int, field: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def descendants(root: int) -> list[int]:
    table = proc_table()
    kids: dict[int, list[int]] = {}
    for pid, ppid in table.items():
        kids.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def measure(lab: Path, work: Path, kill_mb: int) -> dict:
    """Run the variance study under /usr/bin/time -v, polling the driver's own VmHWM."""
    timefile, out, err = work / "time.txt", work / "cli.out", work / "cli.err"
    argv = ["/usr/bin/time", "-v", "-o", str(timefile), *CLI, "--repo", str(lab), "variance", "--runs", "2",
            "--workers", "1", "--json"]
    t0 = time.monotonic()
    with out.open("w") as fo, err.open("w") as fe:
        timer = subprocess.Popen(argv, stdout=fo, stderr=fe, env=cli_env(), cwd=REPO)
    driver = None
    hwm = rss_peak = 0
    kids: dict[int, tuple[int, str]] = {}  # pid → (peak VmHWM kB, cmdline)
    seen: set[int] = set()
    killed = None
    last_scan = 0.0
    while timer.poll() is None:
        if driver is None:
            found = [p for p, pp in proc_table().items() if pp == timer.pid]
            driver = found[0] if found else None
        if driver is not None:
            h, r = status_kb(driver, "VmHWM"), status_kb(driver, "VmRSS")
            if h is not None:
                hwm = max(hwm, h)
            if r is not None:
                rss_peak = max(rss_peak, r)
                if r > kill_mb * 1024 and killed is None:
                    killed = time.monotonic()
                    os.kill(driver, signal.SIGABRT)  # faulthandler prints the driver's stack
            if killed is not None and time.monotonic() - killed > 3:
                try:
                    os.kill(driver, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() - last_scan > 0.2:
                last_scan = time.monotonic()
                for k in descendants(driver):
                    seen.add(k)
                    kh = status_kb(k, "VmHWM")
                    if kh is not None:
                        kids[k] = (max(kh, kids.get(k, (0, ""))[0]), kids.get(k, (0, ""))[1] or cmdline(k)[:90])
        time.sleep(0.02)
    wall = time.monotonic() - t0
    for k in seen:  # a killed driver's warm worker, stage or scorer: ours to end
        try:
            if cmdline(k):
                os.kill(k, signal.SIGKILL)
        except ProcessLookupError:
            pass
    text = timefile.read_text() if timefile.is_file() else ""
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    top = max(kids.values(), default=(0, ""))
    return {"driver_kb": hwm, "driver_rss_kb": rss_peak, "time_kb": int(m.group(1)) if m else None, "wall_s": wall,
            "killed": killed is not None, "rc": timer.returncode, "top_child_kb": top[0], "top_child": top[1],
            "stderr": err.read_text(errors="replace")[-65536:], "stdout": out.read_text(errors="replace")[-2000:]}


def outcomes(lab: Path) -> tuple[str, list[str]]:
    """What the baseline's runs were recorded as (the store, read after the driver is gone)."""
    from pipeline import experiment
    from pipeline.lab import load_lab

    store = experiment.open_store(load_lab(lab))
    commit = git(lab, "rev-parse", BASELINE)
    rows = store.results_for(commit)
    counts: dict[str, int] = {}
    details = []
    for r in rows:
        key = r.outcome if r.outcome == "ok" else f"{r.outcome}/{r.kind}"
        counts[key] = counts.get(key, 0) + 1
        if r.detail:
            details.append(f"{key}: {r.detail[:300]}")
    queue = json.loads(subprocess.run([*CLI, "--repo", str(lab), "status", "--json"], capture_output=True,
                                      text=True, env=cli_env()).stdout or "{}").get("queue", {})
    recorded = ", ".join(f"{n}x {k}" for k, n in sorted(counts.items())) or "nothing recorded"
    left = {k: v for k, v in queue.items() if k in ("queued", "running") and v}
    if left:
        recorded += " (" + ", ".join(f"{v} {k}" for k, v in left.items()) + ")"
    return recorded, details


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=4.0, help="size of the huge file / log, GiB")
    p.add_argument("--limit-mb", type=int, default=300, help="the target for the driver's peak RSS")
    p.add_argument("--kill-mb", type=int, default=2048, help="the watchdog: kill a driver past this RSS")
    p.add_argument("--cases", default="control,predictions,stdout,stderr,predictions-64m")
    p.add_argument("--tmp", default=None, help="where the labs go (default: the system's temporary folder)")
    a = p.parse_args()
    size = int(a.gib * (1 << 30))
    gib = f"{a.gib:g} GiB"
    rows, notes, fail = [], [], False
    for case in a.cases.split(","):
        csize = 64 * MiB if case == "predictions-64m" else size
        what = WHAT[case.split("-")[0]].format(gib=gib if csize == size else "64 MiB")
        work = Path(tempfile.mkdtemp(prefix=f"driver-rss-{case}-", dir=a.tmp))
        try:
            lab = work / "lab"
            make_lab(lab, case, csize)
            r = measure(lab, work, a.kill_mb)
            recorded, details = outcomes(lab)
            if r["killed"]:
                recorded = f"driver killed at {r['driver_rss_kb'] // 1024} MB RSS; " + recorded
                lines = r["stderr"].splitlines()
                at = next((i for i, ln in enumerate(lines) if ln.startswith("Current thread")), None)
                stack = [ln.strip() for ln in lines[at + 1:at + 6]] if at is not None else ["(no stack printed)"]
                notes.append(f"{case}: the driver's main thread at SIGABRT (faulthandler, innermost first):\n    "
                             + "\n    ".join(stack))
            elif r["rc"] != 0:
                notes.append(f"{case}: the CLI exited {r['rc']}: {r['stderr'][-600:]}")
            for d in details[:2]:
                notes.append(f"{case}: {d}")
            notes.append(f"{case}: largest descendant of the driver: {r['top_child_kb'] / 1024:.0f} MB "
                         f"VmHWM, `{r['top_child']}`")
            over = r["killed"] or r["driver_kb"] / 1024 > a.limit_mb
            fail |= over
            rows.append((case, what, r["driver_kb"] / 1024, (r["time_kb"] or 0) / 1024, r["wall_s"], recorded,
                         "OVER" if over else "ok"))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(f"# {case} done", file=sys.stderr, flush=True)
    head = ("case", "the stage", "driver MB", "time -v MB", "wall s", "runs recorded", f"≤ {a.limit_mb} MB")
    table = [head] + [(c, w, f"{d:.0f}", f"{t:.0f}", f"{s:.1f}", rec, v) for c, w, d, t, s, rec, v in rows]
    widths = [max(len(str(row[i])) for row in table) for i in range(len(head))]
    for row in table:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip())
    print()
    print("driver MB: the driver's own peak RSS (VmHWM); time -v MB: /usr/bin/time -v's maximum RSS, the largest")
    print("of the driver and every process it reaped (warm worker, stages, scorer).")
    for n in notes:
        print("- " + n)
    print(f"\nverdict: {'FAIL' if fail else 'PASS'} (driver's own peak ≤ {a.limit_mb} MB in every case)")
    return 1 if fail else 0


if __name__ == "__main__":
    raise SystemExit(main())
