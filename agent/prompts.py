"""Prompt templates: every word the LLM is sent lives in `prompts/<name>.md` (and the short pieces
the templates receive as values, in `prompts/phrases.toml`); code only fills them.

Why templates and not f-strings in code: a researcher tunes the agent by editing Markdown, reviews
prompts as text, and a diff of a prompt reads like a diff of prose. Each template starts with an HTML
comment listing its placeholders; the comment is documentation and is stripped before sending.

Filling is strict, like `str.format_map` but stricter: a placeholder without a value is an error
naming it, and so is a value the template does not use — code and templates drift apart silently
otherwise. Literal braces are written `{{` and `}}`.
"""

from __future__ import annotations

import importlib.resources
import re
import string
import tomllib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from agent.errors import UserError

# The top-level `prompts/` folder, shipped inside the package as `agent/prompt_files` (a link in the
# source tree, real files in a wheel): found the same way from a checkout and from an installed wheel.
PROMPTS_DIR = Path(str(importlib.resources.files("agent") / "prompt_files"))

_LEADING_COMMENT = re.compile(r"\A\s*<!--.*?-->\s*", re.DOTALL)
_IDENTIFIER = re.compile(r"\A[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True)
class Template:
    """A loaded template: its body (header comment removed) and the placeholders the body uses."""

    name: str
    body: str
    placeholders: frozenset[str]
    documented: frozenset[str]  # the `{name}`s listed in the header comment

    def render(self, **values: Any) -> str:
        """The body with every placeholder replaced by `str(value)`; strict about missing/unused keys."""
        missing = sorted(self.placeholders - values.keys())
        if missing:
            raise UserError(f"prompt {self.name!r}: no value for {', '.join('{' + m + '}' for m in missing)}")
        unused = sorted(values.keys() - self.placeholders)
        if unused:
            raise UserError(f"prompt {self.name!r}: values it does not use: {', '.join(unused)}")
        return self.body.format_map(values)


def _parse(name: str, text: str) -> Template:
    header = _LEADING_COMMENT.match(text)
    body = text[header.end():] if header else text
    documented = frozenset(re.findall(r"\{([A-Za-z_][A-Za-z0-9_]*)\}", header.group(0))) if header else frozenset()
    fields: set[str] = set()
    try:
        parsed = list(string.Formatter().parse(body))
    except ValueError as e:  # a lone brace
        raise UserError(f"prompt {name!r}: {e} (write literal braces as {{{{ and }}}})") from None
    for _literal, field, spec, conversion in parsed:
        if field is None:
            continue
        if not _IDENTIFIER.match(field) or spec or conversion:
            raise UserError(f"prompt {name!r}: placeholder {{{field}}} must be a plain name like {{program}}")
        fields.add(field)
    return Template(name, body.strip() + "\n", frozenset(fields), documented)


@lru_cache(maxsize=64)
def _load_cached(path: Path, mtime_ns: int) -> Template:
    return _parse(path.stem, path.read_text(encoding="utf-8"))


def load(name: str, directory: Path | None = None) -> Template:
    """Load `prompts/<name>.md` (or `<directory>/<name>.md`); re-read when the file changes."""
    path = (directory or PROMPTS_DIR) / f"{name}.md"
    try:
        mtime = path.stat().st_mtime_ns
    except FileNotFoundError:
        raise UserError(f"no prompt template {path}") from None
    return _load_cached(path, mtime)


def render(name: str, directory: Path | None = None, /, **values: Any) -> str:
    """Load and fill a template in one step: `render("propose", program=..., history=...)`."""
    return load(name, directory).render(**values)


@lru_cache(maxsize=8)
def _phrases_cached(path: Path, mtime_ns: int) -> dict[str, Template]:

    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: not valid TOML ({e})") from None
    out = {}
    for key, text in raw.items():
        if not isinstance(text, str):
            raise UserError(f"{path}: {key}: expected a string")
        t = _parse(f"phrases.{key}", text)
        out[key] = Template(t.name, t.body.rstrip("\n"), t.placeholders, t.documented)
    return out


def phrase(name: str, directory: Path | None = None, /, **values: Any) -> str:
    """A short piece of prompt text from `prompts/phrases.toml` (a table row, a list item, what a
    decision does), filled as strictly as a template."""
    path = (directory or PROMPTS_DIR) / "phrases.toml"
    try:
        mtime = path.stat().st_mtime_ns
    except FileNotFoundError:
        raise UserError(f"no phrase file {path}") from None
    phrases = _phrases_cached(path, mtime)
    if name not in phrases:
        raise UserError(f"no phrase {name!r} in {path}")
    return phrases[name].render(**values)


def md_list(items: list[str]) -> str:
    """A Markdown list of `items`, or the phrase for an empty one."""
    return "\n".join(phrase("list_item", item=x) for x in items) or phrase("list_empty")


def names(directory: Path | None = None) -> list[str]:
    """The templates available, by name."""
    return sorted(p.stem for p in (directory or PROMPTS_DIR).glob("*.md"))
