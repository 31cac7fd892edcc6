"""The smoke run's data and what flows back from it (issue 36, item 3).

The smoke dataset shares no customer, trait or id with the data runs are scored on (each harness's
real `prepare`, both ways), and a smoke stage that prints the data it read, and the data and sealed
folders, hands the LLM's repair prompt none of it: the real loop, the real smoke run in its sandbox,
the LLM policy over HTTP to the fake OpenAI server, the prompt read as the server received it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from support.fake_openai import content
from support.lab import LR_EDIT, RoutedOpenAI, edit, edits, make_loop, one_pass, open_lab, proposal

pytestmark = pytest.mark.integration


def rows(prepared) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(every id, the sealed test ids, the tabular rows) of a prepared transactions dataset."""
    with np.load(prepared.public / "customers.npz") as c, np.load(prepared.sealed / "test_labels.npz") as s:
        return c["id"], s["ids"], c["tabular"]


def shared_rows(a: np.ndarray, b: np.ndarray) -> set[bytes]:
    """The rows of `a` that are also rows of `b`, bit for bit."""
    return {r.tobytes() for r in a} & {r.tobytes() for r in b}


def test_the_smoke_customers_share_no_id_row_or_trait_with_the_real_ones(tmp_path: Path) -> None:
    from pipeline.harness import get_harness
    from pipeline.harness.transactions import data as gen

    harness = get_harness("transactions")
    real = harness.prepare(tmp_path, "small", 0, 300)
    smoke = harness.prepare(tmp_path, "small", 0, 300, smoke=True)
    assert smoke.public != real.public and smoke.sealed != real.sealed
    assert json.loads((smoke.public / "meta.json").read_text())["smoke"] is True
    real_ids, real_test, real_tab = rows(real)
    smoke_ids, smoke_test, smoke_tab = rows(smoke)
    assert not set(smoke_ids) & set(real_ids) and not set(smoke_ids) & set(real_test)
    assert min(smoke_ids) > max(rows(harness.prepare(tmp_path, "small", 0, 3000))[0])  # nor a bigger real set's
    assert not shared_rows(smoke_tab, real_tab)
    for n in (300, 3000):  # the latent traits: the old smoke data's were the real data's first 300 rows
        smoke_traits, real_traits = gen.generate("small", 0, 300, smoke=True).traits, gen.generate("small", 0, n).traits
        assert not shared_rows(smoke_traits, real_traits)
        assert len(shared_rows(gen.generate("small", 0, 300).traits, real_traits)) == 300  # what it was
    assert np.array_equal(rows(harness.prepare(tmp_path, "small", 0, 300, smoke=True))[0], smoke_ids)  # deterministic


def test_the_sim_and_command_harnesses_prepare_a_smoke_dataset_of_their_own(tmp_path: Path) -> None:
    from agent.labinit import init_lab
    from pipeline.errors import LabConfigError
    from pipeline.harness import get_harness
    from pipeline.harness.base import SMOKE_SEED_BASE
    from pipeline.lab import load_lab

    sim = get_harness("sim")
    assert json.loads((sim.prepare(tmp_path, "sim", 0, 300).public / "sim.json").read_text())["smoke"] is False
    assert json.loads((sim.prepare(tmp_path, "sim", 0, smoke=True).public / "sim.json").read_text())["smoke"] is True

    lab = load_lab(init_lab(tmp_path / "own", harness="command"))  # the template's own prepare.py, sandboxed
    b, harness = lab.config.benchmark, lab.harness()
    real = harness.prepare(lab.state, b.suite, b.data_seed)
    smoke = harness.prepare(lab.state, b.suite, b.data_seed, smoke=True)
    assert json.loads((smoke.public / ".prepared").read_text())["data_seed"] == SMOKE_SEED_BASE + b.data_seed
    assert smoke.public != real.public and smoke.sealed != real.sealed
    with np.load(real.public / "train.npz") as r, np.load(smoke.public / "train.npz") as s:
        assert not shared_rows(s["x"], r["x"])
        assert len(s["x"]) < len(r["x"]) / 2  # `{smoke}`: the template's prepare makes it small
    with np.load(real.public / "test.npz") as r, np.load(smoke.public / "test.npz") as s:
        assert not set(r["id"].tolist()) & set(s["id"].tolist())  # the template gives smoke ids of their own
    research = lab.root / "research.toml"
    research.write_text(research.read_text().replace("data_seed = 0", f"data_seed = {SMOKE_SEED_BASE}", 1))
    with pytest.raises(LabConfigError, match="benchmark.data_seed.*smoke"):
        load_lab(lab.root)


def test_for_llm_keeps_the_traceback_and_masks_values_within_its_bound() -> None:
    from pipeline.smoke import FEEDBACK_BYTES, MASK, for_llm

    text = ("stage pretrain exited with 1:\n" + "x = 0.1234567\n" * 400 + "Traceback (most recent call last):\n"
            '  File "/lab/runs/smoke-1a2b/views/pretrain/train.py", line 1042, in <module>\n'
            "/lab/runs/smoke-1a2b/views/pretrain/train.py:17: UserWarning: id 1000000123, 1,234,567 at 0x7f3a\n"
            "ValueError: row [ 0.25 -1.5e-05 3. ] of shape (300, 16) in /lab/runs/data/d-smoke/customers.npz")
    out = for_llm(text, {"/lab/runs/smoke-1a2b/views/pretrain": "", "/lab/runs/data/d-smoke": "{data}"})
    assert len(out.encode()) <= FEEDBACK_BYTES and out.startswith("stage pretrain exited with 1:\n")
    assert 'File "train.py", line 1042, in <module>' in out and "train.py:17: UserWarning" in out
    assert f"ValueError: row [ {MASK} -{MASK} {MASK} ] of shape (300, 16) in {{data}}/customers.npz" in out
    for value in ("1234567", "1000000123", "234,567", "0x7f3a", "0.25", "/lab/runs"):
        assert value not in out, value
    cut = for_llm("stage a exited with 1:\n" + "9" * 5000 + " 7.5 12 end", {})
    assert cut == f"stage a exited with 1:\n…{MASK} 12 end"  # one long line: its end, from a word's start


CRASH_AT, WARN_AT = 9, 8  # the lines of the edit below that raise and warn
CRASH = """\
import json, sys, numpy as np
data = sys.argv[sys.argv.index("--data") + 1]
c = np.load(data + "/customers.npz")
row = [float(v) for v in c["tabular"][0]]
print("row", c["id"][0], row, file=sys.stderr)
print("dataset", json.load(open(data + "/meta.json"))["dataset_id"], file=sys.stderr)
print("paths", data, data.replace("/data/", "/sealed/") + "/test_labels.npz", file=sys.stderr)
import warnings; warnings.warn(f"first id {c['id'][0]}")
raise ValueError(f"bad row {row} of customer {c['id'][0]}")
import argparse
"""


@pytest.mark.system
def test_a_failing_smoke_stage_hands_the_repair_prompt_no_value_it_read(lab: Path, llm: RoutedOpenAI) -> None:
    assert CRASH.splitlines()[CRASH_AT - 1].startswith("raise ValueError")
    at = (lab / "train.py").read_text().splitlines().index("import argparse")  # where the edit goes in
    llm.on("hypothesis", content(proposal()))
    llm.on("edits", content(edits(LR_EDIT, edit("train.py", "import argparse\n", CRASH))), content(edits(LR_EDIT)))
    loop = make_loop(lab, smoke=True)
    try:
        h = one_pass(loop)
    finally:
        loop.close()
    assert h.status == "measuring", h.reject_reason
    repair = llm.asked("edits")[1]
    prompt = repair["messages"][-1]["content"]  # the repair prompt, as the endpoint received it
    sent = json.dumps(repair)  # and everything else of that request
    assert "rejected at the smoke check" in prompt

    the_lab = open_lab(lab)
    b = the_lab.config.benchmark
    smoke = the_lab.harness().prepare(the_lab.state, b.suite, b.data_seed, 300, smoke=True)
    with np.load(smoke.public / "customers.npz") as c:
        first_id, first_row = int(c["id"][0]), [float(v) for v in c["tabular"][0]]
    assert "small-smoke-d0-n300" in prompt  # the stage read the smoke dataset (its id, numbers masked)
    assert "row <n> [<n>," in prompt or "row <n> [-<n>," in prompt
    for value in [str(first_id), *(repr(v) for v in first_row), str(smoke.public), str(smoke.sealed),
                  str(the_lab.state)]:
        assert value not in sent, value
    for value in (f"{abs(v):.3f}" for v in first_row):  # nor a shorter form of a value
        assert value not in prompt, value
    assert "paths {data} {sealed}/test_labels.npz" in prompt  # the folders as placeholders
    # what a repair needs: the exception, its message's shape, the branch's file and line
    assert "ValueError: bad row [" in prompt and "] of customer <n>" in prompt
    assert f'File "train.py", line {at + CRASH_AT}, in <module>' in prompt
    assert f"train.py:{at + WARN_AT}: UserWarning: first id <n>" in prompt
