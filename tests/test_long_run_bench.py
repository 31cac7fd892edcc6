"""benchmarks/long_run.py on a tiny scale: it builds a store as a busy lab leaves it (a real lab, its
git history, the tables as the loop writes them) and times every step through the product's own
functions, so it keeps working as those functions change (a benchmark that rots says nothing)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def test_the_long_run_benchmark_builds_a_store_and_times_every_step(tmp_path: Path) -> None:
    out = tmp_path / "long_run.txt"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "long_run.py"), "--days", "2",
                           "--runs-per-day", "80", "--repeat", "1", "--workdir", str(tmp_path / "work"),
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = out.read_text()
    for row in ("proposal: build_context", "loop: Guards.guard", "look: Experiment.histories (1st look)",
                "summary: pictures.write_progress", "status: status_of (store open)", "web: GET / (overview)",
                "digest --since 24h", "CLI: autoresearch status --json", "llm_call", "all tables"):
        line = next((x for x in table.splitlines() if x.startswith(row)), None)
        assert line is not None, f"{row!r} missing from\n{table}"
        cells = [c.split() for c in line.split("|")[1:] if c.strip()]
        assert cells and all(float(c[0]) >= 0 for c in cells), line  # ms, or rows (MB: above the start, ±)
        assert all(float(v) == float(v) for c in cells for v in c), line
