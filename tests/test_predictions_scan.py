"""A rejected predictions file is branch-written: the driver tells "nan" from "predictions" by reading
it line by line from a bounded prefix, without following a link, never whole (issue 20)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.scoring import _has_nonfinite

pytestmark = pytest.mark.unit


def test_a_nan_in_the_rows_is_found_and_a_clean_file_is_not(tmp_path: Path) -> None:
    p = tmp_path / "predictions.csv"
    p.write_text("id,score\n1,0.5\n2,NaN\n")
    assert _has_nonfinite(p)
    p.write_text("id,score\n1,0.5\n2,0.25\n")
    assert not _has_nonfinite(p)


def test_the_scan_stops_at_its_bound_and_at_links_and_special_files(tmp_path: Path) -> None:
    p = tmp_path / "predictions.csv"
    with p.open("wb") as fh:  # 8 MB of rows, one unbroken 1 MB line among them, then a NaN past the bound
        fh.write(b"id,score\n")
        fh.write(b"1,0.5\n" * (1 << 20))
        fh.write(b"x" * (1 << 20) + b"\n")
        fh.write(b"2,nan\n")
    assert not _has_nonfinite(p, limit=1 << 20)  # the NaN lies beyond the first MB: not read
    assert _has_nonfinite(p, limit=64 << 20)
    link = tmp_path / "link.csv"
    link.symlink_to(p)
    assert not _has_nonfinite(link)  # never through a link
    fifo = tmp_path / "fifo.csv"
    os.mkfifo(fifo)
    assert not _has_nonfinite(fifo)  # a FIFO would block a plain open: refused without reading
