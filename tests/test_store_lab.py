"""A store holds one lab's state: a database given to a second lab is refused in one line, on SQLite
and on PostgreSQL, through the API and the CLI; a clone of the lab (another machine, another folder)
is the same lab."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from support import cli
from agent.labinit import init_lab
from pipeline import experiment
from pipeline.errors import UserError
from pipeline.lab import load_lab
from test_exec_store import db  # noqa: F401  (SQLite and PostgreSQL, a private schema each)

pytestmark = pytest.mark.integration


def test_a_store_is_refused_to_a_second_lab_and_kept_for_a_clone_of_the_first(db, tmp_path: Path) -> None:  # noqa: F811
    url, schema = db
    first = load_lab(init_lab(tmp_path / "first", harness="command"))
    other = load_lab(init_lab(tmp_path / "other", harness="command"))  # the same template, the same second
    if schema is not None:  # the private schema goes in the URL's options, as a user would give it
        url = f"{url}?options=-csearch_path%3D{schema}"
    store = experiment.open_store(first, url)
    store.dispose()
    with pytest.raises(UserError, match="holds the state of another lab .'first'"):
        experiment.open_store(other, url)
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(first.root), str(clone)], check=True)
    experiment.open_store(load_lab(clone), url).dispose()  # the same lab, elsewhere
    subprocess.run(["git", "-C", str(clone), "commit", "-q", "--allow-empty", "-m", "more"], check=True)
    experiment.open_store(load_lab(clone), url).dispose()  # and after more commits
    shallow = tmp_path / "shallow"  # a CI checkout: its first commit is where it was cut, so it is not checked
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{clone}", str(shallow)], check=True)
    experiment.open_store(load_lab(shallow), url).dispose()
    out = cli(other.root, "--db", url, "status")
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "holds the state of another lab" in lines[0] and "Traceback" not in out.stderr
