"""A thread's checkpoint reads back its enums, and nothing it was not told about (langgraph's strict
msgpack allowlist: an unregistered type is a warning today and refused in a later release)."""

from __future__ import annotations

import enum
import logging
import sqlite3
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit


class Planted(enum.Enum):  # a type no checkpoint of ours holds: what a tampered checkpoint might carry
    X = "x"


def _roundtrip(tmp_path: Path, values: dict) -> dict:
    from langgraph.checkpoint.base import empty_checkpoint
    from langgraph.checkpoint.sqlite import SqliteSaver

    from agent.graph.checkpointer import serializer

    saver = SqliteSaver(sqlite3.connect(str(tmp_path / "c.sqlite"), check_same_thread=False), serde=serializer())
    cp = empty_checkpoint()
    cp["channel_values"] = values
    cp["channel_versions"] = {k: 1 for k in values}
    config = {"configurable": {"thread_id": "7", "checkpoint_ns": ""}}
    saver.put(config, cp, {"source": "loop", "step": 1}, {k: 1 for k in values})
    return saver.get_tuple(config).checkpoint["channel_values"]


def test_a_checkpoint_reads_back_the_states_enums_without_a_warning(tmp_path: Path, caplog) -> None:
    from agent.lifecycle import Status
    from pipeline.api import Verdict

    with caplog.at_level(logging.WARNING):
        got = _roundtrip(tmp_path, {"hypothesis_id": 3, "phase": Status.MEASURING, "verdict": Verdict.improvement,
                                    "look": 2, "champion": None})
    assert got["verdict"] is Verdict.improvement and got["phase"] is Status.MEASURING and got["look"] == 2
    assert not [r for r in caplog.records if "unregistered" in r.getMessage()], caplog.text


def test_a_type_the_state_never_holds_is_not_rebuilt(tmp_path: Path) -> None:
    got = _roundtrip(tmp_path, {"verdict": Planted.X})
    assert not isinstance(got.get("verdict"), Planted)
