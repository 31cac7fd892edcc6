"""An LLM outage is infrastructure, not a verdict on an idea.

A proposal the endpoint could not give (connection refused, 5xx or timeouts through every attempt)
creates no hypothesis and no rejection: the loop withdraws the empty one, backs off, and proposes
again when the endpoint answers, while human seeds go on meanwhile. `status` says since when the
endpoint is unreachable; a bounded `run` with nothing else to do stops with one line and exit 1.
Everything here is real: the loop, the store, the openai SDK over HTTP to a local server (or to a
port where nothing listens).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from support.lab import (
    free_port,
    DUMMY_KEY,
    LR_EDIT,
    RoutedOpenAI,
    cli,
    cli_env,
    edit,
    edits,
    make_loop,
    proposal,
    set_research,
)
from support.fake_openai import content, server_error

pytestmark = pytest.mark.system

FAST_RETRIES = ("model = \"gpt-4.1-mini\"", "model = \"gpt-4.1-mini\"\nrequest_attempts = 2\nrequest_timeout_s = 5")




def wait_for(cond, timeout: float = 240.0, what: str = "") -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_endpoint_refusing_connections_creates_nothing_and_run_says_so_in_one_line(lab: Path) -> None:
    set_research(lab, *FAST_RETRIES)
    env = cli_env(OPENAI_BASE_URL=f"http://127.0.0.1:{free_port()}/v1", OPENAI_API_KEY=DUMMY_KEY)
    proc = cli(lab, "run", "--max-hypotheses", "2", env=env, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "stopping: the LLM endpoint is unreachable" in proc.stderr
    st = json.loads(cli(lab, "status", "--json", env=env).stdout)
    assert st["hypotheses"] == [] and st["rejected"] == {}  # no "(no proposal)", nothing to review
    assert st["llm"]["unreachable_since"] is not None
    assert any(e["kind"] == "llm_down" for e in st["events"])
    assert "LLM unreachable since" in cli(lab, "status", env=env).stdout


def test_an_outage_creates_no_hypothesis_seeds_go_on_and_proposals_resume(lab: Path, llm: RoutedOpenAI,
                                                                         monkeypatch) -> None:
    from agent.loop import guards as loop_mod
    from agent.commands import seed

    monkeypatch.setattr(loop_mod, "LLM_BACKOFF_S", (0.2, 1.0))
    set_research(lab, *FAST_RETRIES)
    set_research(lab, "max_in_flight = 1", "max_in_flight = 2")
    # a researcher's seed that needs no LLM to implement
    spec = lab.parent / "seed.json"
    spec.write_text(json.dumps({"title": "Fine-tune with lr 3e-3", "rationale": "planted",
                                "edits": [{k: v for k, v in LR_EDIT.items() if v is not None}]}))
    seed(lab, None, None, None, 10, None, spec)
    llm.defaults["hypothesis"] = server_error(503)  # the endpoint is down for proposals

    loop = make_loop(lab, forever=True, idle_poll_s=0.2)
    runner = threading.Thread(target=loop.run, daemon=True)
    runner.start()
    try:
        wait_for(lambda: len(llm.asked("hypothesis")) >= 4, what="two failed proposals")
        wait_for(lambda: loop.records.get(1).status not in ("queued", "implementing"), what="the seed measured")
        # the seed only: no hypothesis from the outage (the next proposal's slot may already exist,
        # empty, waiting for the endpoint: whether it does depends on how fast the seed got measured)
        others = [h for h in loop.records.all() if h.id != 1]
        assert all(h.status == "proposing" and not h.title and h.commit is None for h in others), others
        assert len(others) <= 1
        assert loop.records.get(1).commit is not None
        assert any(e.kind == "llm_down" for e in loop.records.events(50))

        # the endpoint answers again
        llm.on("edits", content(edits(edit("config.toml", "lr = 3e-4", "lr = 1e-3"))))
        llm.on("hypothesis", content(proposal("Raise the learning rate a little")))
        del llm.defaults["hypothesis"]
        wait_for(lambda: any(h.title == "Raise the learning rate a little" for h in loop.records.all()),
                 what="a proposal after the outage")
        wait_for(lambda: any(e.kind == "llm_up" for e in loop.records.events(50)), what="the llm_up event")
    finally:
        loop.stop.set()
        runner.join(timeout=300)
        loop.close()
    hyps = loop.records.all()
    assert [h.id for h in hyps] == [1, 2]
    assert not any(h.decision == "reject" for h in hyps)
    assert [h.origin for h in hyps] == ["human", "llm"]
