"""benchmarks/loop_quality.py on a small population: it runs the real gate and ranks the rules sanely."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_loop_quality_small_population(tmp_path):
    out = tmp_path / "lq.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "loop_quality.py"), "--campaigns", "60", "--hypotheses", "40",
         "--rho", "0.02", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode in (0, 1), done.stderr
    doc = json.loads(out.read_text())
    rules = {r["rule"]: r for r in doc["rules"]}
    assert set(rules) == {"sequential", "sequential-v1", "fixed-5v2", "fixed-10", "keep-discard"}
    seq, kd, f10 = rules["sequential"], rules["keep-discard"], rules["fixed-10"]
    # a null is promoted by one noisy run far more often than by the gate
    assert kd["promoted"]["null"] > 5 * max(seq["promoted"]["null"], 0.01)
    assert seq["promoted"]["horizontal@3"] > 0.95 and seq["promoted"]["harm"] < 0.02
    # the sequential gate stops nulls early: far fewer runs than a fixed 10
    assert seq["challenger_runs_per_null"] < 0.5 * f10["challenger_runs_per_null"] == 5.0
    assert kd["challenger_runs_per_hypothesis"] == 1.0
    assert seq["drift"]["true"] > 0
