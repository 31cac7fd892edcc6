"""Gate protocols: how a look's t statistics become boundaries and per-task wins and harms.

A protocol is one class (`base.GateProtocol`) in a module of this package, registered in
`PROTOCOLS` by name (`[gate] protocol`, `gate-sim --protocol`; a plugin or a test:
`PROTOCOLS.register(name, "module:Class")`); names resolve lazily, so reading a lab's config imports
no numpy. The rest of the gate — the pooled t, the horizontal test, failures,
verdicts — is shared.

- `paired` (default): the sequential design on the paired differences of seed k (common random numbers).
- `sequential`: pooled t, moderated variance, group-sequential boundaries, BH on both tails.
- `fixed`: the original post's pooled t re-tested at every look at the nominal level.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

from pipeline.registry import Registry

if TYPE_CHECKING:
    from pipeline.gate.protocol.base import GateProtocol

PROTOCOLS: Registry[type["GateProtocol"]] = Registry("protocol", {
    "paired": "pipeline.gate.protocol.paired:Paired",
    "sequential": "pipeline.gate.protocol.sequential:Sequential",
    "fixed": "pipeline.gate.protocol.fixed:Fixed",
})


def check_name(name: str) -> str:
    """`name` if it is a registered protocol (the `[gate] protocol` validator), else ValueError."""
    if name not in PROTOCOLS:
        raise ValueError(f"one of {PROTOCOLS.names()}, got {name!r}")
    return name


@lru_cache(maxsize=None)
def get_protocol(name: str) -> "GateProtocol":
    """The one instance of the protocol registered as `name` (cached: `get_protocol.cache_clear()`
    after registering over a name); unknown: a `UserError` naming the choices."""
    return PROTOCOLS.get(name)()


__all__ = ["PROTOCOLS", "check_name", "get_protocol"]
