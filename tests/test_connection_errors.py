"""A service that does not answer is one line and exit code 1, never a traceback: the store's
PostgreSQL, a Ray cluster at a wrong address (Ray itself would retry for minutes). The LLM
endpoint's case is in test_llm_outage.py. Real processes, real sockets."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from support.lab import cli, free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]




def one_line_exit_1(proc, *expected: str) -> str:
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    for e in expected:
        assert e in lines[0], lines[0]
    return lines[0]


def test_an_unreachable_postgresql_store_is_one_line(lab: Path) -> None:
    url = f"postgresql+psycopg://postgres:hunter2@127.0.0.1:{free_port()}/test"
    for args in (("status",), ("run", "--offline", "--max-hypotheses", "1")):
        line = one_line_exit_1(cli(lab, "--db", url, *args), "cannot reach the store", "127.0.0.1")
        assert "hunter2" not in line  # a password in the URL is never printed


def test_a_wrong_ray_address_is_one_line_at_once(lab: Path) -> None:
    t0 = time.monotonic()
    proc = cli(lab, "run", "--offline", "--max-hypotheses", "1", "--executor", "ray",
               "--ray-address", f"127.0.0.1:{free_port()}")
    one_line_exit_1(proc, "cannot connect to Ray at 127.0.0.1:")
    assert time.monotonic() - t0 < 60  # not Ray's minutes of retries
    proc = cli(lab, "run", "--offline", "--max-hypotheses", "1", "--executor", "ray", "--ray-address", "nonsense")
    one_line_exit_1(proc, "expected host:port")
