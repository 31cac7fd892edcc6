"""The measurement environment: the software and the GPU model a run's numbers were made with.

A paired comparison reads the challenger's Δ against the baseline's runs on the same seeds, and the
baseline's runs are measured lazily, perhaps weeks before the challenger's. If the environment
changed in between (a torch upgrade, another CUDA, a node with another GPU model), every challenger
carries the change's effect as its own: bf16 kernels, default TF32, a new data loader's order can
move a metric by more than the effects the gate looks for. So the environment is part of what a
measurement is:

- **The cache key** holds the environment's id (`Environment.id`): an output trained with one
  torch or on one GPU model never serves a run under another, and a stage that crashed under the
  old one is run again. (A re-measured baseline's runs are then made afresh, never served.)
- **Each result** records its environment (`Result.env_id`, the `measure_env` table holds what it is).
- **The gate** holds for a human a gain whose pairs moved between environments one way, beyond
  chance (`held_for`, `Experiment.mixed_environments`), and names what changed.
- **The loop** re-measures its baseline when the environment it runs in is not the one the
  baseline's runs were measured in (an empty commit on the baseline: `LabRepo.remeasure`), so the
  challengers after an upgrade are compared within one environment again.

What counts: the Python implementation and version, the machine's architecture, the versions of the
installed distributions whose names match the lab's `[run] environment` patterns (by default the
numerical stack: `DEFAULT_PACKAGES`; `["*"]` for every one), and, for a lab whose stages get a GPU,
the GPU models, and the stage environment's version (`STAGE_ENV_VERSION`: what the sandbox gives a
stage, which a version of this tool that changes it raises). Not the NVIDIA driver's version, the
host name, or this tool's own version otherwise.

Standard library only: a Ray node's warm worker loads this file on its own (`node_facts`).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import platform
import re
import sys
from dataclasses import dataclass
from typing import Any, Iterable

# Distributions whose versions change a model's numbers: array and tensor libraries, their CUDA
# libraries and kernels, training and fine-tuning frameworks, classic ML. A lab adds its own.
DEFAULT_PACKAGES = (
    "torch", "torchvision", "torchaudio", "triton", "nvidia-*", "cupy*", "jax", "jaxlib", "tensorflow*",
    "numpy", "scipy", "pandas", "polars", "pyarrow", "scikit-learn", "xgboost", "lightgbm", "catboost",
    "peft", "transformers", "accelerate", "tokenizers", "datasets", "safetensors", "deepspeed", "xformers",
    "flash-attn", "flash_attn", "bitsandbytes", "apex", "onnxruntime*", "numba", "einops", "timm",
)
BRIEF_FIRST = ("torch", "jax", "tensorflow", "numpy", "transformers", "peft", "nvidia-cuda-runtime-cu12")
NVIDIA_PROC = "/proc/driver/nvidia/gpus"  # one folder per GPU; its `information` names the model


def normalise(name: str) -> str:
    """A distribution's name as PEP 503 compares them: lower case, runs of `-_.` as one `-`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, str]:
    """Every distribution this interpreter can import: normalised name → version."""
    from importlib import metadata

    out: dict[str, str] = {}
    for dist in metadata.distributions():
        name, version = _name_version(dist)
        if name and version is not None:
            out.setdefault(normalise(name), version)  # the first on sys.path is the one imported
    return dict(sorted(out.items()))


def _name_version(dist: Any) -> tuple[str | None, str | None]:
    """A distribution's Name and Version from its metadata's header lines, without parsing the rest
    as an email (`dist.metadata`: 1 ms a distribution, half a second for a machine learning venv,
    which `status` and the review page paid at every call); the full parse where they are not there."""
    try:
        text = dist.read_text("METADATA") or dist.read_text("PKG-INFO")
    except OSError:
        text = None
    name = version = None
    for line in (text or "").split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep and key == "Name" and name is None:
            name = value.strip()
        elif sep and key == "Version" and version is None:
            version = value.strip()
    if name and version:
        return name, version
    meta = dist.metadata
    return (meta["Name"] if meta else None), (dist.version if meta else None)


def unmatched(patterns: Iterable[str], facts: dict[str, Any]) -> list[str]:
    """The patterns that match none of `facts`' distributions (a typo in `[run] environment`)."""
    names = list(facts.get("packages") or {})
    return [p for p in patterns if not any(fnmatch.fnmatchcase(n, normalise(p)) for n in names)]


def gpu_models(proc_dir: str = NVIDIA_PROC) -> list[str]:
    """The models of this machine's GPUs, as the driver names them ("NVIDIA H200"), sorted and
    without repeats; [] where the driver says nothing (no GPU, or not an NVIDIA one)."""
    models = set()
    try:
        buses = os.listdir(proc_dir)
    except OSError:
        return []
    for bus in buses:
        try:
            with open(os.path.join(proc_dir, bus, "information")) as fh:
                for line in fh:
                    key, _, value = line.partition(":")
                    if key.strip() == "Model" and value.strip():
                        models.add(value.strip())
        except OSError:
            continue
    return sorted(models)


def node_facts(proc_dir: str = NVIDIA_PROC) -> dict[str, Any]:
    """What this process's machine measures with, unfiltered (a Ray node sends it to the driver)."""
    return {"python": f"{platform.python_implementation()} {platform.python_version()}",
            "machine": platform.machine(), "packages": installed(), "gpus": gpu_models(proc_dir)}


@dataclass(frozen=True)
class Environment:
    """One measurement environment. `packages`: (name, version) of the distributions that count;
    `gpus`: the GPU models, () for a lab that runs on CPUs; `stage_env`: what the sandbox gives a
    stage (`executors.base.STAGE_ENV_VERSION`: its limits, thread pools, /dev/shm), which can move
    numbers too."""

    python: str
    machine: str
    packages: tuple[tuple[str, str], ...]
    gpus: tuple[str, ...] = ()
    stage_env: str = ""

    @classmethod
    def of(cls, facts: dict[str, Any], patterns: Iterable[str] = DEFAULT_PACKAGES, *, gpu: bool = False,
           stage_env: str = "") -> "Environment":
        """The environment `facts` (`node_facts`) describe for a lab counting `patterns`, with its
        GPU models when the lab's stages get a GPU (`gpu`), its stages in the sandbox `stage_env`."""
        pats = [normalise(p) for p in patterns]
        packages = tuple(sorted((n, v) for n, v in dict(facts.get("packages") or {}).items()
                                if any(fnmatch.fnmatchcase(n, p) for p in pats)))
        gpus = tuple(sorted(set(facts.get("gpus") or ()))) if gpu else ()
        return cls(str(facts.get("python", "?")), str(facts.get("machine", "?")), packages, gpus, stage_env)

    def software_doc(self) -> dict[str, Any]:
        return {"python": self.python, "machine": self.machine, "packages": [f"{n}=={v}" for n, v in self.packages],
                "stage_env": self.stage_env}

    def doc(self) -> dict[str, Any]:
        return {**self.software_doc(), "gpus": list(self.gpus)}

    @property
    def software_id(self) -> str:
        """The software's id (no GPU)."""
        return _digest(self.software_doc())

    @property
    def id(self) -> str:
        """The environment's id: the software's and the GPU models'."""
        return _digest(self.doc())

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> "Environment":
        packages = tuple(tuple(p.split("==", 1)) for p in doc.get("packages", []) if "==" in p)
        return cls(str(doc.get("python", "?")), str(doc.get("machine", "?")),
                   tuple(sorted((n, v) for n, v in packages)), tuple(doc.get("gpus", [])), str(doc.get("stage_env", "")))

    def brief(self, shown: int = 4) -> str:
        """One line: Python, the packages that count (the frameworks first), the GPUs."""
        rank = {n: i for i, n in enumerate(BRIEF_FIRST)}
        first = sorted(self.packages, key=lambda p: (rank.get(p[0], len(rank)), p[0]))
        pk = ", ".join(f"{n} {v}" for n, v in first[:shown])
        more = f" (+{len(self.packages) - shown} more)" if len(self.packages) > shown else ""
        gpus = f"; {', '.join(self.gpus)}" if self.gpus else ""
        return f"{self.python} {self.machine}" + (f", {pk}{more}" if pk else "") + gpus


def _digest(doc: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def change(old: Environment, new: Environment, limit: int = 6) -> str:
    """What differs from `old` to `new`, in one line ("torch 2.11.0 → 2.12.0, numba added; GPU
    NVIDIA A100 → NVIDIA H100"); "" when nothing that counts does."""
    parts = []
    if old.python != new.python:
        parts.append(f"{old.python} → {new.python}")
    if old.machine != new.machine:
        parts.append(f"{old.machine} → {new.machine}")
    a, b = dict(old.packages), dict(new.packages)
    for name in sorted(set(a) | set(b)):
        if a.get(name) != b.get(name):
            parts.append(f"{name} added ({b[name]})" if name not in a else
                         f"{name} removed" if name not in b else f"{name} {a[name]} → {b[name]}")
    if old.gpus != new.gpus:
        parts.append(f"GPU {', '.join(old.gpus) or 'none'} → {', '.join(new.gpus) or 'none'}")
    if old.stage_env != new.stage_env:
        parts.append(f"sandbox {old.stage_env or '?'} → {new.stage_env or '?'}")
    if len(parts) > limit:
        parts = parts[:limit] + [f"{len(parts) - limit} more"]
    return ", ".join(parts)


# A gain is held for a human when more of its compared pairs had the baseline's run in one
# environment and the challenger's in another than the other way round, by more than this share of
# the pairs (such pairs carry the change's effect as the challenger's: a bias of that share × the
# shift), and that is no chance: the arms share no environment (an upgrade between them), or a
# two-sided sign test on the pairs that moved says p < HOLD_P (random placement on a mixed cluster
# moves about as many pairs each way). Chosen on `benchmarks/environment_shift.py`: a quarter and
# p < 0.05 let a lazy baseline's partly moved comparisons through (0.55 % of null challengers
# promoted at a 1σ shift, 5× the gate's own rate); these hold them all and hold 0.3–1 % of real
# gains on a mixed cluster by chance.
IMBALANCE_HOLD = 0.05
HOLD_P = 0.01


def imbalance(base: dict[Any, str | None], chal: dict[Any, str | None]) -> tuple[float, str, str, int, int] | None:
    """The compared pairs' largest one-way move between environments: (its share of the pairs, the
    baseline's environment, the challenger's, how many pairs moved that way, the pairs with both
    environments known); None when no pair moved. `base` and `chal`: a pair's key (task, seed) →
    the environment id of that arm's run (None: unknown, left out)."""
    keys, moved = _moves(base, chal)
    return _largest(len(keys), moved)


def _moves(base: dict[Any, str | None], chal: dict[Any, str | None]) -> tuple[list[Any], dict[tuple[str, str], int]]:
    """The pairs with both environments known, and how many moved from each environment to each other."""
    keys = [k for k in base if k in chal and base[k] and chal[k]]
    moved: dict[tuple[str, str], int] = {}
    for k in keys:
        b, c = base[k], chal[k]
        if b != c:
            moved[(b, c)] = moved.get((b, c), 0) + 1  # type: ignore[index]
    return keys, moved


def _largest(pairs: int, moved: dict[tuple[str, str], int]) -> tuple[float, str, str, int, int] | None:
    """`imbalance` from `_moves`' counts."""
    if not moved:
        return None
    (b, c), n = max(moved.items(), key=lambda kv: kv[1] - moved.get((kv[0][1], kv[0][0]), 0))
    net = n - moved.get((c, b), 0)
    return net / pairs, b, c, net, pairs


def sign_p(k: int, n: int) -> float:
    """Two-sided sign test: P(a split at least as uneven as k of n), each pair either way with ½."""
    from math import comb

    tail = sum(comb(n, i) for i in range(0, min(k, n - k) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def held_for(base: dict[Any, str | None], chal: dict[Any, str | None]) -> tuple[float, str, str, int, int] | None:
    """`imbalance`, when it holds a gain (`IMBALANCE_HOLD`, `HOLD_P`); None when it does not."""
    keys, moved = _moves(base, chal)
    got = _largest(len(keys), moved)
    if got is None or got[0] <= IMBALANCE_HOLD:
        return None
    _, b, c, _, _ = got
    if not {base[k] for k in keys} & {chal[k] for k in keys}:  # all of one arm here, all of the other there
        return got
    one_way, other_way = moved[(b, c)], moved.get((c, b), 0)
    return got if sign_p(one_way, one_way + other_way) < HOLD_P else None


_FACTS: dict[str, dict[str, Any]] = {}


def here(proc_dir: str = NVIDIA_PROC) -> dict[str, Any]:
    """`node_facts` of this process, read once: what a driver measures with for its whole life (the
    loop reads the facts again every few minutes and stops when they changed under it:
    `agent.loop.guards.environment_moved`)."""
    if proc_dir not in _FACTS:
        _FACTS[proc_dir] = node_facts(proc_dir)
    return _FACTS[proc_dir]



if __name__ == "__main__":  # what a node reports: `python -m pipeline.environment`
    json.dump(node_facts(), sys.stdout, indent=1)
    print()
