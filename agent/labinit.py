"""`autoresearch init`: a new lab from the bundled template, as a git repo with a baseline branch."""

from __future__ import annotations

import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Mapping

import git

from agent.config import open_lab
from pipeline.api import BASELINE_BRANCH, CONFIG_NAME, UserError, parse_config

TEMPLATES = Path(__file__).resolve().parent.parent / "pipeline" / "templates"
AUTHOR = ("autoresearch", "autoresearch@localhost")


def template_dir(harness: str = "transactions") -> Path:
    return TEMPLATES / harness


def default_suite(suites: Mapping[str, Any] | None) -> str:
    """The suite `init` uses when none is named, from the harness's suites (`harness_suites`):
    `small`, or the harness's only one (`sim`'s `sim`)."""
    return "small" if not suites or "small" in suites else sorted(suites)[0]


def with_gpus(config: str, gpus: float) -> str:
    """research.toml's text with `[run] gpus = <gpus>`: its line replaced, or added under `[run]`."""
    line = f"gpus = {gpus:g}"
    if re.search(r"(?m)^gpus\s*=", config):
        return re.sub(r"(?m)^gpus\s*=.*$", line, config, count=1)
    if re.search(r"(?m)^\[run\]\s*$", config):
        return re.sub(r"(?m)^\[run\]\s*$", f"[run]\n{line}", config, count=1)
    return config.rstrip("\n") + f"\n\n[run]\n{line}\n"


def init_lab(directory: str | Path, suite: str | None = None, force: bool = False,
             harness: str = "transactions", gpus: float | None = None) -> Path:
    """Copy the template, commit it, and point `autoresearch/baseline` at that commit; `gpus`: each
    stage's `[run] gpus` (a share of one GPU such as 0.25, or whole GPUs), else the template's.

    The working tree stays on `main`: the loop measures commits in worktrees of its own, and
    promotions move the baseline branch without touching what a researcher has checked out.
    """

    from pipeline.api import harness_suites

    root = Path(directory).resolve()
    suites = harness_suites(harness)
    if suites is None or not template_dir(harness).is_dir():
        known = sorted(p.name for p in TEMPLATES.iterdir() if p.is_dir() and harness_suites(p.name) is not None)
        raise UserError(f"no template for harness {harness!r}; expected one of {known}")
    suite = default_suite(suites) if suite is None else suite
    if suites and suite not in suites:
        raise UserError(f"unknown suite {suite!r}; expected one of {sorted(suites)}")
    src = template_dir(harness)
    config_text = re.sub(r'(?m)^suite = "\w+"', f'suite = "{suite}"', (src / CONFIG_NAME).read_text())
    if gpus is not None:
        config_text = with_gpus(config_text, gpus)
        parse_config(config_text, root / CONFIG_NAME)  # a bad --gpus is one line, before anything is written
    if root.exists() and not root.is_dir():
        raise UserError(f"{root} exists and is not a directory")
    if root.exists() and any(root.iterdir()) and not force:
        raise UserError(f"{root} is not empty; pass --force to create the lab there anyway")
    root.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.name in {"__pycache__"} or item.suffix == ".pyc":
            continue
        target = root / (".gitignore" if item.name == "gitignore" else item.name)
        shutil.copy2(item, target)
    (root / CONFIG_NAME).write_text(config_text)
    open_lab(root)  # the template must itself satisfy the contract

    repo = git.Repo.init(root, initial_branch="main") if not (root / ".git").exists() else git.Repo(root)
    with repo.config_writer() as cw:
        if not repo.config_reader().has_option("user", "name"):
            cw.set_value("user", "name", AUTHOR[0])
            cw.set_value("user", "email", AUTHOR[1])
    repo.git.add(A=True)
    # the lab's id makes its first commit its own: a store knows its lab by it (`Store.claim_lab`),
    # and two labs made from one template in the same second would otherwise share it
    repo.index.commit(f"Lab from the {harness} template (suite {suite})\n\nlab-id: {uuid.uuid4()}")
    if BASELINE_BRANCH in repo.heads:
        repo.heads[BASELINE_BRANCH].commit = repo.head.commit
    else:
        repo.create_head(BASELINE_BRANCH, repo.head.commit)
    (root / "runs").mkdir(exist_ok=True)
    return root
