"""The names a lab shares with everything that reads it, standard library only: its config file,
the baseline branch the loop keeps, and a command's `{placeholder}`. Here, below `pipeline.lab`, so
that what the lab is checked against (its harness) can name them without importing the lab."""

from __future__ import annotations

import re

CONFIG_NAME = "research.toml"
BASELINE_BRANCH = "autoresearch/baseline"
PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_-]*)\}")
