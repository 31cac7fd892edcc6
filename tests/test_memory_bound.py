"""A memory bound per stage that counts tmpfs, without cgroups (issue 20, "A memory bound per
stage"): cgroup v2 is not delegated everywhere (here: v1 only), so a stage's bound is its RLIMIT_AS
(`[run] memory_mb`) plus fixed-size tmpfs for /tmp, /dev/shm (64 MB) and {out}; with memory_mb
unset (and no GPU) the default makes the two fit 80 % of the machine's memory ÷ the local slots;
`status` says which mode is in force. Real config loader, real CLI, real sandbox."""

from __future__ import annotations

import errno
import json
import time
from pathlib import Path

import pytest

from support.lab import cli
from support.tiny import require_sandbox
from pipeline import isolation
from pipeline.executors import StageJob, classify
from pipeline.executors.local import LocalExecutor
from pipeline.lab import SHM_MB, LabConfigError, parse_config
from pipeline.memory import mem_total_mb, memory_plan
from pipeline import experiment, labrepo

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = (REPO / "pipeline" / "templates" / "command" / "research.toml").read_text()


def run_section(extra: str = "") -> object:
    return parse_config(TEMPLATE.replace("[run]", f"[run]\n{extra}", 1)).run


def test_the_default_memory_mb_is_the_slots_share_less_its_tmpfs() -> None:
    run = run_section("tmp_max_mb = 512\nout_max_mb = 2048")
    assert run.memory_mb is None
    plan = memory_plan(run, slots=2, total_mb=24_000)
    assert plan.budget_mb == 9600 and plan.shm_mb == SHM_MB == 64
    assert plan.memory_mb == 9600 - (512 + 64 + 2048) and plan.source == "default"
    assert plan.memory_mb + plan.tmpfs_mb == plan.budget_mb and plan.within_budget
    assert plan.describe() == ("memory: rlimit 6976 MB per stage (default) + tmpfs /tmp 512 MB, /dev/shm 64 MB, "
                               "out 2048 MB (no cgroup v2 delegation; bound 9600 MB per slot, 2 slot(s))")
    # on this machine, from /proc/meminfo and its cores
    here = memory_plan(run)
    assert here.budget_mb == int(mem_total_mb() * 0.8 / here.slots) and here.memory_mb == here.budget_mb - here.tmpfs_mb


def test_a_set_memory_mb_is_kept_and_a_bound_it_breaks_is_said() -> None:
    plan = memory_plan(run_section("memory_mb = 3000"), slots=2, total_mb=24_000)
    assert (plan.memory_mb, plan.source, plan.within_budget) == (3000, "set", True)
    assert "rlimit 3000 MB per stage ([run] memory_mb)" in plan.describe()
    small = memory_plan(run_section(), slots=2, total_mb=4000)  # 1600 MB a slot, 5184 MB of tmpfs
    assert small.memory_mb == 1024 and small.within_budget is False
    assert small.describe().endswith("EXCEEDED by 4608 MB)")
    gpu = memory_plan(run_section("gpus = 1"), slots=1, total_mb=24_000)
    assert gpu.memory_mb is None and gpu.source == "none" and "no rlimit" in gpu.describe()
    with pytest.raises(LabConfigError, match=r"^research.toml: run.memory_mb: [^\n]+$"):
        run_section("memory_mb = 0")


def test_the_local_executor_gives_a_job_without_memory_mb_the_default(tmp_path: Path) -> None:
    ex = LocalExecutor(preload=(), slots=1, default_memory_mb=1234)
    job = lambda **kw: StageJob(job_id="m", argv=["true"], cwd=tmp_path, commit="0" * 40, out=tmp_path,  # noqa: E731
                                log_path=tmp_path / "m.log", timeout_s=5, **kw)
    assert ex.stage_spec(job())["memory_mb"] == 1234
    assert ex.stage_spec(job(memory_mb=99))["memory_mb"] == 99


def test_status_says_which_memory_mode_is_in_force(tmp_path: Path) -> None:
    lab = tmp_path / "lab"
    assert cli(lab, "init", str(lab), "--harness", "command").returncode == 0
    toml = lab / "research.toml"
    toml.write_text(toml.read_text().replace("[run]", "[run]\nmemory_mb = 2900", 1))
    out = cli(lab, "status", "--json")
    assert out.returncode == 0, out.stderr
    mem = json.loads(out.stdout)["memory"]
    assert (mem["mode"], mem["cgroup"], mem["memory_mb"], mem["shm_mb"]) == ("rlimit+tmpfs", False, 2900, 64)
    out = cli(lab, "status")
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("memory:")]
    assert len(lines) == 1 and lines[0].startswith("memory: rlimit 2900 MB per stage ([run] memory_mb) + tmpfs /tmp ")
    assert "/dev/shm 64 MB" in lines[0] and "(no cgroup v2 delegation" in lines[0]


FILL = """
import errno, sys
path = sys.argv[1]
try:
    with open(path, "wb") as fh:
        for _ in range(int(sys.argv[2])):
            fh.write(b"x" * (1 << 20))
            fh.flush()
except OSError as e:
    print("full:", errno.errorcode.get(e.errno), file=sys.stderr)
    sys.exit(3)
print("wrote it all", file=sys.stderr)
"""


# RLIMIT_FSIZE (the larger of out_max_mb and tmp_max_mb) is set above the tmpfs tried, so the tmpfs's
# own size is what stops the write
@pytest.mark.parametrize("where, mb, out_mb, tmp_mb", [("/dev/shm/fill", 100, 128, 16), ("/tmp/fill", 40, 64, 16)])
def test_a_stage_that_writes_past_its_tmpfs_gets_enospc_as_the_methods_failure(tmp_path: Path, where: str, mb: int,
                                                                               out_mb: int, tmp_mb: int) -> None:
    require_sandbox()
    (tmp_path / "code").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "code" / "fill.py").write_text(FILL)
    spec = {"ro": [str(tmp_path / "code")], "rw": [], "out": str(tmp_path / "out"), "network": False,
            "out_max_mb": out_mb, "tmp_max_mb": tmp_mb, "max_procs": 64, "hidden": isolation.package_dirs()}
    with LocalExecutor(preload=(), slots=1) as ex:  # the sandbox's own default for /dev/shm: 64 MB
        ex.submit(StageJob(job_id="fill", argv=["python", "fill.py", where, str(mb)], cwd=tmp_path / "code",
                           commit="0" * 40, out=tmp_path / "out", log_path=tmp_path / "fill.log", timeout_s=60,
                           sandbox=spec))
        deadline, done = time.monotonic() + 60, []
        while not done and time.monotonic() < deadline:
            done = ex.poll(0.5)
    log = (tmp_path / "fill.log").read_text()
    assert f"full: {errno.errorcode[errno.ENOSPC]}" in log, log
    assert [(r.status, r.exit_code) for r in done] == [("exit", 3)], log
    assert classify(done[0]) == ("method", "crash")


# ----------------------------------------------------------------------------- prepare and score

# inserted into the command template's trusted prepare.py / score.py, after their arguments are read:
# one array past the bound, as a scorer reading a huge file at once would ask for. np.empty never
# touches its pages, so without the bound it is granted (overcommit) and uses no RAM: the test is
# safe on any machine and fails, instead of passing by luck, when the bound is missing
GREEDY = '''
import resource as _resource, sys as _sys
print("rlimit_as", _resource.getrlimit(_resource.RLIMIT_AS)[0], file=_sys.stderr, flush=True)
_big = np.empty(GREEDY_MB << 20, dtype=np.uint8)
print("allocated", GREEDY_MB, "MB past the bound", file=_sys.stderr, flush=True)
'''


def command_lab(tmp_path: Path, greedy_in: str) -> tuple[Path, int]:
    """`autoresearch init --harness command`, its `greedy_in` (prepare.py or score.py) asking for 1 GB
    more than the bound a process run once gets here, committed on the baseline (the trusted commit)."""
    from support.lab import git
    from pipeline.lab import load_lab

    lab = tmp_path / "lab"
    out = cli(lab, "init", str(lab), "--harness", "command")
    assert out.returncode == 0, out.stderr
    bound = isolation.once_memory_mb(load_lab(lab), with_out=False)  # prepare and score have no {out}
    assert bound is not None and bound >= 1024
    path = lab / greedy_in
    text = path.read_text()
    anchor = "a = p.parse_args()\n"
    assert anchor in text
    path.write_text(text.replace(anchor, anchor + GREEDY.replace("GREEDY_MB", str(bound + 1024)), 1))
    git(lab, "commit", "-qam", f"{greedy_in} asks for more memory than its bound")
    git(lab, "branch", "-f", "autoresearch/baseline", "HEAD")
    return lab, bound


def test_processes_run_once_get_the_stages_default_bound_or_the_set_one() -> None:
    """prepare, score and smoke stages (isolation.run_once) had no RLIMIT_AS unless memory_mb was set."""
    from types import SimpleNamespace

    from pipeline.memory import local_slots

    run = run_section()
    lab = SimpleNamespace(config=SimpleNamespace(run=run))
    assert isolation.once_memory_mb(lab) == memory_plan(run).memory_mb is not None
    # prepare and score have no {out} tmpfs: their share keeps it (unless the floor decides both)
    no_out = isolation.once_memory_mb(lab, with_out=False)
    assert no_out == memory_plan(run, with_out=False).memory_mb
    assert no_out == max(1024, memory_plan(run).budget_mb - run.tmp_max_mb - 64)
    lab.config.run = run_section("memory_mb = 1500")
    assert isolation.once_memory_mb(lab) == 1500
    gpu = run_section("gpus = 1")  # a GPU lab's stages get no rlimit; its prepare and score get no GPU
    lab.config.run = gpu
    assert memory_plan(gpu).memory_mb is None
    assert isolation.once_memory_mb(lab) == memory_plan(run_section(), local_slots(gpu)).memory_mb is not None


def test_a_prepare_that_allocates_past_its_bound_fails_in_one_line_and_is_recorded(tmp_path: Path) -> None:
    """Through the real CLI: `variance` stops in one line naming the failure (exit 2); the loop
    records it on the hypothesis it was measuring and on the lab's events, and ends normally."""
    require_sandbox()
    lab, bound = command_lab(tmp_path, "prepare.py")
    out = cli(lab, "variance", "--runs", "2", timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr, (out.returncode, out.stderr[-3000:])
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("error: [benchmark] prepare exited with 1 (") and "Unable to allocate" in line, line
    (log,) = (lab / "runs" / "logs").glob("prepare-command-*.log")
    text = log.read_text()
    assert "MemoryError" in text and "allocated" not in text, text[-2000:]
    # a `python` command runs in the child's interpreter: the bound is on top of what it maps already
    (limit,) = [int(ln.split()[1]) for ln in text.splitlines() if ln.startswith("rlimit_as ")]
    assert bound << 20 <= limit < (bound + 512) << 20, (limit >> 20, bound)
    assert not list((lab / "runs" / "data").glob("command-*"))  # nothing half-prepared is kept

    out = cli(lab, "run", "--offline", "--max-hypotheses", "1", timeout=300)
    # the trusted harness is the user's to fix: the loop stops in one line, the hypothesis is not lost
    assert out.returncode == 2 and "Traceback" not in out.stderr, (out.returncode, out.stderr[-3000:])
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: [benchmark] prepare exited with 1 (") and "Unable to allocate" in last, last
    st = json.loads(cli(lab, "status", "--json").stdout)
    (h,) = st["hypotheses"]
    assert h["decision"] is None and h["status"] != "done", h  # it waits at its checkpoint for the fix


def test_a_scorer_that_allocates_past_its_bound_is_the_runs_recorded_failure(tmp_path: Path) -> None:
    """Real driver, real sandboxed stage and scorer: the run is recorded as a method failure whose
    detail says why; the driver goes on (the next run is scored the same way)."""
    require_sandbox()
    from pipeline import runner
    from pipeline.lab import load_lab

    root, _bound = command_lab(tmp_path, "score.py")
    lab = load_lab(root)
    store = experiment.open_store(lab)
    ids = experiment.ensure_runs(store, lab, "autoresearch/baseline", ["default", "churn"], [0])
    with runner.Driver(lab, store, LocalExecutor(preload=(), slots=1)) as d:
        d.drive(until=ids, timeout_s=240)
    results = store.results_for(labrepo.resolve_commit(lab, "autoresearch/baseline"))
    assert sorted(r.task for r in results) == ["churn", "default"]
    for r in results:
        assert (r.outcome, r.kind, r.value) == ("method_failure", "predictions", None), r
        assert r.detail.startswith("score exited with 1: ") and "Unable to allocate" in r.detail, r.detail
