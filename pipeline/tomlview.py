"""What a stage sees of a TOML file it names by tables (`config.toml#pretrain`): that file cut down to
those tables, written so its bytes are a function of their values alone (what the stage reads, and
what its cache key hashes)."""

from __future__ import annotations

import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


def table_value(doc: dict[str, Any], table: str) -> Any:
    """The value at the dotted name `table` of a parsed TOML document; None where there is none."""
    value: Any = doc
    for part in table.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def toml_tables(data: bytes, tables: Iterable[str]) -> bytes:
    """The TOML file `data` cut down to `tables` (dotted names; one it lacks left out), written from
    the parsed values with keys sorted, so the bytes are a function of those values alone: what a
    stage that names the file by tables sees, and what its cache key hashes, table by table
    (`pipeline.dag.input_digests`). `data` itself when it is not UTF-8 TOML: then the key hashes it whole."""
    import tomli_w

    try:  # a branch's file: nested past the interpreter's depth is as good as unparsable
        doc = tomllib.loads(data.decode("utf-8"))
        out: dict[str, Any] = {}
        for table in tables:
            value = table_value(doc, table)
            if value is None:
                continue
            *parents, last = table.split(".")
            node = out
            for part in parents:  # a parent already taken whole holds this table already
                node = node.setdefault(part, {})
            node[last] = value
        return tomli_w.dumps(_sorted_keys(out)).encode("utf-8")
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError):
        return data


def _sorted_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _sorted_keys(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted_keys(v) for v in value]
    return value


@dataclass(frozen=True)
class Seen:
    """What a stage sees of a file it sees (`Lab.stage_sees`): the whole file, or, when `tables` is
    not empty, a TOML file of just those tables (`toml_tables`)."""

    tables: tuple[str, ...] = ()

    def content(self, data: bytes) -> bytes:
        """The bytes the stage reads, from the file's committed bytes."""
        return toml_tables(data, self.tables) if self.tables else data
