"""GPUs on a Ray cluster (issue 33's leftovers): packing, NVML sampled on the nodes, a CUDA OOM on a
shared GPU retried alone, and a GPU lab's smoke stages run on the cluster when the driver's machine
has no GPU (before, they ran on its CPU and every hypothesis of a lab that needs CUDA was rejected).

A real `ray start --head --num-gpus 1` node: Ray hands its GPU actors CUDA_VISIBLE_DEVICES as on
a GPU node, with no device behind it. The stages are real processes of
the Ray executor's warm workers, unsandboxed (the sandbox would bind a /dev/nvidia0 this machine
lacks; tests/test_gpu_binding.py checks that binding with fake nodes). NVML is a fake `pynvml` on
the Ray workers' path reporting the utilisation written in a file, as in tests/test_gpu_share.py.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from pathlib import Path

import pytest

from pipeline.errors import InfrastructureFailure, Interrupted, MethodFailure
from pipeline.executors import StageJob
from support.ray_cluster import RayCluster, ray_exclusive, require_ray
from support.tiny import CONFIG_NAME, make_lab, open_tiny_lab
from test_gpu_share import FAKE_NVML, run_all

pytestmark = pytest.mark.system

ray = require_ray()

# every attempt's span (wall clock, comparable across processes) is appended to `spans`, a failed one too
STAGE = """
import json, os, sys, time
out, name, hold, mode, state = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4], sys.argv[5]
start = time.time()
tries = os.path.join(state, name + ".tries")
n = int(open(tries).read()) + 1 if os.path.exists(tries) else 1
open(tries, "w").write(str(n))
time.sleep(hold)
span = {"name": name, "try": n, "start": start, "end": time.time(), "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}
with open(os.path.join(state, "spans"), "a") as fh:
    fh.write(json.dumps(span) + "\\n")
if mode == "oom-first" and n == 1:
    sys.exit("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB")
if mode == "oom":
    sys.exit("RuntimeError: CUDA error: out of memory")
open(os.path.join(out, "done"), "w").write(name)
"""


@pytest.fixture(scope="module")
def ray_gpu(tmp_path_factory: pytest.TempPathFactory):
    """A `ray start --head` node with one (logical) GPU, 4 CPUs, whose workers import the fake NVML
    (60 % utilisation); this process connected to it as the driver."""
    nvml = tmp_path_factory.mktemp("nvml")
    (nvml / "pynvml.py").write_text(FAKE_NVML)
    (nvml / "util").write_text("60")
    node_env = {"PYTHONPATH": os.pathsep.join([str(nvml), *filter(None, [os.environ.get("PYTHONPATH")])])}
    with ray_exclusive(), RayCluster(head_cpus=4, worker_cpus=0, head_gpus=1, env=node_env) as cluster, \
            cluster.connected():
        yield nvml


def executor(tmp_path: Path, gpus: float = 0.5):
    from pipeline.executors.ray_executor import RayExecutor

    return RayExecutor(cpus=1, gpus=gpus, preload=())


def stage(tmp_path: Path, name: str, hold: float, mode: str = "", gpus: float = 0.5) -> StageJob:
    code, out, state = tmp_path / "code", tmp_path / "out" / name, tmp_path / "state"
    for d in (code, out, state):
        d.mkdir(parents=True, exist_ok=True)
    (code / "stage.py").write_text(STAGE)
    return StageJob(job_id=f"{name}-{uuid.uuid4().hex[:6]}", cwd=code, commit="0" * 40, out=out,
                    argv=["python", str(code / "stage.py"), str(out), name, str(hold), mode, str(state)],
                    log_path=tmp_path / "logs" / f"{name}.log", timeout_s=60, gpus=gpus)


def spans(tmp_path: Path) -> dict[tuple[str, int], dict[str, object]]:
    lines = (tmp_path / "state" / "spans").read_text().splitlines()
    return {(s["name"], s["try"]): s for s in map(json.loads, lines)}


def test_ray_packs_half_gpu_stages_two_to_a_gpu_and_samples_that_gpu_once(ray_gpu: Path, tmp_path: Path) -> None:
    started = time.monotonic()
    with executor(tmp_path) as ex:
        assert ex.slots == 2  # 4 CPUs, but one GPU holds two stages of 0.5
        results = run_all(ex, [stage(tmp_path, f"s{i}", 1.5) for i in range(3)], limit=90)
        usage, deadline = None, time.monotonic() + 20
        while (usage is None or usage["samples"] < 5) and time.monotonic() < deadline:
            time.sleep(0.3)  # the actors sample every 0.5 s; each call counts the last call's answers
            usage = ex.gpu_usage()
        time.sleep(1.0)
        later = ex.gpu_usage(wait=True)
        elapsed = time.monotonic() - started
    assert all(r.status == "ok" for r in results.values()), results  # type: ignore[attr-defined]
    seen = spans(tmp_path)
    assert {s["cuda"] for s in seen.values()} == {"0"}  # Ray's choice of GPU, as on a GPU node
    first, second, third = sorted(seen.values(), key=lambda s: s["start"])
    assert first["start"] < second["end"] and second["start"] < first["end"]  # two at once on the GPU
    assert third["start"] >= min(first["end"], second["end"]) - 0.05  # the third waited for a slot
    for r in results.values():  # each stage's mean utilisation, sampled on its node while it ran
        assert r.extra["gpu_util"] == 60.0 and r.extra["gpu_samples"] >= 1, r.extra  # type: ignore[attr-defined]
    # the GPU counted once although two actors hold it: every sample busy at 60 %, cumulative
    assert usage is not None and len(usage["gpus"]) == 1 and usage["gpus"][0].endswith(":0"), usage
    assert usage["samples"] >= 5 and usage["busy"] == usage["samples"], usage
    assert usage["util_sum"] == pytest.approx(60.0 * usage["samples"])
    assert later is not None and later["samples"] > usage["samples"] and later["holder"] == usage["holder"]
    # one sample per 0.5 s at most: the two actors on the GPU sampled it both, and it was counted once
    assert later["samples"] <= elapsed / 0.5 + 2, (later["samples"], elapsed)


def test_a_cuda_oom_on_a_shared_gpu_runs_again_with_the_gpu_alone_on_ray(ray_gpu: Path, tmp_path: Path) -> None:
    """A ran out of CUDA memory while B shared its GPU: A runs again once B is done, with the GPU to
    itself (C, queued behind, does not start on it meanwhile); its first attempt is booked as lost."""
    with executor(tmp_path) as ex:
        results = run_all(ex, [stage(tmp_path, "a", 1.5, "oom-first"), stage(tmp_path, "b", 3.0),
                               stage(tmp_path, "c", 0.5)], limit=90)
        # an OOM with the GPU to itself is the method's own failure: no second attempt
        (lone,) = run_all(ex, [stage(tmp_path, "d", 0.2, "oom")], limit=90).values()
    a = results["a"]
    assert all(r.status == "ok" for r in results.values()), results  # type: ignore[attr-defined]
    seen = spans(tmp_path)
    assert seen[("a", 1)]["start"] < seen[("b", 1)]["end"]  # they shared the GPU
    assert seen[("a", 2)]["start"] >= seen[("b", 1)]["end"] - 0.05  # the retry waited for B
    assert seen[("c", 1)]["start"] >= seen[("a", 2)]["end"] - 0.05  # nothing joined it on its GPU
    lost = a.extra["gpu_oom_retried_alone"]  # type: ignore[attr-defined]
    assert 1.4 < lost["wall_s"] < 3.0 and lost["gpu_s"] == pytest.approx(lost["wall_s"] * 0.5)
    assert a.extra["gpu_share"] == 1.0  # type: ignore[attr-defined]  (its GPU whole: gpu_s = wall × 1)
    assert "running this stage again with the GPU alone" in (tmp_path / "logs" / "a.log").read_text()
    assert lone.status == "exit" and ("d", 2) not in spans(tmp_path)  # type: ignore[attr-defined]
    assert "gpu_oom_retried_alone" not in lone.extra  # type: ignore[attr-defined]


def test_run_ahead_takes_the_next_free_slot_before_the_queue_and_stops_on_request(ray_gpu: Path,
                                                                                  tmp_path: Path) -> None:
    """A smoke stage from the loop's thread, while the driver's thread keeps both slots busy."""
    with executor(tmp_path) as ex:
        for j in (stage(tmp_path, "q1", 2.0), stage(tmp_path, "q2", 2.5), stage(tmp_path, "q3", 0.5)):
            ex.submit(j)
        got: dict[str, object] = {}

        def ahead() -> None:
            got["smoke"] = ex.run_ahead(stage(tmp_path, "smoke", 0.5))

        time.sleep(0.5)  # q1 and q2 run, q3 waits
        t = threading.Thread(target=ahead)
        t.start()
        done: dict[str, object] = {}
        deadline = time.monotonic() + 60
        while (len(done) < 3 or t.is_alive()) and time.monotonic() < deadline:  # the driver's thread polls
            done.update({r.job_id.split("-")[0]: r for r in ex.poll(0.2)})
        t.join(1)

        # stopped while it waits for a slot: Interrupted at once, nothing queued lost
        for j in (stage(tmp_path, "r1", 3.0), stage(tmp_path, "r2", 3.0), stage(tmp_path, "r3", 0.2)):
            ex.submit(j)  # r3 queued behind them while the stopped `run_ahead` waits
        stop, caught = threading.Event(), {}

        def stopped() -> None:
            try:
                ex.run_ahead(stage(tmp_path, "stopped", 0.1), stop)
            except Interrupted as e:
                caught["at"], caught["e"] = time.monotonic(), e

        t2 = threading.Thread(target=stopped)
        t2.start()
        time.sleep(0.5)
        asked = time.monotonic()
        stop.set()
        t2.join(10)
        rest: dict[str, object] = {}
        deadline = time.monotonic() + 60
        while len(rest) < 3 and time.monotonic() < deadline:
            rest.update({r.job_id.split("-")[0]: r for r in ex.poll(0.5)})
    assert got["smoke"].status == "ok", got  # type: ignore[attr-defined]
    assert sorted(done) == ["q1", "q2", "q3"] and all(r.status == "ok" for r in done.values())  # type: ignore[attr-defined]
    seen = spans(tmp_path)
    smoke, q3 = seen[("smoke", 1)], seen[("q3", 1)]
    assert smoke["cuda"] == "0"  # a slot holding the lab's GPU
    assert smoke["start"] >= seen[("q1", 1)]["end"] - 0.05  # it waited for the first slot to come free
    assert smoke["start"] < q3["start"]  # and took it before the queued q3
    assert caught["at"] - asked < 2.0 and ("stopped", 1) not in seen  # type: ignore[operator]
    assert sorted(rest) == ["r1", "r2", "r3"] and all(r.status == "ok" for r in rest.values())  # type: ignore[attr-defined]


def test_a_gpu_labs_smoke_run_uses_the_clusters_gpu_when_the_driver_has_none(ray_gpu: Path, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 33 on Ray: a lab whose stages require CUDA, a driver machine without a GPU. Its smoke run
    ran on that machine's CPU and failed `require_cuda`; through the driver's executor it passes."""
    from pipeline.harness import HARNESSES
    from support.tiny import TinyHarness

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # this machine: no GPU
    HARNESSES.register("tiny", TinyHarness)  # what a plugin does (the lab names it)
    try:
        check_smoke_on_ray(tmp_path)
    finally:
        HARNESSES.unregister("tiny")


def check_smoke_on_ray(tmp_path: Path) -> None:
    from pipeline import experiment
    from pipeline.executors import ExecutorOptions
    from pipeline.smoke import SmokeRunner, smoke_run

    root = tmp_path / "lab"
    make_lab(root)
    cfg = root / CONFIG_NAME
    cfg.write_text(cfg.read_text().replace("cpus = 1\n", 'cpus = 1\ngpus = 0.5\nsandbox = "off"\npreload = ["numpy"]\n'))
    lab = open_tiny_lab(root)
    needs_cuda = ("import os, sys\nif not os.environ.get('CUDA_VISIBLE_DEVICES'):\n"
                  "    sys.exit('config.toml says require_cuda, but torch sees no CUDA device')\n")
    files = {"pretrain.py": needs_cuda + (root / "pretrain.py").read_text()}

    here = SmokeRunner(lab)  # no executor to lend a GPU: the CPU of this machine, as before
    try:
        assert here.gpus == 0
        with pytest.raises(MethodFailure, match="require_cuda"):
            smoke_run(lab, "autoresearch/baseline", files, runner=here)
    finally:
        here.close()

    exp = experiment.Experiment(lab, experiment.open_store(lab))
    driver = exp.driver(ExecutorOptions("ray"))
    try:
        metric = exp.smoke("autoresearch/baseline", files)
        assert exp._smoke_runner is not None and exp._smoke_runner.remote and exp._smoke_runner.gpus == 0.5
        assert len(driver.executor._idle) == driver.executor.slots  # the slot its stages held is back
        driver.close()  # the driver's thread ended (a crash, a stop): never this machine's CPU instead
        with pytest.raises(InfrastructureFailure, match="was closed"):
            exp.smoke("autoresearch/baseline", files)
    finally:
        exp.close()
        driver.close()
    assert 0.0 <= metric <= 1.0
    from pipeline.store.tables import SmokeExec
    from sqlmodel import select

    with exp.store.session() as s:  # both booked: the stages' GPU-seconds on the node, then the lost one
        rows = [(r.outcome, r.executor, r.stages, r.gpu_s > 0) for r in s.exec(select(SmokeExec).order_by(SmokeExec.id))]
    assert rows == [("ok", "ray", len(lab.stages_in_order()), True), ("infra", "here", 0, False)]



def test_two_cuda_ooms_on_one_gpu_and_a_smoke_stage_waiting_all_finish_one_at_a_time(ray_gpu: Path,
                                                                                      tmp_path: Path) -> None:
    """Both stages on the GPU run out of memory; each runs again alone, one after the other, while a
    smoke stage waits for a slot (it may not join either): nothing waits for ever, nothing overlaps."""
    with executor(tmp_path) as ex:
        for j in (stage(tmp_path, "a", 1.0, "oom-first"), stage(tmp_path, "b", 1.0, "oom-first"),
                  stage(tmp_path, "c", 0.2)):
            ex.submit(j)
        got: dict[str, object] = {}
        t = threading.Thread(target=lambda: got.update(smoke=ex.run_ahead(stage(tmp_path, "smoke", 0.2))))
        time.sleep(0.4)
        t.start()
        done: dict[str, object] = {}
        deadline = time.monotonic() + 60
        while (len(done) < 3 or t.is_alive()) and time.monotonic() < deadline:
            done.update({r.job_id.split("-")[0]: r for r in ex.poll(0.2)})
        t.join(1)
    assert not t.is_alive() and got["smoke"].status == "ok", got  # type: ignore[attr-defined]
    assert sorted(done) == ["a", "b", "c"] and all(r.status == "ok" for r in done.values()), done  # type: ignore[attr-defined]
    seen = spans(tmp_path)
    a2, b2, smoke, c = seen[("a", 2)], seen[("b", 2)], seen[("smoke", 1)], seen[("c", 1)]
    first, second = sorted((a2, b2), key=lambda x: x["start"])
    assert second["start"] >= first["end"] - 0.05  # alone: the retries one at a time
    assert smoke["start"] >= second["end"] - 0.05 and c["start"] >= second["end"] - 0.05  # neither joined a retry
    assert smoke["start"] < c["end"]  # and the smoke did not wait behind the queue


def test_a_lent_slot_makes_the_queue_wait_without_spinning_and_close_interrupts_a_stage_run_ahead(
        ray_gpu: Path, tmp_path: Path) -> None:
    with executor(tmp_path) as ex:
        lent = [ex.borrow(), ex.borrow()]  # both slots lent (a smoke run holds one for all its stages)
        ex.submit(stage(tmp_path, "q", 0.2))
        calls, until = 0, time.monotonic() + 2.0
        while time.monotonic() < until:  # the driver's thread polls while q waits for a slot
            assert ex.poll(0.5) == []
            calls += 1
        assert calls <= 8, calls  # each poll waited for a slot to come back (it spun 1.5 million times)
        ex.give_back_lent(lent[0])
        got: dict[str, object] = {}
        deadline = time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            got.update({r.job_id.split("-")[0]: r for r in ex.poll(0.5)})
        assert got["q"].status == "ok", got  # type: ignore[attr-defined]

        caught: dict[str, BaseException] = {}

        def ahead() -> None:
            try:
                ex.run_ahead(stage(tmp_path, "long", 5.0), slot=lent[1])
            except BaseException as e:
                caught["e"] = e

        t = threading.Thread(target=ahead)
        t.start()
        time.sleep(1.0)  # the stage runs on the lent slot
        asked = time.monotonic()
        ex.close()  # the loop stops: the driver's thread closes its executor under a running smoke stage
        t.join(10)
    assert not t.is_alive() and isinstance(caught.get("e"), Interrupted), caught
    assert time.monotonic() - asked < 8
    assert ("long", 1) not in spans(tmp_path)  # cancelled: it never finished


@pytest.mark.parametrize("smoke_first", [False, True])
def test_a_smoke_stages_cuda_oom_beside_a_queued_stage_runs_again_with_the_gpu_alone(ray_gpu: Path, tmp_path: Path,
                                                                                    smoke_first: bool) -> None:
    """A neighbour must not fail a hypothesis at smoke either: the smoke stage that ran out of CUDA
    memory while a driver's stage shared its GPU (started before it, or after) runs again once that
    stage is done, with the GPU to itself (the queued q2 does not join it)."""
    with executor(tmp_path) as ex:
        got: dict[str, object] = {}
        t = threading.Thread(target=lambda: got.update(smoke=ex.run_ahead(stage(tmp_path, "smoke", 0.8, "oom-first"))))
        if smoke_first:
            t.start()
            time.sleep(0.3)
        ex.submit(stage(tmp_path, "q", 2.0))
        if not smoke_first:
            t.start()
        time.sleep(0.3)
        ex.submit(stage(tmp_path, "q2", 0.2))
        done: dict[str, object] = {}
        deadline = time.monotonic() + 60
        while (len(done) < 2 or t.is_alive()) and time.monotonic() < deadline:
            done.update({r.job_id.split("-")[0]: r for r in ex.poll(0.2)})
        t.join(1)
    assert got["smoke"].status == "ok", got  # type: ignore[attr-defined]
    assert all(r.status == "ok" for r in done.values()) and sorted(done) == ["q", "q2"]  # type: ignore[attr-defined]
    seen = spans(tmp_path)
    assert seen[("smoke", 1)]["start"] < seen[("q", 1)]["end"]  # it shared the GPU, and ran out of memory
    assert seen[("smoke", 2)]["start"] >= seen[("q", 1)]["end"] - 0.05  # again once q was done
    assert seen[("q2", 1)]["start"] >= seen[("smoke", 2)]["end"] - 0.05  # alone: q2 waited
    assert "running this stage again with the GPU alone" in (tmp_path / "logs" / "smoke.log").read_text()
    extra = got["smoke"].extra  # type: ignore[attr-defined]
    assert extra["gpu_share"] == 1.0 and extra["gpu_oom_retried_alone"]["wall_s"] > 0  # both attempts booked
    from pipeline.smoke import SmokeCost

    cost = SmokeCost()
    cost.add_result(got["smoke"], 0.5)
    first = extra["gpu_oom_retried_alone"]
    assert cost.stages == 2 and cost.gpu_s == pytest.approx(got["smoke"].wall_s * 1.0 + first["wall_s"] * 0.5)


def test_prepare_and_score_given_a_gpu_run_on_the_clusters_share_from_a_driver_without_one(
        ray_gpu: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lab whose `prepare` and `score` need a GPU (`prepare_gpus`, `score_gpus`: a scorer that runs a
    model on the sealed data) on a cluster whose head has none: the executor holds a share of the
    cluster's GPU for them (placed before its slots, which are one fewer), and `run_once` sends them
    there through `isolation.gpu_runner`, the trusted files and the sealed data with them; the
    prepared folders and the scorer's stdout come back. Without the runner they refuse in one line."""
    import numpy as np

    from pipeline import isolation
    from pipeline.errors import UserError
    from pipeline.executors.ray_executor import RayExecutor
    from pipeline.scoring import harness_runner
    from test_stop_once import command_lab

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the loop's machine: no GPU
    lab = command_lab(tmp_path / "lab", extra="\nprepare_gpus = 0.25\nscore_gpus = 0.25")
    harness, bench = lab.harness(), lab.config.benchmark
    with pytest.raises(UserError, match="given 0.25 GPU"):
        harness.prepare(lab.state, bench.suite, bench.data_seed)
    with RayExecutor(cpus=1, gpus=0.5, preload=(), harness_gpus=0.25) as ex:
        assert ex.slots == 1  # one GPU: a stage of 0.5 beside the harness's 0.25 (a second would leave it no room)
        assert harness_runner(ex) is not None
        with isolation.gpu_runner(harness_runner(ex)), isolation.metered() as meter:
            prepared = harness.prepare(lab.state, bench.suite, bench.data_seed)
            ids = np.load(prepared.sealed / "test_labels.npz")["id"]
            (tmp_path / "preds").mkdir()
            preds = tmp_path / "preds" / "predictions.csv"
            preds.write_text("id,score\n" + "".join(f"{int(i)},0.5\n" for i in ids))
            value = harness.score(prepared, lab.tasks()[0], preds, bench.metric)
            # what such a process sees on the node: the GPU Ray gave the harness's actor
            seen = tmp_path / "seen.txt"
            done = isolation.run_once(lab, ["python", "-c", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'], "
                                            "os.environ.get('CUDA_DEVICE_ORDER'))"],
                                      cwd=tmp_path / "preds", log=tmp_path / "seen.log", timeout_s=60, ro=[],
                                      stdout=seen, gpus=0.25, reserved=True)
            visible, order = seen.read_text().split()
            assert done.returncode == 0 and visible not in ("", "-1") and order == "PCI_BUS_ID", seen.read_text()
            # a stop ends a call on the cluster too: `Interrupted`, in seconds, not the sleeper's 120 s
            stop = threading.Event()
            threading.Timer(1.0, stop.set).start()
            t0 = time.monotonic()
            with isolation.stopping(stop), pytest.raises(Interrupted):
                isolation.run_once(lab, ["python", "-c", "import time; time.sleep(120)"], cwd=tmp_path / "preds",
                                   log=tmp_path / "sleep.log", timeout_s=300, ro=[], gpus=0.25, reserved=True)
            assert time.monotonic() - t0 < 20
            # a stop also ends a wait for the share behind another call (one call at a time)
            first_stop, caught = threading.Event(), []

            def first() -> None:
                with isolation.gpu_runner(harness_runner(ex)), isolation.stopping(first_stop):
                    try:
                        isolation.run_once(lab, ["python", "-c", "import time; time.sleep(120)"], cwd=tmp_path / "preds",
                                           log=tmp_path / "first.log", timeout_s=300, ro=[], gpus=0.25, reserved=True)
                    except Interrupted as e:
                        caught.append(e)

            holder = threading.Thread(target=first)
            holder.start()
            time.sleep(1.0)
            stop = threading.Event()
            threading.Timer(1.0, stop.set).start()
            t0 = time.monotonic()
            with isolation.stopping(stop), pytest.raises(Interrupted, match="waited"):
                isolation.run_once(lab, ["python", "-c", "print(1)"], cwd=tmp_path / "preds",
                                   log=tmp_path / "second.log", timeout_s=300, ro=[], gpus=0.25, reserved=True)
            assert time.monotonic() - t0 < 10 and holder.is_alive()
            first_stop.set()
            holder.join(60)
            assert not holder.is_alive() and caught
        results = run_all(ex, [stage(tmp_path, "after", 0.1)])  # the slots still run stages
    assert value == pytest.approx(float(np.log(2)), rel=1e-9)  # log-loss of 0.5 everywhere
    assert (prepared.public / "train.npz").is_file() and (prepared.public / ".prepared").is_file()
    assert meter.processes == 4 and meter.gpu_s > 0  # all on the books, with their GPU share
    assert results["after"].status == "ok"  # type: ignore[attr-defined]
