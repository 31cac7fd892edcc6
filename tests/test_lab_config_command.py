"""research.toml of a `harness = "command"` lab through the real CLI: every new key's mistake is one
line on stderr naming the file and the key, exit code 2, no traceback; `check` warns about editable
files no stage declares; `trust` shows and moves the tag `autoresearch/trusted`.

Every lab starts from `autoresearch init DIR --harness command` (a real git repo) and has its
research.toml edited per case; every command is `python -m agent.cli` as a subprocess.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from support.lab import cli, cli_json, git

pytestmark = pytest.mark.integration

TRUSTED_TAG = "autoresearch/trusted"


@pytest.fixture(scope="module")
def command_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("command") / "lab"
    out = cli(root, "init", str(root), "--harness", "command")
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == root.resolve()
    return root


@pytest.fixture
def lab(command_template: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "lab"
    shutil.copytree(command_template, dst, symlinks=True)
    return dst


def sub(text: str, pattern: str, new: str) -> str:
    """Replace the one line matching `pattern` (a regex over whole lines) with `new` ('' drops it)."""
    out, n = re.subn(rf"(?m)^{pattern}\n", new + ("\n" if new else ""), text)
    assert n == 1, pattern
    return out


def only(*keep: str):
    """Harness "transactions" with exactly the given ones of prepare/score/trusted (and no command tasks)."""
    def transform(t: str) -> str:
        t = sub(t, r'harness = "command".*', 'harness = "transactions"')
        t = sub(t, r"tasks = .*", "")
        for key in ("prepare", "score", "trusted"):
            if key not in keep:
                t = sub(t, rf"{key} = .*", "")
        return t
    return transform


CASES = [
    # (id, transform of the template's research.toml, the key named, words the line must hold)
    ("tasks missing", lambda t: sub(t, r"tasks = .*", ""), "benchmark.tasks", "missing; expected the list"),
    ("tasks empty", lambda t: sub(t, r"tasks = .*", "tasks = []"), "benchmark.tasks", "empty; expected the list of task names"),
    ("prepare missing", lambda t: sub(t, r"prepare = .*", ""), "benchmark.prepare", "missing"),
    ("prepare without sealed",
     lambda t: sub(t, r"prepare = .*", 'prepare = "python prepare.py --seed {data_seed} --out {data}"'),
     "benchmark.prepare", "{sealed}"),
    ("score missing", lambda t: sub(t, r"score = .*", ""), "benchmark.score", "missing"),
    ("score without predictions",
     lambda t: sub(t, r"score = .*", 'score = "python score.py --task {task} --sealed {sealed}"'),
     "benchmark.score", "{predictions}"),
    ("score unknown placeholder",
     lambda t: sub(t, r"score = .*",
                   'score = "python score.py --task {task} --predictions {predictions} --sealed {sealed} --y {label}"'),
     "benchmark.score", "unknown placeholder {label}"),
    ("trusted missing", lambda t: sub(t, r"trusted = .*", ""), "benchmark.trusted", "missing"),
    ("trusted glob matches nothing",
     lambda t: sub(t, r"trusted = .*", 'trusted = ["prepare.py", "score.py", "data/**"]'),
     "benchmark.trusted", "'data/**' matches no file"),
    ("trusted and editable",
     lambda t: sub(t, r"editable = .*", 'editable = ["train.py", "config.toml", "score.py"]'),
     "benchmark.trusted", "score.py is both trusted and editable"),
    ("trusted and editable by glob",
     lambda t: sub(t, r"editable = .*", 'editable = ["*.py", "config.toml"]'),
     "benchmark.trusted", "is both trusted and editable"),
    ("prepare with transactions", only("prepare"), "benchmark.prepare", 'only for harness = "command"'),
    ("score with transactions", only("score"), "benchmark.score", 'only for harness = "command"'),
    ("trusted with transactions", only("trusted"), "benchmark.trusted", 'only for harness = "command"'),
    ("sandbox maybe", lambda t: sub(t, r'sandbox = "auto"', 'sandbox = "maybe"'), "run.sandbox", "'maybe'"),
    ("network yes", lambda t: sub(t, r"network = false", 'network = "yes"'), "run.network", "bool"),
    ("implausible fraction 2",
     lambda t: sub(t, r'protocol = "paired"', 'protocol = "paired"\nimplausible_fraction = 2'),
     "gate.implausible_fraction", "less than or equal to 1"),
    ("higher_is_better string", lambda t: sub(t, r"higher_is_better = false", 'higher_is_better = "no"'),
     "benchmark.higher_is_better", "bool"),
    ("unknown benchmark key", lambda t: sub(t, r"data_seed = 0", "data_seed = 0\nsplits = 3"),
     "benchmark.splits", "unknown key; expected one of harness, suite, metric, higher_is_better, perfect, "
                         "data_seed, tasks, customers, trusted, prepare, score"),
]


@pytest.mark.parametrize("transform,key,words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_check_says_one_line_naming_file_and_key(lab: Path, transform, key: str, words: str) -> None:
    path = lab.resolve() / "research.toml"
    path.write_text(transform(path.read_text()))
    out = cli(lab, "check")
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr
    assert lines[0].startswith(f"error: {path}: {key}: "), lines[0]
    assert words in lines[0], lines[0]


def test_template_checks_clean(lab: Path) -> None:
    out = cli(lab, "check")
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    summary = cli_json(lab, "check", "--json")
    assert summary["harness"] == "command"
    assert summary["tasks"] == ["default", "churn", "fraud"]
    assert summary["trusted"] == ["prepare.py", "score.py"]
    assert summary["undeclared"] == [] and summary["sandbox"] == "on"


def test_check_warns_about_an_editable_file_no_stage_reads(lab: Path) -> None:
    path = lab / "research.toml"
    path.write_text(sub(path.read_text(), r'inputs = \["train.py", "config.toml"\].*', 'inputs = ["train.py"]'))
    out = cli(lab, "check")
    assert out.returncode == 0, out.stderr
    warnings = [ln for ln in out.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: config.toml is editable but no stage lists it")
    assert re.search(r"(?m)^undeclared +config\.toml$", out.stdout), out.stdout

    js = cli(lab, "check", "--json")
    assert js.returncode == 0, js.stderr
    summary = json.loads(js.stdout)  # the warning stays on stderr: stdout is the JSON alone
    assert summary["undeclared"] == ["config.toml"]
    assert "warning: config.toml is editable" in js.stderr


@pytest.mark.slow
def test_trust_shows_nothing_before_a_run_then_moves_the_tag(lab: Path) -> None:
    first = git(lab, "rev-parse", "HEAD")
    before = cli(lab, "trust")
    assert before.returncode == 2 and before.stdout == ""
    assert before.stderr.splitlines() == [before.stderr.strip()] and "Traceback" not in before.stderr
    assert before.stderr.startswith("error: no trusted commit yet") and TRUSTED_TAG in before.stderr
    assert git(lab, "tag", "--list", TRUSTED_TAG) == ""  # showing never creates it

    (lab / "score.py").write_text((lab / "score.py").read_text() + "# clip probabilities at 1e-6\n")
    git(lab, "commit", "-qam", "score.py: a note")
    second = git(lab, "rev-parse", "HEAD")
    moved = cli(lab, "trust", "HEAD")
    assert moved.returncode == 0, moved.stderr
    assert moved.stdout.strip() == f"{TRUSTED_TAG} = {second[:12]} score.py: a note"
    assert "moved:" in moved.stderr
    assert git(lab, "rev-parse", f"{TRUSTED_TAG}^{{commit}}") == second

    shown = cli_json(lab, "trust", "--json")
    assert shown == {"tag": TRUSTED_TAG, "commit": second, "subject": "score.py: a note",
                     "trusted": ["prepare.py", "score.py"], "moved": False}
    assert cli(lab, "trust").stdout.strip() == f"{TRUSTED_TAG} = {second[:12]} score.py: a note"

    back = cli_json(lab, "trust", first, "--json")
    assert back["moved"] is True and back["commit"] == first
    assert git(lab, "rev-parse", f"{TRUSTED_TAG}^{{commit}}") == first

    bad = cli(lab, "trust", "no-such-rev")
    assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1 and "'no-such-rev' is not a commit" in bad.stderr
    assert git(lab, "rev-parse", f"{TRUSTED_TAG}^{{commit}}") == first


@pytest.mark.slow
def test_trust_on_a_transactions_lab_is_bad_input(tmp_path: Path) -> None:
    root = tmp_path / "tx"
    made = cli(root, "init", str(root))
    assert made.returncode == 0, made.stderr
    out = cli(root, "trust")
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.splitlines()) == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith("error: harness 'transactions' has no trusted files")
    assert cli(root, "trust", "HEAD").returncode == 2
    assert git(root, "tag", "--list", TRUSTED_TAG) == ""
