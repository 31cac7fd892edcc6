"""The README's `research.toml` table says every key of the lab's models, with its default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

README = Path(__file__).resolve().parent.parent / "README.md"


def _fmt(v):
    if v is None:
        return "unset"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{}" if not v else json.dumps(v)
    return repr(v)


def _keys(model, skip=()) -> str:
    out = []
    for k, f in model.model_fields.items():
        if k in skip:
            continue
        key = f.alias or k
        out.append(f"`{key}` (required)" if f.is_required() else f"`{key} = {_fmt(f.get_default(call_default_factory=True))}`")
    return ", ".join(out)


def test_every_key_of_research_toml_is_in_the_readme_with_its_default() -> None:
    from agent.config import AgentConfig
    from pipeline.lab import LabSection, ResearchConfig, StageSpec

    text = README.read_text()
    rows = [f"| `[lab]` | {_keys(LabSection)} |"]
    for name in ("benchmark", "run", "gate", "agent", "notify"):
        # the agent's tables are the agent's models (agent/config.py); the pipeline keeps them raw
        owner = AgentConfig if name in AgentConfig.model_fields else ResearchConfig
        model = owner.model_fields[name].annotation
        rows.append(f"| `[{name}]` | {_keys(model, ('higher_is_better',) if name == 'gate' else ())} |")
    rows.append(f"| `[[stage]]` (one or more) | {_keys(StageSpec)} |")
    missing = [r for r in rows if r not in text]
    assert not missing, "README's research.toml table is out of date; expected rows:\n" + "\n".join(missing)
    sections = set(ResearchConfig.model_fields) - {"lab", "stage", "search_space"}
    assert sections == {"benchmark", "run", "gate", "agent", "notify"}, sections  # a new table: add its row
