"""GPUs shared by share and given to every stage that needs one (issue 33, "GPUs for real").

This machine has no GPU: the stages here are real processes of the real local executor, with a
GPU id that names no device (unsandboxed: nothing binds a node), fake /dev and /proc/driver/nvidia
entries where the sandbox's binding is checked (as tests/test_gpu_binding.py does), and a fake NVML
(a `pynvml` module on the path that reports a utilisation read from a file) for the accounting.
"""

from __future__ import annotations

import json
import resource
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from pipeline.executors import StageJob
from pipeline.executors.gpus import GpuPool, capacity
from pipeline.executors.local import LocalExecutor
from pipeline.executors.sandbox import device_nodes, stage_uid, uid_base
from pipeline.lab import LabConfigError, parse_config
from pipeline.smoke import SmokeRunner
from support.tiny import CONFIG_NAME, make_lab, open_tiny_lab
from test_gpu_binding import fake_dev, fake_proc

pytestmark = pytest.mark.integration

STAGE = """
import json, os, resource, sys, time
out, name, hold = sys.argv[1], sys.argv[2], float(sys.argv[3])
start = time.monotonic()
mode = sys.argv[4] if len(sys.argv) > 4 else ""
tries = os.path.join(out, name + ".tries")
n = int(open(tries).read()) + 1 if os.path.exists(tries) else 1
open(tries, "w").write(str(n))
time.sleep(hold)
if mode == "oom-first" and n == 1:
    sys.exit("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB")
if mode == "oom":
    sys.exit("RuntimeError: CUDA error: out of memory")
json.dump({"start": start, "end": time.monotonic(), "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
           "rlimit_as": resource.getrlimit(resource.RLIMIT_AS)[0]}, open(os.path.join(out, name + ".json"), "w"))
"""

FAKE_NVML = """
import os
UTIL = os.path.join(os.path.dirname(__file__), "util")
class _U:
    def __init__(self, gpu): self.gpu = gpu
def nvmlInit(): pass
def nvmlDeviceGetHandleByIndex(i): return i
def nvmlDeviceGetHandleByUUID(u): raise RuntimeError("no such GPU")
def nvmlDeviceGetUtilizationRates(h):  # "60", or one value per GPU index: "50,0"
    values = open(UTIL).read().split(",")
    return _U(int(values[min(h, len(values) - 1)]))
"""


def stage(work: Path, name: str, hold: float, mode: str = "", gpus: float = 0.25) -> StageJob:
    return StageJob(job_id=f"{name}-{uuid.uuid4().hex[:6]}", argv=["python", "stage.py", str(work), name, str(hold), mode],
                    cwd=work, commit="0" * 40, out=work, log_path=work / "logs" / f"{name}.log", timeout_s=60,
                    gpus=gpus)


def run_all(ex: Any, jobs: list[StageJob], limit: float = 60) -> dict[str, object]:
    """Submit `jobs` to the executor `ex` (local or Ray) and poll until each has a result, by name."""
    for j in jobs:
        ex.submit(j)
    got: dict[str, object] = {}
    deadline = time.monotonic() + limit
    while len(got) < len(jobs) and time.monotonic() < deadline:
        got.update({r.job_id.split("-")[0]: r for r in ex.poll(0.5)})
    assert len(got) == len(jobs), got
    return got


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "stage.py").write_text(STAGE)
    nvml = tmp_path / "nvml"
    nvml.mkdir()
    (nvml / "pynvml.py").write_text(FAKE_NVML)
    (nvml / "util").write_text("60")
    monkeypatch.syspath_prepend(str(nvml))
    sys.modules.pop("pynvml", None)
    return tmp_path


def test_four_quarter_gpu_stages_share_one_gpu_and_a_fifth_waits(work: Path) -> None:
    pool = GpuPool(["0"])
    assert capacity(0.25, 1) == 4 and capacity(1, 3) == 3 and capacity(2, 5) == 2
    with LocalExecutor(gpus=0.25, slots=5, preload=(), pool=pool) as ex:
        results = run_all(ex, [stage(work, f"s{i}", 2.0) for i in range(5)])
    spans = {n: json.loads((work / f"{n}.json").read_text()) for n in results}
    assert all(r.status == "ok" for r in results.values()), results  # type: ignore[attr-defined]
    assert {s["cuda"] for s in spans.values()} == {"0"}  # every stage was given GPU 0
    first4 = [spans[f"s{i}"] for i in range(4)]
    assert max(s["start"] for s in first4) < min(s["end"] for s in first4)  # the four ran at once
    assert spans["s4"]["start"] >= min(s["end"] for s in first4)  # the fifth waited for a share
    # the fake NVML's 60 % was charged to each stage that held the GPU while it was sampled
    utils = [r.extra.get("gpu_util") for r in results.values()]  # type: ignore[attr-defined]
    assert utils.count(60.0) >= 4, utils
    assert pool.sampler().summary()["busy_share"] == 1.0
    assert pool.used() == {"0": 0.0}  # every share given back


def test_busy_is_counted_per_gpu_and_each_executor_books_only_its_own_samples(work: Path) -> None:
    """One of two GPUs busy is 50 % busy, as a Ray node counts it (it was 100 %: an instant counted
    busy if any GPU was). The pool's sampler serves the whole process: a second executor on it (a
    second driver in one process) reports the samples from its own first GPU stage on, not the first's."""
    from pipeline.executors.gpus import GpuSampler

    (work / "nvml" / "util").write_text("50,0")
    pool = GpuPool(["0", "1"])
    sampler = GpuSampler(pool)
    sampler.sample()
    sampler.sample()
    assert sampler.summary() == {"samples": 4, "busy": 2, "util_sum": 100.0, "busy_share": 0.5, "mean_util": 25.0}
    (work / "nvml" / "util").write_text("60")
    first = LocalExecutor(gpus=0.5, slots=1, preload=(), pool=pool)
    with first:
        run_all(first, [stage(work, "a", 1.5, gpus=0.5)])
        mine = first.gpu_usage()
    assert mine is not None and mine["samples"] >= 4 and mine["busy_share"] == 1.0
    second = LocalExecutor(gpus=0.5, slots=1, preload=(), pool=pool)
    with second:
        assert second.gpu_usage()["samples"] == 0  # type: ignore[index]  (no stage of its own yet)
        before = pool.sampler().summary()["samples"]
        run_all(second, [stage(work, "b", 1.0, gpus=0.5)])
        theirs = second.gpu_usage()
    assert theirs is not None and 0 < theirs["samples"] <= pool.sampler().summary()["samples"] - before  # type: ignore[operator]
    pool.sampler().close()


def test_a_cuda_oom_on_a_shared_gpu_runs_again_with_the_gpu_alone(work: Path) -> None:
    pool = GpuPool(["0"])
    with LocalExecutor(gpus=0.5, slots=2, preload=(), pool=pool) as ex:
        results = run_all(ex, [stage(work, "greedy", 0.5, "oom-first", gpus=0.5),
                               stage(work, "neighbour", 2.0, gpus=0.5)])
    greedy, neighbour = results["greedy"], results["neighbour"]
    assert greedy.status == "ok" and neighbour.status == "ok", (work / "logs" / "greedy.log").read_text()  # type: ignore[attr-defined]
    assert (work / "greedy.tries").read_text() == "2"
    lost = greedy.extra["gpu_oom_retried_alone"]  # type: ignore[attr-defined]
    assert lost["wall_s"] > 0.4 and lost["gpu_s"] == pytest.approx(lost["wall_s"] * 0.5)
    spans = {n: json.loads((work / f"{n}.json").read_text()) for n in results}
    assert spans["greedy"]["start"] >= spans["neighbour"]["end"]  # the rerun had the GPU alone
    assert "running this stage again with the GPU alone" in (work / "logs" / "greedy.log").read_text()


def test_a_stage_lost_with_its_warm_worker_is_booked_for_the_gpu_it_held(work: Path) -> None:
    """A stage whose warm worker died (killed here) comes back as the infrastructure's, with the
    time it held its GPU share as its wall time: the GPU-hours lost to infrastructure (it was 0 s)."""
    import os
    import signal

    with LocalExecutor(gpus=0.5, slots=1, preload=(), pool=GpuPool(["0"])) as ex:
        ex.submit(stage(work, "victim", 30.0, gpus=0.5))
        time.sleep(1.5)
        assert ex._proc is not None
        os.kill(ex._proc.pid, signal.SIGKILL)
        results = []
        deadline = time.monotonic() + 20
        while not results and time.monotonic() < deadline:
            results = ex.poll(0.5)
    (res,) = results
    assert res.status == "infra" and "warm worker died" in (res.detail or "")
    assert res.wall_s >= 1.4 and res.extra["gpu_share"] == 0.5


def test_a_cuda_oom_on_a_gpu_not_shared_is_the_methods_failure(work: Path) -> None:
    with LocalExecutor(gpus=0.5, slots=2, preload=(), pool=GpuPool(["0"])) as ex:
        results = run_all(ex, [stage(work, "alone", 0.1, "oom", gpus=0.5)])
    assert results["alone"].status == "exit"  # type: ignore[attr-defined]
    assert (work / "alone.tries").read_text() == "1" and "gpu_oom_retried_alone" not in results["alone"].extra  # type: ignore[attr-defined]


def gpu_lab(root: Path, run_extra: str, gpus: str = "1", **kw: float) -> object:
    make_lab(root, **kw)
    cfg = root / CONFIG_NAME
    cfg.write_text(cfg.read_text().replace("cpus = 1\n", f"cpus = 1\ngpus = {gpus}\n{run_extra}"))
    return open_tiny_lab(root)


def test_a_gpu_labs_smoke_stage_gets_its_gpu_node_and_no_rlimit(tmp_path: Path, monkeypatch) -> None:
    """Smoke runs got no GPU, so every hypothesis of a lab that calls .cuda() was rejected at smoke."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    lab = gpu_lab(tmp_path / "lab", "")
    runner = SmokeRunner(lab)
    try:
        assert runner.gpus == 1
        out = tmp_path / "out"
        out.mkdir()
        job = runner.job(["python", "train.py"], tmp_path, out, tmp_path / "smoke.log", 30)
        ex = runner.executor()
        assert ex.pool is GpuPool.shared(["0"])  # the pool the driver's local executor takes from
        assert ex.pool.take(job.job_id, job.gpus) == ["0"]
        spec = ex.stage_spec(job)
        ex.pool.give_back(job.job_id)
    finally:
        runner.close()
    assert spec["memory_mb"] is None and spec["sandbox"]["gpus"] == 1 and spec["sandbox"]["gpu_ids"] == ["0"]
    assert spec["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # index 0 is nvidia-smi's GPU 0, not CUDA's fastest
    dev, proc = fake_dev(tmp_path), fake_proc(tmp_path, [0, 1, 2, 3])
    bound = device_nodes(spec["sandbox"], str(dev), str(proc))
    assert "nvidia0" in bound and "nvidiactl" in bound and "nvidia1" not in bound


def test_the_smoke_stage_waits_for_the_gpu_a_driver_stage_holds(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    lab = gpu_lab(tmp_path / "lab", 'sandbox = "off"\npreload = []\n')  # a warm worker that imports nothing
    (tmp_path / "stage.py").write_text(STAGE)
    pool = GpuPool.shared(["7"])
    assert pool.take("a-driver-stage", 1) == ["7"]
    runner = SmokeRunner(lab)
    done: dict[str, object] = {}

    def smoke() -> None:
        done["result"] = runner.run_stage(["python", "stage.py", str(tmp_path), "smoke", "0"], tmp_path, tmp_path,
                                          tmp_path / "smoke.log", 30, None)

    t = threading.Thread(target=smoke)
    try:
        t.start()
        time.sleep(1.5)
        assert not (tmp_path / "smoke.json").exists()  # no oversubscription: it waits for GPU 7
        released = time.monotonic()
        pool.give_back("a-driver-stage")
        t.join(30)
    finally:
        pool.give_back("a-driver-stage")
        runner.close()
    assert done["result"][0] == 0, (tmp_path / "smoke.log").read_text()  # type: ignore[index]
    seen = json.loads((tmp_path / "smoke.json").read_text())
    assert seen["cuda"] == "7" and seen["start"] >= released
    assert seen["rlimit_as"] == resource.RLIM_INFINITY  # a GPU stage: CUDA maps huge address space
    assert pool.used() == {"7": 0.0}


@pytest.mark.parametrize("gpus, ok", [("0.25", True), ("0.5", True), ("1", True), ("4", True), ("1.5", False),
                                      ("9", False), ("-1", False), ("0.001", False)])
def test_gpus_is_a_share_or_whole_gpus(gpus: str, ok: bool, tmp_path: Path) -> None:
    make_lab(tmp_path)
    text = (tmp_path / CONFIG_NAME).read_text().replace("cpus = 1\n", f"cpus = 1\ngpus = {gpus}\n")
    if ok:
        run = parse_config(text, tmp_path / CONFIG_NAME).run
        assert run.gpus == float(gpus)
        # NCCL's and DataLoader workers' shared memory, per GPU held: a share of one, its part (1 GB at least)
        assert run.shm_size_mb() == max(1024, int(2048 * float(gpus)))
    else:
        with pytest.raises(LabConfigError, match="gpus"):
            parse_config(text, tmp_path / CONFIG_NAME)


@pytest.mark.parametrize("name", ["CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"])
def test_a_labs_env_may_not_name_which_gpus_a_stage_sees(name: str, tmp_path: Path) -> None:
    """`[run] env` passes the driver's value of a variable to every stage; the GPUs a stage sees are
    the executor's to name (the sandbox binds their device nodes from that name, on Ray too)."""
    make_lab(tmp_path)
    text = (tmp_path / CONFIG_NAME).read_text().replace('env = ["SLOW_S", ', f'env = ["{name}", "SLOW_S", ')
    with pytest.raises(LabConfigError, match=f"a name other than {name}: the executor sets it"):
        parse_config(text, tmp_path / CONFIG_NAME)


def test_a_cpu_stage_and_the_warm_worker_see_no_gpu_whatever_the_driver_sees(work: Path, monkeypatch) -> None:
    """A CPU lab on a GPU machine: with CUDA_VISIBLE_DEVICES unset in the driver, CUDA would show a
    stage every GPU. It sees none; nor does the warm worker while it imports its preloads (a
    library starting CUDA there would hand every forked stage open handles to every GPU)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    (work / "probe.py").write_text("import sys\nsys.modules.setdefault('probe', None)\n")
    with LocalExecutor(slots=1, preload=()) as ex:
        spec = ex.stage_spec(stage(work, "cpu", 0, gpus=0))
        assert spec["env"]["CUDA_VISIBLE_DEVICES"] == ""  # type: ignore[index]
        results = run_all(ex, [stage(work, "cpu", 0.1, gpus=0)])
        assert results["cpu"].status == "ok"  # type: ignore[attr-defined]
        assert ex._proc is not None
        worker_env = Path(f"/proc/{ex._proc.pid}/environ").read_bytes().split(b"\0")
    assert json.loads((work / "cpu.json").read_text())["cuda"] == ""
    assert b"CUDA_VISIBLE_DEVICES=" in worker_env


def test_stage_uids_do_not_repeat_and_lie_above_the_subordinate_ids(tmp_path: Path) -> None:
    """200000 + pid % 100000 gave pids 100000 apart one uid (pid_max is 4194304 on large hosts)."""
    sub = tmp_path / "subuid"
    sub.write_text("alice:100000:65536\nbuilder:1073741824:1000000\n")
    base = uid_base((str(sub),))
    assert base == 1073741824 + 1000000
    assert stage_uid(123, (str(sub),)) != stage_uid(100123, (str(sub),))
    assert stage_uid(4194303, ()) < 2**32 - 1 and uid_base(()) >= 1 << 30


SYSFS_PROBE = textwrap.dedent("""
    import json, os, sys
    seen = {"sys": os.path.isdir("/sys"), "fs": os.path.exists("/sys/fs/cgroup"), "write": None, "real": [],
            "net": os.path.exists("/sys/class/net"), "ro": None}
    if os.path.isdir("/sys/bus/pci"):
        seen["ro"] = bool(os.statvfs("/sys/bus/pci").f_flag & os.ST_RDONLY)
    if os.path.isdir("/sys/class/pci_bus"):
        for bus in sorted(os.listdir("/sys/class/pci_bus"))[:2]:  # what NCCL resolves for each GPU
            seen["real"].append(os.path.realpath(f"/sys/class/pci_bus/{bus}/device"))
        try:
            open("/sys/bus/pci/rescan", "w").write("1")
            seen["write"] = "written"
        except OSError as e:
            seen["write"] = e.strerror
    json.dump(seen, open(os.path.join(sys.argv[1], "sys.json"), "w"))
""")


@pytest.mark.parametrize("sysfs", [True, False])
def test_a_multi_gpu_stage_sees_the_device_tree_read_only_and_others_see_none(sysfs: bool, tmp_path: Path) -> None:
    """NCCL finds how a stage's GPUs connect through `realpath(/sys/class/pci_bus/…)` and fails
    without /sys: a stage of 2 GPUs or more (`needs_sysfs`) gets the PCI tree and NUMA nodes of /sys,
    read-only, nothing else (no cgroup tree, no network interfaces); any other stage no /sys at all.
    A real sandbox; the GPU count is stood in for by the spec's `sysfs` (no GPU node here)."""
    from pipeline.executors.sandbox import needs_sysfs

    assert needs_sysfs({"gpus": 2}) and needs_sysfs({"gpus": 8}) and not needs_sysfs({"gpus": 1})
    assert not needs_sysfs({"gpus": 0.5}) and not needs_sysfs({})
    from support.tiny import require_sandbox

    require_sandbox()
    code, out = tmp_path / "code", tmp_path / "out"
    code.mkdir()
    out.mkdir()
    (code / "probe.py").write_text(SYSFS_PROBE)
    job = StageJob(job_id="probe", argv=["python", "probe.py", str(out)], cwd=code, commit="0" * 40, out=out,
                   log_path=tmp_path / "probe.log", timeout_s=60, cpus=1,
                   sandbox={"ro": [str(code)], "rw": [], "out": str(out), "network": False, "sysfs": sysfs})
    with LocalExecutor(cpus=1, slots=1, preload=()) as ex:
        (res,) = run_all(ex, [job]).values()
    assert res.status == "ok", (tmp_path / "probe.log").read_text()[-3000:]  # type: ignore[attr-defined]
    seen = json.loads((out / "sys.json").read_text())
    if not sysfs:
        assert seen == {"sys": False, "fs": False, "write": None, "real": [], "net": False, "ro": None}
        return
    assert seen["sys"] and not seen["fs"] and not seen["net"], seen
    if Path("/sys/class/pci_bus").is_dir():  # a machine with a PCI bus (a VM may have none): as NCCL sees it
        assert seen["real"] and all(r.startswith("/sys/devices/pci") for r in seen["real"]), seen
        assert seen["ro"] is True and seen["write"] in ("Read-only file system", "Permission denied"), seen


TORCHRUN = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    if dist.get_rank() == 0:
        open(os.path.join(sys.argv[1], "sum.txt"), "w").write(f"{t.item():g} {dist.get_world_size()}")
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_torchrun_with_two_gloo_processes_runs_inside_the_sandbox(tmp_path: Path) -> None:
    """A multi-GPU stage is `torchrun --nproc-per-node N train.py`: its rendezvous needs loopback in
    the stage's own network namespace (no network otherwise); gloo stands in for NCCL here."""
    code, out = tmp_path / "code", tmp_path / "out"
    code.mkdir()
    out.mkdir()
    (code / "train.py").write_text(TORCHRUN)
    job = StageJob(job_id="dist", argv=["python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                        "train.py", str(out)], cwd=code, commit="0" * 40, out=out,
                   log_path=tmp_path / "dist.log", timeout_s=120, cpus=1,
                   sandbox={"ro": [str(code)], "rw": [], "out": str(out), "network": False})
    with LocalExecutor(cpus=1, slots=1, preload=("torch",)) as ex:
        (res,) = run_all(ex, [job], limit=150).values()
    assert res.status == "ok", (tmp_path / "dist.log").read_text()[-3000:]  # type: ignore[attr-defined]
    assert (out / "sum.txt").read_text() == "3 2"  # ranks 1 + 2, two processes


def test_status_says_when_cuda_mps_runs_and_that_sandboxed_stages_do_not_reach_it(tmp_path: Path) -> None:
    """`mps_running` finds MPS's control daemon or server among the processes (a fake /proc here);
    the GPU line says so, and for a sandboxed lab that its stages cannot reach it (their /tmp, where
    its pipe directory lies, is their own)."""
    from agent import views
    from pipeline.executors.gpus import mps_running

    proc = tmp_path / "proc"
    for pid, comm in (("1", "systemd"), ("77", "python3")):
        (proc / pid).mkdir(parents=True)
        (proc / pid / "comm").write_text(comm + "\n")
    (proc / "self").mkdir()
    assert not mps_running(str(proc))
    (proc / "4242").mkdir()
    (proc / "4242" / "comm").write_text("nvidia-cuda-mps-control\n")
    assert mps_running(str(proc))
    c = {"useful_gpu_s": 3600.0}
    assert views.gpu_line(c, {"lab_gpus": 0.25, "mps": True, "sandboxed": False}).endswith("; CUDA MPS is running")  # type: ignore[union-attr]
    line = views.gpu_line(c, {"lab_gpus": 0.25, "mps": True, "sandboxed": True})
    assert line is not None and "CUDA MPS is running (sandboxed stages do not reach it" in line
    assert "MPS" not in views.gpu_line(c, {"lab_gpus": 0.25, "mps": False, "sandboxed": True})  # type: ignore[operator]


def test_the_driver_counts_gpu_hours_and_how_busy_the_gpu_was(work: Path, tmp_path: Path, monkeypatch) -> None:
    """Real runs of the tiny lab through the driver on a fake GPU (a share of 0.5 each) with the fake
    NVML at 40 %: GPU-seconds are share × wall, every stage has its sampled utilisation, the sampler's
    busy share reaches the store, and `status` says it beside the CPU figures."""
    from pipeline import experiment, runner
    from support.tiny import TASKS, TinyHarness
    from agent import commands, views

    (work / "nvml" / "util").write_text("40")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    lab = gpu_lab(tmp_path / "lab", 'sandbox = "off"\n', gpus="0.5", pretrain_sleep=1.5)
    store = experiment.open_store(lab)
    ids = experiment.ensure_runs(store, lab, "autoresearch/baseline", TASKS[:2], [0], harness=TinyHarness())
    ex = LocalExecutor(gpus=0.5, slots=2, preload=("numpy",), pool=GpuPool(["5"]))
    from pipeline import gpu_accounting

    monkeypatch.setattr(runner, "GPU_USAGE_EVERY_S", 0.3)  # written often: still one row a minute
    monkeypatch.setattr(gpu_accounting, "GPU_USAGE_ROW_S", 3600.0)  # (a loaded machine may take over a minute)
    with runner.Driver(lab, store, ex, harness=TinyHarness()) as d:
        d.drive(until=ids, timeout_s=120)
    execs = [e for e in store.stage_execs(ids) if e.outcome == "ok"]
    assert execs and all(e.gpu_s == pytest.approx(e.wall_s * 0.5) for e in execs)
    from sqlmodel import select

    from pipeline.store.tables import GpuUsage, StageGpu
    with store.session() as s:
        usage = list(s.exec(select(GpuUsage)))
    assert len(usage) == 1 and usage[0].samples >= 2 and usage[0].updated_at > usage[0].started_at
    with store.session() as s:
        utils = {row.exec_id: row.util for row in s.exec(select(StageGpu))}
    pretrains = {e.id for e in execs if e.stage == "pretrain"}  # 1.5 s each: three samples or so
    assert pretrains and pretrains <= set(utils) and set(utils.values()) == {40.0}
    by_run = store.gpu_by_run(ids)  # what `export mlflow` logs per (task, seed) run: gpu_s and gpu_util
    assert set(by_run) == set(ids) and all(util == 40.0 for _, util in by_run.values() if util is not None)
    assert sum(g for g, _ in by_run.values()) == pytest.approx(sum(e.gpu_s for e in store.stage_execs(ids)))
    c = store.goodput().as_dict()
    assert c["useful_gpu_s"] == pytest.approx(sum(e.gpu_s for e in execs))
    assert c["gpu_samples"] > 0 and c["gpu_busy_share"] == 1.0 and c["gpu_mean_util"] == 40.0
    from pipeline.harness import HARNESSES

    HARNESSES.register("tiny", TinyHarness)  # status opens the lab by its research.toml
    try:
        st = commands.status(lab.root, None)
    finally:
        HARNESSES.unregister("tiny")
    line = views.gpu_line(st["compute"], st["gpu"])
    assert line.startswith("GPU: useful ") and "busy 100.0% of the wall time sampled, mean utilisation 40.0 %" in line


def test_prepare_and_score_get_a_gpu_only_when_the_lab_gives_them_one(tmp_path: Path, monkeypatch) -> None:
    """`isolation.run_once` (the harness's prepare and score): `[run] prepare_gpus`/`score_gpus` take
    a share from the pool the slots take from, and the process sees that GPU and no rlimit, even with
    `memory_mb` set (CUDA cannot start under one); without one it sees no GPU at all
    (CUDA_VISIBLE_DEVICES empty) and `memory_mb` as its rlimit."""
    from pipeline import isolation

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    lab = gpu_lab(tmp_path / "lab", 'sandbox = "off"\nprepare_gpus = 0.5\nmemory_mb = 2048\n')
    assert lab.config.run.prepare_gpus == 0.5 and lab.config.run.score_gpus == 0
    from pipeline.memory import memory_plan

    assert memory_plan(lab.config.run).memory_mb is None  # the lab's stages: GPU ones, memory_mb or not
    (tmp_path / "stage.py").write_text(STAGE)
    pool = GpuPool.shared(["3"])
    seen, inner = {}, []
    with isolation.metered() as both:  # what the driver books of a harness call (`Scoring._booked`)
        for name, gpus in (("with", 0.5), ("without", 0.0)):
            with isolation.metered() as meter:
                done = isolation.run_once(lab, ["python", "stage.py", str(tmp_path), name, "0"], cwd=tmp_path,
                                          log=tmp_path / f"{name}.log", timeout_s=60, ro=[], gpus=gpus)
            assert done.returncode == 0, (tmp_path / f"{name}.log").read_text()
            seen[name] = json.loads((tmp_path / f"{name}.json").read_text())
            assert meter.gpu_s == pytest.approx(gpus * done.wall_s) and meter.cpu_s >= done.cpu_s > 0
            assert meter.wall_s >= done.wall_s
            inner.append(meter)
    # a block in a block counts in both
    assert both.gpu_s > 0 and both.gpu_s == pytest.approx(sum(m.gpu_s for m in inner))
    assert both.cpu_s >= sum(m.cpu_s for m in inner)
    assert seen["with"]["cuda"] == "3" and seen["with"]["rlimit_as"] == resource.RLIM_INFINITY
    assert seen["without"]["cuda"] == "" and 2048 << 20 <= seen["without"]["rlimit_as"] < 2304 << 20  # `memory_mb`
    # (a python command runs in the child process: the rlimit adds what that process already maps)
    assert pool.used() == {"3": 0.0}
    assert pool.take("a-whole-gpu-stage", 1) == ["3"]
    try:  # the GPU is held whole: a prepare that needs a share of it waits, here past its timeout
        with pytest.raises(Exception, match="no GPU came free"):
            isolation.run_once(lab, ["python", "stage.py", str(tmp_path), "late", "0"], cwd=tmp_path,
                               log=tmp_path / "late.log", timeout_s=1.0, ro=[], gpus=0.5)
    finally:
        pool.give_back("a-whole-gpu-stage")


def test_a_waiter_from_outside_the_driver_gets_the_next_free_share_and_the_reserve_stays_free() -> None:
    """The driver's executor takes a freed share back at once: without yielding, a smoke stage would
    wait for the whole queue. And it keeps `prepare`/`score`'s share placeable: the driver's own
    thread runs those between its stages and cannot wait for shares only it gives back."""
    pool = GpuPool(["0"])
    assert pool.take("stage-1", 1) == ["0"]
    assert pool.take("smoke", 1, wait=True) is None  # the smoke stage waits: wanted
    pool.give_back("stage-1")
    assert pool.take("stage-2", 1, yield_to_waiters=True) is None  # the driver's next stage yields
    assert pool.take("smoke", 1) == ["0"]
    pool.give_back("smoke")
    assert pool.take("stage-2", 1, yield_to_waiters=True) == ["0"]
    pool.give_back("stage-2")
    took = [pool.take(f"q{i}", 0.25, keep=0.25, yield_to_waiters=True) for i in range(4)]
    assert took == [["0"], ["0"], ["0"], None] and pool.take("score", 0.25) == ["0"]
    for h in ("q0", "q1", "q2", "score"):
        pool.give_back(h)
    # the reserve and a waiter together: a stage that would leave room for one of them, not both, waits
    assert [pool.take(f"d{i}", 0.25, keep=0.25, yield_to_waiters=True) for i in range(3)] == [["0"]] * 3
    # a smoke stage keeps the reserve too (its executor's `reserve`): full but the reserve, it waits
    assert pool.take("smoke", 0.25, keep=0.25, wait=True) is None
    pool.give_back("d2")
    assert pool.take("d3", 0.25, keep=0.25, yield_to_waiters=True) is None  # it yields to the smoke stage
    assert pool.take("smoke", 0.25, keep=0.25, wait=True) == ["0"] and pool.take("score", 0.25, reserved=True) == ["0"]
    assert capacity(0.25, 1, keep=0.25) == 3 and capacity(1, 1, keep=0.25) == 0 and capacity(1, 2, keep=0.5) == 1
    from pipeline.errors import UserError

    with pytest.raises(UserError, match="leaves no room for prepare_gpus/score_gpus"):
        LocalExecutor(gpus=1, preload=(), pool=GpuPool(["0"]), reserve=0.25)


def test_a_share_that_would_break_the_reserve_on_one_gpu_goes_on_another() -> None:
    """Placement prefers the least-loaded GPU but falls back on the next: two halves of a stage and a
    whole GPU kept for `prepare`/`score` fit on two GPUs (both halves on one), where taking only the
    preferred GPU gave one slot."""
    assert capacity(0.5, 2, keep=1) == 2 and capacity(0.25, 2, keep=1) == 4 and capacity(0.25, 2, keep=0.5) == 6
    pool = GpuPool(["0", "1"])
    assert pool.take("a", 0.5, keep=1) == ["0"]
    assert pool.take("b", 0.5, keep=1) == ["0"]  # GPU 1 would have left no whole GPU for the scorer
    assert pool.take("c", 0.5, keep=1) is None
    assert pool.take("score", 1) == ["1"]
    assert pool.take("d", 0.25) is None  # nothing is placed over a full GPU
    for h in ("a", "b", "score"):
        pool.give_back(h)
    assert pool.used() == {"0": 0.0, "1": 0.0}
    assert [pool.take(f"s{i}", 0.25) for i in range(2)] == [["0"], ["1"]]  # spread while there is room


def test_a_stage_run_alone_leaves_the_scorers_share_and_closes_its_gpu_to_other_stages() -> None:
    """A CUDA-OOM retry on the only GPU of a lab whose `score_gpus` is 0.25: a retry holding the GPU
    whole would leave the reserve no room, so no alone retry could ever start and every stage queued
    behind it would wait for ever. It holds the GPU but the reserve; only `prepare`/`score`
    (`reserved`) may use that, no other stage."""
    pool = GpuPool(["0"])
    assert pool.take("busy", 0.25, keep=0.25) == ["0"]
    assert pool.take("retry", 0.25, alone=True, keep=0.25) is None  # alone: it waits for a GPU nobody holds
    pool.give_back("busy")
    assert pool.take("retry", 0.25, alone=True, keep=0.25) == ["0"]
    held = pool.holding("retry")
    assert held is not None and held.alone and held.share == pytest.approx(0.75)
    assert pool.take("next", 0.25, keep=0.25) is None and pool.take("smoke", 0.25, wait=True) is None
    assert pool.take("score", 0.25, reserved=True) == ["0"]  # the driver's scorer still scores
    pool.give_back("score")
    pool.forget("smoke")
    pool.give_back("retry")
    assert pool.used() == {"0": 0.0} and pool.take("next", 0.25, keep=0.25) == ["0"]
    two = GpuPool(["0", "1"])  # where the reserve has another GPU, the retry holds its GPU whole
    assert two.take("retry", 0.25, alone=True, keep=0.25) == ["0"] and two.holding("retry").share == 1.0  # type: ignore[union-attr]
    assert two.take("next", 0.25, keep=0.25) == ["1"]


def test_a_cuda_oom_retry_on_the_only_gpu_of_a_lab_that_scores_on_it_runs(work: Path) -> None:
    """The same through the executor: a stage's CUDA OOM beside a neighbour, `gpus = 0.25` and a
    scorer's reserve of 0.25 on one GPU; the retry runs alone and both stages end."""
    pool = GpuPool(["0"])
    with LocalExecutor(gpus=0.25, slots=3, preload=(), pool=pool, reserve=0.25) as ex:
        results = run_all(ex, [stage(work, "greedy", 0.5, "oom-first"), stage(work, "neighbour", 1.5),
                               stage(work, "later", 0.2)], limit=40)
    assert {n: r.status for n, r in results.items()} == {"greedy": "ok", "neighbour": "ok", "later": "ok"}  # type: ignore[attr-defined]
    assert (work / "greedy.tries").read_text() == "2" and results["greedy"].extra["gpu_share"] == pytest.approx(0.75)  # type: ignore[attr-defined]
    spans = {n: json.loads((work / f"{n}.json").read_text()) for n in results}
    retry = spans.pop("greedy")
    assert all(o["end"] <= retry["start"] or o["start"] >= retry["end"] for o in spans.values())  # alone on its GPU
    assert pool.used() == {"0": 0.0}


def test_a_driver_whose_scorer_needs_a_gpu_share_scores_between_its_stages(tmp_path: Path, monkeypatch) -> None:
    """`[run] score_gpus` through the real driver: the scorer runs in the driver's own thread, which
    would wait for ever for a share its own full slots hold (the stages' shares are given back only
    when it polls). The executor keeps the scorer's share free, so every run is scored."""
    from agent.labinit import init_lab
    from pipeline import experiment, runner
    from pipeline.executors import make_executor
    from pipeline.lab import load_lab
    from pipeline.labrepo import resolve_commit

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6")
    root = init_lab(tmp_path / "lab", harness="command")
    research = root / "research.toml"
    research.write_text(research.read_text().replace(
        'sandbox = "auto"', 'sandbox = "off"\ngpus = 0.5\nscore_gpus = 0.5\npreload = ["numpy"]'))
    lab = load_lab(root)
    store = experiment.open_store(lab)
    ex = make_executor("local", lab)
    assert ex.slots == 1 and ex.reserve == 0.5  # one stage on the GPU, the scorer's half kept free
    ids = experiment.ensure_runs(store, lab, "autoresearch/baseline", lab.tasks(), [0, 1])
    with runner.Driver(lab, store, ex) as d:
        d.drive(until=ids, timeout_s=240)
    rows = store.results_for(resolve_commit(lab, "autoresearch/baseline"), lab.tasks())
    assert len(rows) == len(ids) and all(r.outcome == "ok" for r in rows), [(r.outcome, r.detail) for r in rows]
    assert GpuPool.shared(["6"]).used() == {"6": 0.0}
    # every call of the harness booked: the prepare once (on the CPU), each run's score with its GPU
    # half (score_gpus × the scorer's wall: a process of its own, python and numpy, CPU seconds too)
    from pipeline.store.tables import HarnessExec
    from sqlmodel import select

    with store.session() as s:
        calls = list(s.exec(select(HarnessExec).order_by(HarnessExec.id)))
    assert [(c.kind, c.outcome) for c in calls if c.kind == "prepare"] == [("prepare", "ok")]
    scores = [c for c in calls if c.kind == "score"]
    assert sorted(c.run_id for c in scores) == sorted(ids) and all(c.outcome == "ok" for c in scores)
    assert all(0 < c.gpu_s <= 0.5 * c.wall_s and c.cpu_s > 0 for c in scores)
    c = store.goodput().as_dict()
    assert c["harness_gpu_s"] == pytest.approx(sum(x.gpu_s for x in calls)) and c["harness_calls"] == len(calls)
    with runner.Driver(lab, store, make_executor("local", lab)) as d:  # a driver started again: the dataset is there
        d.prepared()
    with store.session() as s:
        assert [c.kind for c in s.exec(select(HarnessExec))].count("prepare") == 1  # found made: not a call booked
    from agent import views

    assert views.harness_line(c).startswith(f"scoring and preparing data: {len(calls)} calls, ")
    assert "scoring and preparing data " in views.gpu_line(c)


def test_smoke_runs_are_booked_with_their_cpu_and_gpu_time(work: Path, tmp_path: Path, monkeypatch) -> None:
    """A GPU lab's smoke runs on a fake GPU (a share of 0.5): each is a row of the store with its
    stages' CPU seconds and GPU-seconds (share × wall), how it ended and its hypothesis; `goodput`
    sums them apart from the measuring runs', and `status`'s lines say them."""
    from pipeline import experiment
    from pipeline.errors import MethodFailure
    from pipeline.harness import HARNESSES
    from pipeline.store.tables import SmokeExec
    from sqlmodel import select
    from support.tiny import TinyHarness
    from agent import views

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    lab = gpu_lab(tmp_path / "lab", 'sandbox = "off"\npreload = ["numpy"]\n', gpus="0.5", pretrain_sleep=0.5)
    store = experiment.open_store(lab)
    exp = experiment.Experiment(lab, store)
    HARNESSES.register("tiny", TinyHarness)  # what a plugin does (the lab names it)
    try:
        metric = exp.smoke("autoresearch/baseline", {}, hypothesis="7")
        with pytest.raises(MethodFailure):
            exp.smoke("autoresearch/baseline", {"pretrain.py": "raise SystemExit('broken on purpose')\n"},
                      hypothesis="8")
    finally:
        exp.close()
        HARNESSES.unregister("tiny")
    assert 0.0 <= metric <= 1.0
    with store.session() as s:
        rows = {r.hypothesis: r for r in s.exec(select(SmokeExec))}
    ok, bad = rows["7"], rows["8"]
    stages = len(lab.stages_in_order())
    assert (ok.outcome, ok.executor, ok.stages) == ("ok", "here", stages)
    assert ok.cpu_s > 0 and ok.wall_s > 0.5  # pretrain sleeps 0.5 s
    assert 0.5 * 0.5 <= ok.gpu_s <= 0.5 * ok.wall_s  # share × each stage's wall, within the run's wall
    assert ok.started_at < ok.gpu_from < ok.gpu_to <= ok.started_at + ok.wall_s + 0.01  # its stages' span on the GPU
    assert (bad.outcome, bad.stages) == ("method", 1) and bad.gpu_s > 0  # it failed at its first stage
    c = store.goodput().as_dict()
    assert (c["smoke_runs"], c["smoke_rejected"]) == (2, 1)
    assert c["smoke_gpu_s"] == pytest.approx(ok.gpu_s + bad.gpu_s) and c["useful_gpu_s"] == 0.0
    assert c["smoke_cpu_s"] == pytest.approx(ok.cpu_s + bad.cpu_s) and c["useful_cpu_s"] == 0.0
    assert store.smoke_spent("7") == {"runs": 1.0, "cpu_s": ok.cpu_s, "gpu_s": ok.gpu_s, "wall_s": ok.wall_s}
    assert store.goodput(since=ok.started_at + 1e-3).smoke_runs == 1  # `digest`'s period: the later one only
    assert views.smoke_line(c).startswith("smoke runs: 2 (1 rejected), ") and "GPU-h" in views.smoke_line(c)
    assert f"smoke runs {c['smoke_gpu_s'] / 3600:.3f} h" in views.gpu_line(c)


def test_a_gain_measured_with_more_stages_run_alone_than_its_baselines_is_held_for_a_human(tmp_path: Path) -> None:
    """A CUDA OOM beside another stage buys a stage a rerun with its GPU alone, and the OOM is read from
    a log branch code writes: a challenger could print one to get a GPU to itself, which in a lab that
    trains for a fixed time is more compute than its baseline had. A challenger with such runs at
    more than twice its baseline's rate is never promoted without a human (`Experiment.ran_alone`,
    the decide node's hold); at the baseline's rate, or with none, nothing is said."""
    from pipeline import experiment
    from pipeline.gpu_accounting import OOM_ALONE_DETAIL
    from pipeline.labrepo import resolve_commit
    from pipeline.lease import Owner
    from pipeline.outcomes import StageOutcome
    from pipeline.store.tables import Result
    from support.lab import git

    lab = gpu_lab(tmp_path / "lab", 'sandbox = "off"\n', gpus="0.5")
    store = experiment.open_store(lab)
    exp = experiment.Experiment(lab, store)
    root = Path(lab.root)  # type: ignore[attr-defined]
    base = resolve_commit(lab, "autoresearch/baseline")
    tree = git(root, "rev-parse", f"{base}^{{tree}}").strip()
    challenger = git(root, "commit-tree", tree, "-p", base, "-m", "a challenger").strip()

    def measured(commit: str, alone: int, runs: int = 6) -> None:
        store.ensure_arm(commit)
        store.enqueue(commit, [("a", s) for s in range(runs)])
        for i, claim in enumerate(store.claim(Owner.current(), runs)):
            if i < alone:  # its first attempt's row, as `_record_gpu_extra` books it
                eid = store.stage_started(claim.run.id, "pretrain", "k" * 64, executor="local", log_path=None)
                store.stage_finished(eid, StageOutcome.INFRA, detail=OOM_ALONE_DETAIL)
            store.finish(claim, Result(run_id=claim.run.id, commit=commit, task="a", seed=claim.run.seed, value=0.5))

    measured(base, 0)
    assert exp.ran_alone("autoresearch/baseline", challenger) is None  # nothing measured of it yet
    measured(challenger, 2)
    why = exp.ran_alone("autoresearch/baseline", challenger)
    assert why is not None and why.startswith("2 of its 6 runs ran a stage again alone") and "baseline: 0 of 6" in why
    assert store.alone_retries(challenger) == (2, 6) and store.alone_retries(base) == (0, 6)
    from sqlmodel import select

    with store.session() as s:  # a baseline that ran alone as often: no hold
        rows = list(s.exec(select(Result).where(Result.commit == base)))
    for r in rows[:2]:
        eid = store.stage_started(r.run_id, "pretrain", "k" * 64, executor="local", log_path=None)
        store.stage_finished(eid, StageOutcome.INFRA, detail=OOM_ALONE_DETAIL)
    assert exp.ran_alone("autoresearch/baseline", challenger) is None
    exp.close()


def test_the_decide_node_holds_a_gain_its_runs_bought_by_running_alone(tmp_path: Path) -> None:
    """The hold above through the graph: the real decide node, given the gate's improvement for a
    challenger whose measured runs re-ran stages alone after an OOM (and a baseline whose did not),
    holds it for a human with the reason, where the same gain without them is promoted."""
    from support.summary import BETTER, implemented, make_lab, measured, services

    from agent.graph import Nodes
    from pipeline.gpu_accounting import OOM_ALONE_DETAIL
    from pipeline.labrepo import resolve_commit
    from pipeline.lease import Owner
    from pipeline.outcomes import StageOutcome
    from pipeline.store.tables import Result

    svc = services(make_lab(tmp_path / "lab"))
    store = svc.store

    def runs(commit: str, alone: int, n: int = 4) -> None:
        store.ensure_arm(commit)
        store.enqueue(commit, [("default_90d", 100 + s) for s in range(n)])
        for i, claim in enumerate(store.claim(Owner.current(), n)):
            if i < alone:  # its lost first attempt, as `_record_gpu_extra` books it
                eid = store.stage_started(claim.run.id, "train", "k" * 64, executor="local", log_path=None)
                store.stage_finished(eid, StageOutcome.INFRA, detail=OOM_ALONE_DETAIL)
            store.finish(claim, Result(run_id=claim.run.id, commit=commit, task="default_90d", seed=claim.run.seed,
                                       value=0.7))

    fair, bought = implemented(svc), implemented(svc)
    runs(resolve_commit(svc.lab, fair.base_commit), 0)
    runs(fair.commit, 0)
    runs(bought.commit, 3)
    for h in (fair, bought):
        measured(svc, h, BETTER)
        Nodes(svc).decide({"hypothesis_id": h.id})
    fair, bought = svc.records.get(fair.id), svc.records.get(bought.id)
    assert (fair.decision, fair.status) == ("promote", "promoting")
    assert (bought.decision, bought.status) == ("hold", "held")
    assert "3 of its 4 runs ran a stage again alone" in bought.rationale_decision
