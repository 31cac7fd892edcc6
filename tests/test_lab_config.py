"""research.toml: the template loads; every kind of mistake is one LabConfigError naming file and key."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.errors import LabConfigError, UserError
from pipeline.lab import load_lab, parse_config

pytestmark = pytest.mark.integration

TEMPLATE = Path(__file__).resolve().parent.parent / "pipeline" / "templates" / "transactions"
GOOD = (TEMPLATE / "research.toml").read_text()


@pytest.fixture
def lab(tmp_path):
    for f in TEMPLATE.iterdir():
        if f.is_file():
            shutil.copy(f, tmp_path / f.name)
    return tmp_path


def test_template_config_loads(lab):
    loaded = load_lab(lab)
    assert loaded.config.lab.editable == ["model.py", "train.py", "config.toml"]
    assert [s.name for s in loaded.stages_in_order()] == ["pretrain", "finetune"]
    assert loaded.config.gate.looks == (1, 2, 5, 10) and loaded.config.gate.protocol == "paired"
    assert len(loaded.tasks()) == 8


def edit(text, old, new):
    assert old in text, old
    return text.replace(old, new, 1)


CASES = [
    # (description, transform of the good text, expected key, words expected in the message)
    ("not toml", lambda t: t + "\n[[[", "", "not valid TOML"),
    ("unknown top-level key", lambda t: t + "\n[extra]\nx = 1\n", "extra", "unknown key"),
    ("unknown nested key", lambda t: edit(t, "cpus = 1", "cpus = 1\ncpu_count = 3"), "run.cpu_count", "unknown key"),
    ("wrong type", lambda t: edit(t, "alpha = 0.01 ", 'alpha = "small"'), "gate.alpha", "number"),
    ("out of range", lambda t: edit(t, "alpha = 0.01 ", "alpha = 0.9"), "gate.alpha", "less than 0.5"),
    ("bad looks", lambda t: edit(t, "looks = [1, 2, 5, 10]", "looks = [5, 2]"), "gate.looks", "increasing"),
    ("a two-sample look at 1 run", lambda t: edit(t, 'protocol = "paired"', 'protocol = "sequential"'), "gate",
     "first look at 2 runs or more"),
    ("a look past the baseline", lambda t: edit(t, "baseline_runs = 10", "baseline_runs = 5"), "gate",
     "needs as many baseline runs"),
    ("bad protocol", lambda t: edit(t, 'protocol = "paired"', 'protocol = "bayes"'), "gate.protocol", "sequential"),
    ("missing lab.name", lambda t: edit(t, 'name = "transactions"\n', ""), "lab.name", "required"),
    ("unknown needs", lambda t: edit(t, 'needs = ["pretrain"]', 'needs = ["pretrian"]'), "stage[1].needs", "unknown stage 'pretrian'"),
    ("cycle", lambda t: edit(t, 'scope = "seed"\n', 'scope = "run"\nneeds = ["finetune"]\n'), "stage.needs", "cycle"),
    ("unknown placeholder", lambda t: edit(t, "--out {out}\"\nscope = \"seed\"", "--out {output}\"\nscope = \"seed\""), "stage[0].run", "{output}"),
    ("task in seed stage", lambda t: edit(t, "pretrain --data {data}", "pretrain --task {task} --data {data}"), "stage[0].run", "seed-scoped"),
    ("duplicate stage", lambda t: edit(t, 'name = "finetune"', 'name = "pretrain"'), "stage[1].name", "duplicate"),
    ("unknown harness", lambda t: edit(t, 'harness = "transactions"', 'harness = "images"'), "benchmark.harness", "unknown harness 'images'"),
    ("unknown suite", lambda t: edit(t, 'suite = "small"', 'suite = "medium"'), "benchmark.suite", "unknown suite 'medium'"),
    ("unknown task", lambda t: edit(t, "data_seed = 0", 'data_seed = 0\ntasks = ["churn_60d", "weather"]'), "benchmark.tasks", "unknown task 'weather'"),
    ("bad search key", lambda t: edit(t, '"finetune.lr"', '"lr"'), "search_space", "section.key"),
    ("missing editable file", lambda t: edit(t, '"config.toml"]', '"config.toml", "extra.py"]'), "lab.editable", "'extra.py' matches no file"),
    ("escaping editable", lambda t: edit(t, '"config.toml"]', '"config.toml", "../x.py"]'), "lab.editable", "leaves the lab"),
    ("missing input", lambda t: edit(t, 'inputs = ["model.py", "train.py", "config.toml#data"', 'inputs = ["nope.py#data"'), "stage[0].inputs", "matches no file"),
]


@pytest.mark.parametrize("desc,transform,key,words", CASES, ids=[c[0] for c in CASES])
def test_config_errors_name_file_key_and_expectation(lab, desc, transform, key, words):
    (lab / "research.toml").write_text(transform(GOOD))
    with pytest.raises(LabConfigError) as info:
        load_lab(lab)
    err = info.value
    assert err.key == key
    assert words in str(err)
    assert str(err).startswith(str(lab / "research.toml"))
    assert "\n" not in str(err)


def test_missing_program_file(lab):
    (lab / "program.md").unlink()
    with pytest.raises(LabConfigError, match="lab.program"):
        load_lab(lab)


def test_not_a_lab(tmp_path):
    with pytest.raises(UserError):
        load_lab(tmp_path)


def test_parse_config_without_files_accepts_template():
    cfg = parse_config(GOOD)
    assert cfg.search_space["data.sources"][1] == ["card", "pix"]


def test_cli_reports_config_error_as_one_line_exit_2(lab):
    (lab / "research.toml").write_text(GOOD.replace("cpus = 1", "cpus = -1"))
    proc = subprocess.run([sys.executable, "-m", "agent.cli", "--repo", str(lab), "check"], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1
    assert re.search(r"research\.toml: run\.cpus: expected .*greater than or equal to 1", lines[0]), lines[0]
    assert "Traceback" not in proc.stderr


def test_cli_check_prints_the_lab_summary(lab):
    proc = subprocess.run([sys.executable, "-m", "agent.cli", "--repo", str(lab), "check", "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    import json

    out = json.loads(proc.stdout)
    assert out["harness"] == "transactions" and out["suite"] == "small"
    assert len(out["tasks"]) == 8 and out["stages"] == ["pretrain", "finetune"]


def test_alpha_and_futility_left_out_take_the_protocols_own() -> None:
    """Issue 34: the paired gate defaults to α 0.01 and futility 0.2 (fewer false discoveries and more
    gain per run, benchmarks/results/loop_quality_fdp.txt); the two-sample protocols keep 0.025 and
    0.3; a value the lab sets is kept whatever the protocol."""
    from pipeline.gate.inputs import GateConfig

    paired = GateConfig.model_validate({"protocol": "paired"})
    assert (paired.alpha, paired.futility_p, paired.looks) == (0.01, 0.2, (1, 2, 5, 10))
    for name in ("sequential", "fixed"):
        two = GateConfig.model_validate({"protocol": name})
        assert (two.alpha, two.futility_p, two.looks) == (0.025, 0.3, (2, 5, 10))
    own = GateConfig.model_validate({"protocol": "sequential", "alpha": 0.005, "futility_p": 0.5})
    assert (own.alpha, own.futility_p) == (0.005, 0.5)
    assert GateConfig.model_validate({}).alpha == 0.01  # the default protocol is paired
