"""Stage DAG and content-addressed cache: how one run expands into stages, and which it can skip.

A run (commit, task, seed) expands into the stages of `research.toml`, in dependency order. Each
stage instance gets a cache key: a hash of

- the stage definition (name, command, scope, needs, inputs patterns),
- the content of its `inputs` at that commit, read from git blobs (never from a working
  directory a stage could have written to),
- its scope values (seed for `scope = "seed"`; task and seed for `scope = "run"`),
- the keys of the stages it needs, and the dataset id.

Two runs whose stages hash alike share the output: every task of a seed reuses one pretraining,
and a challenger that changes only fine-tuning code reuses the baseline's pretraining. An input may
name one table of a TOML file, `config.toml#finetune`, so that editing one section of a shared
config does not invalidate stages that never read it; such a stage sees that table alone, as a
TOML file holding just it, so it cannot read what its key does not cover.

Outputs live in `runs/cache/<key>/`: a stage writes into a private temporary folder, published by
one atomic rename, so a reader never sees half an output and a killed stage leaves no entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.errors import UserError
from pipeline.lab import PLACEHOLDER, StageSpec, check_stage_graph, glob_match
from pipeline.tomlview import toml_tables

if TYPE_CHECKING:
    from pipeline.worktrees import Worktrees

KEY_VERSION = "autoresearch-stage-v4"  # v2: stages see only their declared inputs, in a sandbox;
# v3: a stage that names a TOML file by tables sees only those tables (v2 outputs saw the whole file);
# v4: the measurement environment (`pipeline.environment`) is part of the key



@dataclass(frozen=True)
class StageNode:
    """One stage of one run, with its cache key and the keys of the stages it needs."""

    spec: StageSpec
    key: str
    upstream: Mapping[str, str] = field(default_factory=dict)  # stage name → key

    @property
    def name(self) -> str:
        return self.spec.name


InputDigest = Callable[[str, list[str]], dict[str, str]]
"""(commit, patterns) → {input name: content digest}, as `input_digests` computes it."""


def input_digests(worktrees: "Worktrees", commit: str, patterns: list[str]) -> dict[str, str]:
    """Content digests of a stage's inputs at a commit.

    Plain globs map to git blob ids (already a hash of the content). `file.toml#table` maps to the
    hash of that table as the stage sees it (`pipeline.tomlview.toml_tables`: the table alone, written
    from its values), so edits elsewhere in the file do not count, and the stage reads nothing else
    of the file (`Lab.stage_sees`).
    """
    out: dict[str, str] = {}
    plain = [p for p in patterns if "#" not in p]
    for path, blob in worktrees.match(commit, plain).items():
        out[path] = blob.hexsha
    for p in patterns:
        if "#" not in p:
            continue
        path, _, table = p.partition("#")
        try:
            data = worktrees.read(commit, path)
        except FileNotFoundError:
            out[p] = "missing"
            continue
        # an unparsable file is seen, and keyed, whole: the stage will fail on it anyway
        out[p] = hashlib.sha256(toml_tables(data, [table])).hexdigest()
    for p in patterns:  # a pattern that matches nothing is part of the key too
        if "#" not in p and not any(glob_match(name, p) for name in out):
            out[f"{p} (no match)"] = "missing"
    return dict(sorted(out.items()))


def cache_key(spec: StageSpec, inputs: Mapping[str, str], scope: Mapping[str, object],
              upstream: Mapping[str, str], dataset_id: str, isolation: str = "sandbox", environment: str = "") -> str:
    """The content address of a stage output (sha256 hex).

    `isolation` is "sandbox" or "unsandboxed": an output made where the stage could read anything
    never serves a sandboxed lab. `environment` is the measurement environment's id
    (`Environment.id`: the software, and a GPU lab's GPU models): an output made with another torch
    or on another GPU model never serves this one, and a failure recorded under it is not this one's.
    """
    doc = {
        "isolation": isolation,
        "environment": environment,
        "v": KEY_VERSION,
        "stage": {"name": spec.name, "run": spec.run, "scope": spec.scope,
                  "needs": sorted(spec.needs), "inputs": list(spec.inputs)},
        "inputs": dict(sorted(inputs.items())),
        "scope": {k: scope[k] for k in sorted(scope)},
        "upstream": dict(sorted(upstream.items())),
        "dataset": dataset_id,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def plan_run(stages: list[StageSpec], commit: str, task: str, seed: int, dataset_id: str,
             digests: InputDigest, isolation: str = "sandbox", environment: str = "") -> list[StageNode]:
    """The run's stages in dependency order, each with its cache key."""
    order = check_stage_graph(list(stages))
    keys: dict[str, str] = {}
    nodes: list[StageNode] = []
    for spec in order:
        scope: dict[str, object] = {"seed": seed} if spec.scope == "seed" else {"task": task, "seed": seed}
        upstream = {n: keys[n] for n in spec.needs}
        key = cache_key(spec, digests(commit, list(spec.inputs)), scope, upstream, dataset_id, isolation, environment)
        keys[spec.name] = key
        nodes.append(StageNode(spec, key, upstream))
    return nodes


def render(command: str, values: Mapping[str, str]) -> list[str]:
    """Split a stage command like a shell would, then fill placeholders token by token.

    Filling after splitting means a path with spaces stays one argument; nothing is ever passed
    through a shell.
    """
    try:
        tokens = shlex.split(command)
    except ValueError as e:
        raise UserError(f"stage command {command!r}: {e}") from None

    def fill(token: str) -> str:
        def sub(m: re.Match[str]) -> str:
            name = m.group(1)
            if name not in values:
                raise UserError(f"stage command {command!r}: no value for {{{name}}}")
            return values[name]

        return PLACEHOLDER.sub(sub, token)

    return [fill(t) for t in tokens]


def check_not_sealed(argv: list[str], cwd: Path, sealed_roots: list[Path]) -> None:
    """Refuse any argument that resolves into a sealed folder (alone or after `--opt=`)."""
    roots = [Path(os.path.realpath(r)) for r in sealed_roots]
    for arg in argv:
        for candidate in {arg, arg.split("=", 1)[-1]}:
            if not candidate or "\x00" in candidate:
                continue
            p = Path(os.path.realpath(cwd / candidate))
            for root in roots:
                if p == root or root in p.parents:
                    raise UserError(
                        f"stage argument {arg!r} points into the sealed folder {root}; "
                        "expected only {data}, {out} and upstream outputs"
                    )


class Cache:
    """Stage outputs by key under `root`; `.tmp/` holds outputs being written."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.tmp_root = self.root / ".tmp"
        self.tmp_root.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        return self.root / key

    def has(self, key: str) -> bool:
        return self.path(key).is_dir()

    def new_tmp(self, key: str) -> Path:
        tmp = self.tmp_root / f"{key[:16]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        return tmp

    def publish(self, tmp: Path, key: str) -> Path:
        """Atomically move a finished output into place; if another writer won, keep theirs."""
        final = self.path(key)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
        return final

    def discard(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    def clear_tmp(self) -> int:
        """Remove half-written outputs left by dead drivers (their pid is in the folder name)."""
        import psutil

        removed = 0
        for p in self.tmp_root.iterdir():
            parts = p.name.split("-")
            pid = int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else -1
            if pid != os.getpid() and not psutil.pid_exists(pid):
                shutil.rmtree(p, ignore_errors=True)
                removed += 1
        return removed
