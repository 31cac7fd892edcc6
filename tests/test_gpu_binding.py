"""Per-GPU binding (issue 20, "Limits that hold"): with `[run] gpus > 0` a sandboxed stage gets
the NVIDIA control nodes and only its own /dev/nvidia<N>, never every GPU of the machine.

This machine has no GPU, so the choice is tested against a fake /dev (empty files named like the
nodes) and a fake /proc/driver/nvidia/gpus, and the real sandbox is shown to refuse, in one line,
a stage whose GPU has no node here rather than bind anything else.
"""

from __future__ import annotations

import errno
import time
from pathlib import Path

import pytest

from pipeline.executors import StageJob
from pipeline.executors.gpus import GpuPool
from pipeline.executors.local import LocalExecutor
from pipeline.executors.sandbox import DEVICES, SETUP_FAILED, device_nodes, gpu_devices, gpu_plan

pytestmark = pytest.mark.integration

NODES = ["nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools",
         "nvidia-modeset"]
UUIDS = ["GPU-aaaa0000-0000", "GPU-bbbb1111-1111", "GPU-cccc2222-2222", "GPU-dddd3333-3333"]


def fake_dev(root: Path, *, caps: bool = True) -> Path:
    dev = root / "dev"
    dev.mkdir()
    for name in [*NODES, "null", "zero", "nvme0"]:
        (dev / name).touch()
    if caps:
        (dev / "nvidia-caps").mkdir()
        for name in ("nvidia-cap1", "nvidia-cap2"):
            (dev / "nvidia-caps" / name).touch()
    return dev


def fake_proc(root: Path, minors: list[int]) -> Path:
    """/proc/driver/nvidia/gpus: one folder per GPU by PCI bus id, its minor and UUID."""
    proc = root / "gpus"
    for i, minor in enumerate(minors):
        d = proc / f"0000:{0x18 + i:02x}:00.0"
        d.mkdir(parents=True)
        (d / "information").write_text(
            f"Model: \t\t NVIDIA H200\nIRQ:   \t\t 100\nGPU UUID: \t {UUIDS[i]}\nVideo BIOS: \t ??.??.??.??.??\n"
            f"Bus Type: \t PCIe\nDMA Size: \t 52 bits\nBus Location: \t 0000:{0x18 + i:02x}:00.0\n"
            f"Device Minor: \t {minor}\n")
    return proc


def test_only_the_assigned_gpus_node_and_the_control_nodes_are_chosen(tmp_path: Path) -> None:
    dev, proc = fake_dev(tmp_path), fake_proc(tmp_path, [0, 1, 2, 3])
    nodes, inside = gpu_devices(["1"], str(dev), str(proc))
    assert nodes == ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset",
                     "nvidia-caps/nvidia-cap1", "nvidia-caps/nvidia-cap2", "nvidia1"]
    assert inside == [UUIDS[1]]  # the same GPU whether or not CUDA renumbers the nodes it can open
    nodes, inside = gpu_devices(["3", "0"], str(dev), str(proc))
    assert [n for n in nodes if n[6:].isdigit()] == ["nvidia3", "nvidia0"] and inside == [UUIDS[3], UUIDS[0]]
    # by UUID (a unique prefix, as CUDA takes it), and the driver's minor, not the index, names the node
    nodes, _ = gpu_devices(["GPU-cccc"], str(dev), str(fake_proc(tmp_path / "odd", [3, 2, 1, 0])))
    assert [n for n in nodes if n[6:].isdigit()] == ["nvidia1"]


def test_without_the_drivers_proc_the_index_is_the_minor_and_inside_is_renumbered(tmp_path: Path) -> None:
    dev = fake_dev(tmp_path, caps=False)
    nodes, inside = gpu_plan(sorted(p.name for p in dev.iterdir() if p.name.startswith("nvidia")), ["2", "3"], [])
    assert nodes == ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset", "nvidia2", "nvidia3"]
    assert inside == ["0", "1"]


@pytest.mark.parametrize("ids, why", [
    (["7"], "the driver lists 4 GPU"),
    (["GPU-ffff"], "no GPU of the driver has that UUID"),
    (["MIG-1234"], "MIG ids are not supported"),
    ([], "assigned no GPU"),
    (["-1"], "assigned no GPU"),
])
def test_an_id_that_names_no_node_is_refused_never_all_gpus(tmp_path: Path, ids: list[str], why: str) -> None:
    dev, proc = fake_dev(tmp_path), fake_proc(tmp_path, [0, 1, 2, 3])
    with pytest.raises(OSError, match=why) as e:
        device_nodes({"gpus": 1, "gpu_ids": ids}, str(dev), str(proc))
    assert e.value.errno == errno.ENODEV
    with pytest.raises(OSError, match="no /dev/nvidia5") as e:  # a minor the driver has but /dev lacks
        gpu_plan(["nvidiactl", "nvidia0"], ["0"], [{"bus": "x", "minor": 5, "uuid": None}])
    assert e.value.errno == errno.ENODEV


def test_the_local_executors_stage_with_gpu_1_binds_nvidia1_and_not_nvidia0(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    dev, proc = fake_dev(tmp_path), fake_proc(tmp_path, [0, 1, 2, 3])
    pool = GpuPool(["0", "1"])
    ex = LocalExecutor(gpus=1, preload=(), pool=pool)
    assert ex.slots <= 2
    specs = {}
    for job_id in ("first", "second"):  # the first holds GPU 0, so the second is given GPU 1
        assert pool.take(job_id, 1) == [str(len(specs))]
        job = StageJob(job_id=job_id, argv=["true"], cwd=tmp_path, commit="0" * 40, out=tmp_path / job_id,
                       log_path=tmp_path / f"{job_id}.log", timeout_s=5, gpus=1,
                       sandbox={"ro": [str(tmp_path)], "rw": [], "out": str(tmp_path / job_id)})
        specs[job_id] = ex.stage_spec(job)
    box = specs["second"]["sandbox"]
    assert box["gpu_ids"] == ["1"]
    bound = ["/dev/" + n for n in device_nodes(box, str(dev), str(proc))]
    assert "/dev/nvidia1" in bound and "/dev/nvidia0" not in bound and "/dev/nvidiactl" in bound
    assert [f"/dev/{d}" for d in DEVICES] == bound[:len(DEVICES)]
    assert not [b for b in bound if b[11:].isdigit() and b != "/dev/nvidia1"]
    assert specs["first"]["sandbox"]["gpu_ids"] == ["0"]


def test_a_real_sandboxed_stage_whose_gpu_has_no_node_here_is_refused_in_one_line(tmp_path: Path,
                                                                                    monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # this machine has no /dev/nvidia0
    out = tmp_path / "out"
    out.mkdir()
    with LocalExecutor(gpus=1, preload=(), slots=1) as ex:
        ex.submit(StageJob(job_id="g", argv=["sh", "-c", "ls /dev > /tmp/x"], cwd=tmp_path, commit="0" * 40,
                           out=out, log_path=tmp_path / "g.log", timeout_s=30, gpus=1,
                           sandbox={"ro": [str(tmp_path)], "rw": [], "out": str(out)}))
        deadline, done = time.monotonic() + 30, []
        while not done and time.monotonic() < deadline:
            done = ex.poll(0.5)
    log = (tmp_path / "g.log").read_text()
    assert [r.exit_code for r in done] == [SETUP_FAILED], log
    lines = [ln for ln in log.splitlines() if ln.startswith("sandbox:")]
    assert len(lines) == 1 and "no /dev/nvidia0" in lines[0], log
