"""Tiny transactions labs, the CLI as a real subprocess, and a fake OpenAI server that routes answers.

The lab is the real template (`autoresearch init`) shrunk to CPU seconds: 300 customers, two tasks,
3 baseline runs, looks at 2 and 3 challenger runs (the two-sample `sequential` protocol), a one-layer 16-wide model trained for one epoch.
It is built once per session (`make_template`) and copied per test (`copy_lab`), datasets included,
so a test pays only for what it measures. Everything is real: git, SQLite, the warm-worker
executor, the sealed scorer, the openai SDK over HTTP.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from support import REPO, TESTS, cli, cli_env, cli_json, free_port, git  # noqa: F401 (re-exported)
from support.fake_openai import FakeOpenAI, Step, content, error, reject_response_format, reject_tools

TASKS = ["default_90d", "churn_60d"]
BASELINE = "autoresearch/baseline"
DUMMY_KEY = "sk-dummy-4f1c9e0b7a2d"  # the secret no stage may ever see


# ----------------------------------------------------------------------------- labs

def make_template(root: Path) -> Path:
    """`autoresearch init`, shrunk; committed on main and `autoresearch/baseline`; dataset prepared."""
    from agent.labinit import init_lab
    from pipeline.harness import get_harness
    from pipeline.lab import load_lab
    from pipeline.smoke import SMOKE_CUSTOMERS

    init_lab(root)
    research = (root / "research.toml").read_text()
    research = research.replace("data_seed = 0", f"data_seed = 0\ncustomers = 300\ntasks = {json.dumps(TASKS)}")
    research = research.replace("baseline_runs = 10", "baseline_runs = 3")
    # the agent's tests plant results for a two-sample look at 2 runs: this lab keeps the `sequential`
    # protocol; the paired default runs in tests/test_own_lab.py, test_attacks.py, test_seeds_vary.py
    research = research.replace('protocol = "paired"', 'protocol = "sequential"')
    research = research.replace("looks = [1, 2, 5, 10]", "looks = [2, 3]")
    (root / "research.toml").write_text(research)
    config = (root / "config.toml").read_text()
    for old, new in (("max_events = 24", "max_events = 8"), ("d_model = 48", "d_model = 16"),
                     ("n_layers = 2", "n_layers = 1")):
        assert old in config, old
        config = config.replace(old, new)
    config = re.sub(r"(?m)^epochs = \d+", "epochs = 1", config)
    (root / "config.toml").write_text(config)
    git(root, "commit", "-qam", "tiny lab for tests")
    git(root, "branch", "-f", BASELINE, "HEAD")
    lab = load_lab(root)
    b = lab.config.benchmark
    get_harness(b.harness).prepare(lab.state, b.suite, b.data_seed, b.customers)
    get_harness(b.harness).prepare(lab.state, b.suite, b.data_seed, SMOKE_CUSTOMERS, smoke=True)  # the smoke run's
    return root


def copy_lab(template: Path, dst: Path) -> Path:
    shutil.copytree(template, dst, symlinks=True)
    return dst


def set_research(root: Path, old: str, new: str) -> None:
    """Edit research.toml and commit it on the baseline (the loop reads the lab's checkout)."""
    path = root / "research.toml"
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new))
    git(root, "commit", "-qam", f"research.toml: {new}")
    git(root, "branch", "-f", BASELINE, "HEAD")


def make_branch(root: Path, branch: str, edits: Iterable[tuple[str, str, str]]) -> str:
    """A researcher's branch off the baseline with search/replace edits; the checkout is left alone."""
    with_worktree = root.parent / f"wt-{branch.replace('/', '-')}"
    git(root, "worktree", "add", "-q", "-b", branch, str(with_worktree), BASELINE)
    try:
        for path, search, replace in edits:
            target = with_worktree / path
            text = target.read_text()
            assert text.count(search) == 1, (path, search)
            target.write_text(text.replace(search, replace))
        git(with_worktree, "commit", "-qam", f"{branch}: researcher's change")
        return git(with_worktree, "rev-parse", "HEAD")
    finally:
        git(root, "worktree", "remove", "--force", str(with_worktree))


def open_lab(root: Path):
    from pipeline.lab import load_lab

    return load_lab(root)


def records(root: Path):
    from agent.records import Records
    from pipeline import experiment

    return Records(experiment.open_store(open_lab(root)))


def make_loop(root: Path, graph: Any = None, **opts: Any):
    """The real `Loop` in this process (smoke runs off unless asked for); its messages in `.said`;
    `graph`: the graph's maker, if not the product's (`Loop(..., graph=)`)."""
    from agent.loop import Loop, LoopOptions
    from pipeline.api import ExecutorOptions

    said: list[str] = []
    extra = {} if graph is None else {"graph": graph}
    loop = Loop(open_lab(root), LoopOptions(**{"smoke": False, "executor": ExecutorOptions(workers=2), **opts}),
                progress=said.append, **extra)
    loop.said = said  # type: ignore[attr-defined]
    return loop


def crash_in(loop: Any, h: Any, node: str, **store: Any) -> Any:
    """What a `kill -9` inside `node` leaves: the thread's checkpoint from before the node ran (the
    graph checkpoints after each node), and the store as the node had left it (`store` fields)."""
    config = {"configurable": {"thread_id": str(h.id)}}
    snap = next(s for s in loop.graph.get_state_history(config) if s.next == (node,))
    loop.graph.update_state(snap.config, None)
    return loop.records.update(h.id, **store) if store else loop.records.get(h.id)


def one_pass(loop: Any) -> Any:
    """Start the next hypothesis and run its graph once (to `measuring` or a rejection): no executor."""
    h = loop.next_hypothesis()
    loop.started += 1
    return loop.advance(h)


# ----------------------------------------------------------------------------- the CLI

class RunProcess:
    """`autoresearch run` as a real process, its output in files (a full pipe would block it)."""

    def __init__(self, root: Path, *args: str, env: dict[str, str] | None = None, tag: str = "run"):
        self.t0 = time.monotonic()
        self.root = root
        self.out_path = root.parent / f"{tag}.out"
        self.err_path = root.parent / f"{tag}.err"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "agent.cli", "--repo", str(root), "run", *args], cwd=REPO,
                env=env or cli_env(), stdout=out, stderr=err, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_until(self, what: str, predicate: Callable[[], Any], timeout: float = 120, poll: float = 0.05) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            assert self.alive(), f"run exited ({self.proc.returncode}) before {what}:\n{self.stderr()[-4000:]}"
            time.sleep(poll)
        raise AssertionError(f"timed out waiting for {what}:\n{self.stderr()[-4000:]}")

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        assert self.proc.returncode == -signal.SIGKILL

    def wait(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.cleanup()
            raise AssertionError(f"run did not finish in {timeout} s:\n{self.stderr()[-4000:]}") from None

    def cleanup(self) -> None:
        """Kill what is left of its session (a failed test must not leave a loop running)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(timeout=30)


def descendants(pid: int) -> list[Any]:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def smoke_running(pid: int) -> bool:
    """Whether `autoresearch run` (pid) has a smoke-run stage process going."""
    for p in descendants(pid):
        try:
            if any("smoke-" in part for part in p.cmdline()) or "smoke-" in p.cwd():
                return True
        except Exception:
            continue
    return False


# ----------------------------------------------------------------------------- a fake LLM that routes

def asked_name(body: dict[str, Any]) -> str:
    """The name of the object a request asks for: from response_format, the forced tool, or the
    JSON-in-text instruction (`prompts/json_only.md`)."""
    rf = body.get("response_format") or {}
    if rf.get("type") == "json_schema":
        return rf["json_schema"]["name"]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        return choice["function"]["name"]
    text = json.dumps(body.get("messages", []))
    m = re.findall(r"the `(\w+)`, and nothing else", text)
    return m[-1] if m else "text"


class RoutedOpenAI(FakeOpenAI):
    """The fake server answering each request from the queue of the object it asks for
    ("hypothesis", "edits", "decision", "summary"), so a test scripts each purpose on its own.

    A name with nothing queued gets its default, else a 400 (the client gives up at once instead of
    retrying a 500), and is listed in `unscripted`.
    """

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.queues: dict[str, deque[Step]] = defaultdict(deque)
        self.defaults: dict[str, Step] = {"summary": content(SUMMARY)}
        self.unscripted: list[str] = []

    def on(self, name: str, *steps: Step) -> "RoutedOpenAI":
        with self._lock:
            self.queues[name].extend(steps)
        return self

    def asked(self, name: str) -> list[dict[str, Any]]:
        """The requests that asked for `name`, in order."""
        with self._lock:
            return [b for b in self.requests if asked_name(b) == name]

    def _next_step(self, body: dict[str, Any]) -> Step:
        if "response_format" in body and not self.supports_response_format:
            return reject_response_format()
        if "tools" in body and not self.supports_tools:
            return reject_tools()
        name = asked_name(body)
        with self._lock:
            if self.queues[name]:
                return self.queues[name].popleft()
            if name in self.defaults:
                return self.defaults[name]
            self.unscripted.append(name)
        return error(400, f"routed fake: nothing scripted for {name!r}")


SUMMARY = {"tried": "The change described above.", "interpretation": "See the gate's table.", "follow_ups": []}


def proposal(title: str = "Raise the fine-tuning learning rate", change: str = "config.toml: finetune lr") -> dict:
    return {"title": title, "rationale": "The adapters' learning rate was never tuned.",
            "expected_effect": "+0.01 AUC on most tasks", "tasks_expected": list(TASKS), "change": change}


def edit(path: str, search: str | None = None, replace: str | None = None, content_: str | None = None) -> dict:
    return {"path": path, "search": search, "replace": replace, "content": content_}


def edits(*items: dict, notes: str = "") -> dict:
    return {"edits": list(items), "notes": notes}


LR_EDIT = edit("config.toml", "lr = 3e-4", "lr = 3e-3")  # the [finetune] learning rate


def decision(choice: str, rationale: str = "As the gate says.", follow_up: str = "") -> dict:
    return {"decision": choice, "rationale": rationale, "follow_up": follow_up}


def llm_env(server: FakeOpenAI) -> dict[str, str]:
    return {"OPENAI_BASE_URL": server.url, "OPENAI_API_KEY": DUMMY_KEY}


def user_texts(body: dict[str, Any]) -> str:
    return "\n".join(m.get("content") or "" for m in body.get("messages", []) if isinstance(m.get("content"), str))


# ----------------------------------------------------------------------------- store checks

def assert_runs_exactly_once(root: Path) -> dict[str, int]:
    """Every queued run finished, one result per (commit, task, seed); returns queue counts."""
    from sqlmodel import select

    from pipeline import experiment
    from pipeline.store import Result

    store = experiment.open_store(open_lab(root))
    runs = store.runs()
    keys = [(r.commit, r.task, r.seed) for r in runs]
    assert len(keys) == len(set(keys)), "a run was queued twice"
    with store.session() as s:
        results = list(s.exec(select(Result)))
    rkeys = [(r.commit, r.task, r.seed) for r in results]
    assert len(rkeys) == len(set(rkeys)), "a run has two results"
    return store.queue_counts()


# ----------------------------------------------------------------------------- the review page

class Server:
    """`autoresearch serve` as a real process on a free loopback port (no browser needed). Every
    server needs its token, loopback too: `wait()` reads it from the URL the server printed, and
    `get`/`cookie` carry it as the browser's cookie would after `tokened` was opened once."""

    def __init__(self, lab: Path, *args: str, env: dict[str, str] | None = None):
        self.port = free_port()
        self.log = lab.parent / f"serve-{self.port}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agent.cli", "--repo", str(lab), "serve", "--port", str(self.port), *args],
            cwd=REPO, env=env or cli_env(), stdout=subprocess.DEVNULL, stderr=open(self.log, "w"),
            start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = ""

    def wait(self) -> "Server":
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.url + "/", timeout=2)
                break
            except urllib.error.HTTPError:
                break  # it answers (403 without its token)
            except OSError:
                assert self.proc.poll() is None, self.log.read_text()
                assert time.monotonic() < deadline, self.log.read_text()
                time.sleep(0.2)
        printed = [ln for ln in self.log.read_text().splitlines() if "?token=" in ln]
        assert len(printed) == 1, self.log.read_text()  # the URL, once
        self.token = printed[0].split("?token=")[1].split()[0]
        return self

    @property
    def tokened(self) -> str:
        """The URL the server printed (what a person opens first)."""
        return f"{self.url}/?token={self.token}"

    @property
    def cookie(self) -> str:
        return f"ar_token_{self.port}={self.token}"

    def get(self, path: str, headers: dict[str, str] | None = None, timeout: float = 30):
        """GET `path` with the token's cookie (urllib raises HTTPError for 4xx/5xx)."""
        return urllib.request.urlopen(urllib.request.Request(self.url + path, headers={"Cookie": self.cookie,
                                                                                       **(headers or {})}),
                                      timeout=timeout)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
