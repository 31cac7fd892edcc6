"""One shape for every seam chosen by name: harnesses, executors, gate protocols and policies.

    HARNESSES = Registry("harness", {"transactions": "pipeline.harness.transactions:TransactionsHarness"})
    HARNESSES.register("tiny", TinyHarness)       # or "my_module:TinyHarness", imported on first use
    HARNESSES.get("tiny")                          # the class (or factory) itself
    HARNESSES.get("nope")     # UserError: unknown harness 'nope'; expected one of ['tiny', 'transactions']

An entry is the object itself or a lazy "module:attr" string, imported by `get`: naming or checking
the choices imports nothing (reading a lab's config must not import numpy or torch).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Generic, TypeVar

from pipeline.errors import UserError

T = TypeVar("T")


class Registry(Generic[T]):
    """Names → entries of one kind; an unknown name is a one-line user error listing the choices."""

    def __init__(self, kind: str, entries: Mapping[str, T | str] | None = None, *,
                 error: type[UserError] = UserError):
        self.kind = kind
        self.error = error
        self._entries: dict[str, T | str] = {}
        for name, entry in (entries or {}).items():
            self.register(name, entry)

    def register(self, name: str, entry: T | str) -> None:
        """Add or replace `name`: an object (a class, a factory) or "module:attr", imported by `get`."""
        if isinstance(entry, str) and not all(entry.partition(":")[::2]):
            raise ValueError(f"{self.kind} {name!r}: a lazy entry is 'module:attr', got {entry!r}")
        self._entries[name] = entry

    def unregister(self, name: str) -> None:
        self._entries.pop(name, None)

    def get(self, name: str) -> T:
        """The entry registered as `name`, imported if it is lazy."""
        if name not in self._entries:
            raise self.error(f"unknown {self.kind} {name!r}; expected one of {self.names()}")
        entry = self._entries[name]
        if isinstance(entry, str):
            module, _, attr = entry.partition(":")
            return getattr(importlib.import_module(module), attr)
        return entry

    def names(self) -> list[str]:
        """The registered names, sorted (what an error lists)."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        """The names in registration order (a policy registry's order of preference)."""
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"


__all__ = ["Registry"]
