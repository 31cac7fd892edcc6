"""benchmarks/gpu/report.py on CPU: a fake nvidia-smi log beside a real store written by the store's own code."""

import os
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from pipeline.store import Store
from pipeline.store.tables import Run, StageExec, StageOutcome

pytestmark = pytest.mark.integration

REPORT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu" / "report.py"
T0 = 1_700_000_000.0
COMMIT = "c" * 40


def smi_line(t: float, util: int) -> str:
    return f"{datetime.fromtimestamp(t).strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]}, 0, {util} %, 1024 MiB"


def make_lab(root: Path, computes: tuple[float, float]) -> Path:
    """Three runs finished in [T0, T0 + 10]: two trained (walls 4 and 5 s, `computes` by their own
    account), one failed without a `device` line; a fourth queued, its stage a cache hit later."""
    store = Store(f"sqlite:///{root / 'runs' / 'autoresearch.db'}")
    store.ensure_arm(COMMIT)
    ids = store.enqueue(COMMIT, [("count", 1), ("order", 1), ("motif", 1), ("count", 2)])
    (root / "runs" / "logs").mkdir()
    stages = [(T0, T0 + 4, 4.0, StageOutcome.OK, f"device NVIDIA H200 visible 1 train {computes[0]:.2f}s"),
              (T0 + 4, T0 + 10, 5.0, StageOutcome.OK, f"device NVIDIA H200 visible 1 train {computes[1]:.2f}s"),
              (T0 + 5, T0 + 6, 1.0, StageOutcome.METHOD, "Traceback (most recent call last): ..."),
              (T0 + 20, T0 + 20.1, 0.0, StageOutcome.CACHE_HIT, "")]
    for run_id, (start, end, wall, outcome, line) in zip(ids, stages):
        log = root / "runs" / "logs" / f"train-{run_id}.log"
        log.write_text(f"epoch 0 loss 0.69\n{line}\n")
        eid = store.stage_started(run_id, "train", f"key{run_id}", executor="local", log_path=str(log))
        # the first stage on the CPU alone, the others on the GPU (gpus = 1: GPU-seconds = wall)
        store.stage_finished(eid, outcome, wall_s=wall, finished_at=end, gpu_s=0.0 if start == T0 else wall)
        with store.session() as s:
            s.get(StageExec, eid).started_at = start
            if outcome != StageOutcome.CACHE_HIT:
                s.get(Run, run_id).status = "done"
            s.commit()
    # a smoke run at T0 + 1 for 1 s at half a GPU, one before the loop's wall time, and one on the CPU
    for started, wall, gpu_s in ((T0 + 1, 1.0, 0.5), (T0 - 5, 2.0, 2.0), (T0 + 2, 5.0, 0.0)):
        store.smoke_finished("b" * 40, "ok", hypothesis="1", executor="here", stages=1, cpu_s=wall, gpu_s=gpu_s,
                             wall_s=wall, started_at=started - 3,  # its stages held the GPU in [started, + wall]
                             gpu_from=started if gpu_s else None, gpu_to=started + wall if gpu_s else None)
    store.dispose()
    # samples every 0.5 s from T0 - 2 to T0 + 12: busy (99 %) outside the loop's wall time, which
    # holds 21 of them: 5 idle, then 16 at 50 %
    smi = [smi_line(T0 + k / 2, 99 if not 0 <= k <= 20 else (0 if k < 5 else 50)) for k in range(-4, 25)]
    (root / "smi.csv").write_text("\n".join(smi) + "\n")
    return root


def report(*args: str) -> str:
    proc = subprocess.run([sys.executable, str(REPORT), *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_report_prints_busy_share_runs_per_gpu_hour_and_each_stages_overhead(tmp_path):
    lab = make_lab(tmp_path / "sandbox", computes=(3.5, 4.2))
    out = report("--mode", "sandbox", str(lab), str(lab / "smi.csv"))
    assert "loop wall 10.0 s (first stage start to last stage end), 1 GPU(s)" in out
    assert "runs finished 3: 1080.0 runs per GPU-hour" in out  # 3 runs / (10 s / 3600)
    assert "GPU busy 76.2 % of 21 samples, mean utilisation 38.1 %" in out  # 16 / 21; 16 * 50 / 21
    # held: [T0 + 1, T0 + 2] (the smoke run), [T0 + 5, T0 + 10] (the stages, each for its wall up to its
    # end: the second was submitted at T0 + 4 but ran 5 s): 6 s of 10; GPU-seconds 5 + 1 + 0.5
    assert ("GPU held 60.0 % of the wall time, 0.65 of its GPU(s) on average; nothing held one for 4.0 s in "
            "2 gap(s) of 0.05 s or more, the longest 3.0 s from +2.0 s") in out
    # overheads 4 - 3.5 and 5 - 4.2: median 0.65 s, 1.3 s of 9 s of wall
    assert "2 of 3 executed stages: median 0.65 s, 14.4 % of their wall" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("  train")]
    assert [r[2:] for r in rows] == [["ok", "4.00", "3.50", "0.50"], ["ok", "5.00", "4.20", "0.80"],
                                     ["method", "1.00", "n/a", "n/a"]]


def test_report_sets_sandboxed_beside_unsandboxed(tmp_path):
    sandboxed = make_lab(tmp_path / "sandbox", computes=(3.5, 4.2))
    off = make_lab(tmp_path / "off", computes=(3.9, 4.9))
    out = report("--mode", "sandbox", str(sandboxed), str(sandboxed / "smi.csv"),
                 "--mode", "off", str(off), str(off / "smi.csv"), "--side-by-side")
    assert "== sandbox" not in out  # the table alone
    table = {line.split()[0]: line.split()[1:] for line in out.splitlines()[1:3]}
    assert table["sandbox"] == ["3", "10.0", "1080.0", "60.0", "76.2", "38.1", "2", "4.50", "3.85", "0.65"]
    assert table["off"] == ["3", "10.0", "1080.0", "60.0", "76.2", "38.1", "2", "4.50", "4.40", "0.10"]
    # 0.65 - 0.10 s of off's median stage wall, 4.5 s
    assert "sandbox vs off: median stage overhead +0.55 s, +12.2 % of off's median stage wall" in out


@pytest.mark.slow  # the loop for 60 s, then the report: not for make test-fast
def test_run_sh_rehearses_on_cpu_end_to_end(tmp_path):
    """The device tool lends a GPU for about 15 minutes a session, one prepared command: `run.sh`
    must not fail there for a reason a CPU could have shown. `REHEARSE=1` runs it here (a fake GPU 0,
    a fake nvidia-smi, the lab trained on CPU): the loop runs on the lab, smoke runs and stages are
    booked, and report.py prints every figure from the store."""
    run = REPORT.parent / "run.sh"
    env = {**os.environ, "REHEARSE": "1", "OUT": str(tmp_path / "out"), "LABS": str(tmp_path / "labs"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run(["bash", str(run), "60", "packed-off"], cwd=REPORT.parents[2], env=env,
                          capture_output=True, text=True, timeout=400)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-2000:]
    assert "CPU rehearsal (no GPU)" in out and 'gpus = 0.25 sandbox = "off"' in out
    assert "loop started: policy offline, executor local" in (tmp_path / "out" / "run-packed-off.txt").read_text()
    finished = re.search(r"runs finished (\d+): ", out)
    assert finished and int(finished.group(1)) >= 1, out[-3000:]
    held = re.search(r"GPU held (\d+\.\d) % of the wall time", out)
    assert held and float(held.group(1)) > 0, out[-3000:]
    assert "GPU busy n/a of 0 samples" in out  # the fake nvidia-smi's utilisation is [N/A]
    assert re.search(r"smoke runs: [1-9]\d* \(", out)  # `status`: the smoke run booked
    assert re.search(r"^packed-off\s+\d+\s", out, re.M)  # the side-by-side table
    bad = subprocess.run(["bash", str(run), "10", "sandbox"], cwd=REPORT.parents[2], env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "REHEARSE: mode sandbox needs /dev/nvidia*" in bad.stdout
