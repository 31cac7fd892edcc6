"""Gate protocols: how a look's t statistics become boundaries and per-task wins and harms.

A protocol is one class (`base.GateProtocol`) in a module of this package, registered in
`PROTOCOLS` by name (`[gate] protocol`, `gate-sim --protocol`); names resolve lazily, so reading a
lab's config imports no numpy. The rest of the gate — the pooled t, the horizontal test, failures,
verdicts — is shared.

- `paired` (default): the sequential design on the paired differences of seed k (common random numbers).
- `sequential`: pooled t, moderated variance, group-sequential boundaries, BH on both tails.
- `fixed`: the original post's pooled t re-tested at every look at the nominal level.
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.gate.protocol.base import GateProtocol

PROTOCOLS: dict[str, str] = {
    "paired": "pipeline.gate.protocol.paired:Paired",
    "sequential": "pipeline.gate.protocol.sequential:Sequential",
    "fixed": "pipeline.gate.protocol.fixed:Fixed",
}


def check_name(name: str) -> str:
    """`name` if it is a registered protocol (the `[gate] protocol` validator), else ValueError."""
    if name not in PROTOCOLS:
        raise ValueError(f"one of {sorted(PROTOCOLS)}, got {name!r}")
    return name


@lru_cache(maxsize=None)
def get_protocol(name: str) -> "GateProtocol":
    if name not in PROTOCOLS:
        raise ValueError(f"unknown protocol {name!r}; expected one of {sorted(PROTOCOLS)}")
    module, _, cls = PROTOCOLS[name].partition(":")
    return getattr(importlib.import_module(module), cls)()


__all__ = ["PROTOCOLS", "check_name", "get_protocol"]
