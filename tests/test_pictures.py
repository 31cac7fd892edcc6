"""Pictures: the lab's progress chart and the per-hypothesis forest plot, drawn from the gate's records.

The PNGs are read back and looked at: size, and the decision / flag colours present where the data
says they should be.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.summary import BASELINE, BETTER, SAME, cli, decided, gate_result, implemented, make_lab, measured, services

from agent.graph import Nodes
from agent.pictures import (
    DECISION_COLORS,
    FLAG_COLORS,
    Painter,
    draw_forest,
    forest_path,
    progress_path,
    progress_points,
)
from agent.records import Hypothesis
from agent.summary import summary_path

pytestmark = pytest.mark.system


def pixels(path):
    from matplotlib.image import imread

    img = imread(str(path))
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 400, img.shape
    return img[..., :3]


def has_color(img, hex_color: str, min_pixels: int = 15) -> bool:
    rgb = np.array([int(hex_color[i:i + 2], 16) for i in (1, 3, 5)]) / 255
    return int((np.abs(img - rgb).max(axis=-1) < 0.03).sum()) >= min_pixels


@pytest.fixture
def lab(tmp_path):
    return make_lab(tmp_path / "lab")


@pytest.mark.parametrize("painted", [False, True], ids=["here", "painter"])
def test_progress_chart_and_forest_plots_from_the_gates_records(lab, painted, monkeypatch):
    """Drawn in this process, or by the loop's `Painter` in a process of its own: the same pictures,
    linked from the same summaries."""
    svc = services(lab)
    svc.painter = Painter() if painted else None
    try:
        _pictures_from_the_gates_records(lab, svc, monkeypatch)
    finally:
        if svc.painter is not None:
            svc.painter.close()


def _pictures_from_the_gates_records(lab, svc, monkeypatch):
    def drawn():
        if svc.painter is not None:
            svc.painter.flush()

    promoted = decided(svc, measured(svc, implemented(svc), BETTER))
    drawn()
    assert promoted.decision == "promote" and promoted.promoted_tag == "baseline/v1"
    # forest written before the summary text: the first (and only) write links it
    assert forest_path(svc.lab, promoted.id).is_file()
    assert f"![task deltas]({promoted.id}.forest.png)" in summary_path(svc.lab, promoted.id).read_text()
    assert "[The lab's progress chart](progress.png)" in promoted.summary_md

    # measured against the promoted baseline, the old level is a harm on both tasks
    abandoned = decided(svc, measured(svc, implemented(svc), SAME, baseline=BETTER))
    assert (abandoned.decision, abandoned.verdict) == ("abandon", "harm")
    rejected = svc.records.add(Hypothesis(title="(search space exhausted)", status="summarizing", decision="reject",
                                          reject_kind="exhausted", reject_reason="no untried idea left"))
    Nodes(svc).summarize({"hypothesis_id": rejected.id})
    drawn()
    assert not forest_path(svc.lab, rejected.id).exists()
    assert "No runs were measured" in summary_path(svc.lab, rejected.id).read_text()

    pts = progress_points(svc.store, svc.records)
    assert [(p.id, p.decision) for p in pts] == [(promoted.id, "promote"), (abandoned.id, "abandon"),
                                                 (rejected.id, "reject")]
    level = lambda arm: float(np.mean([np.mean(v) for v in arm.values()]))  # noqa: E731
    at_look_2 = {task: runs[:2] for task, runs in BETTER.items()}
    assert pts[0].base == pytest.approx(level(BASELINE)) and pts[0].level == pytest.approx(level(at_look_2))
    assert pts[1].base == pytest.approx(level(BETTER))  # the line steps up after the promotion
    assert pts[2].base is None and pts[2].level is None
    assert pts[0].tag == "baseline/v1" and pts[0].horizontal_delta > 0
    gate = svc.records.latest_verdict(promoted.id).horizontal  # the points are read from the stored JSON
    assert (pts[0].horizontal_delta, *pts[0].horizontal_ci) == pytest.approx((gate.delta, gate.ci_low, gate.ci_high))
    from agent import pictures

    pictures._DONE_POINTS.clear()
    monkeypatch.setattr(pictures, "POINTS_READ", 1)  # read a verdict at a time: the same points
    assert progress_points(svc.store, svc.records) == pts == progress_points(svc.store, svc.records)  # then kept

    chart = pixels(progress_path(svc.lab))
    for decision in ("promote", "abandon", "reject"):
        assert has_color(chart, DECISION_COLORS[decision]), decision
    assert not has_color(chart, DECISION_COLORS["escalate"])

    win = pixels(forest_path(svc.lab, promoted.id))
    assert has_color(win, FLAG_COLORS["win"]) and not has_color(win, FLAG_COLORS["harm"])
    harmed = pixels(forest_path(svc.lab, abandoned.id))
    assert has_color(harmed, FLAG_COLORS["harm"]) and not has_color(harmed, FLAG_COLORS["win"])

    md = cli(lab, "report", str(promoted.id), "--md").stdout
    assert f"]({forest_path(svc.lab, promoted.id)})" in md and f"]({progress_path(svc.lab)})" in md
    assert "| default_90d |" in md


def test_forest_plot_of_failed_runs_and_of_a_record_between_looks(tmp_path):
    failed = gate_result({"default_90d": [None, None], "churn_60d": [0.70, 0.71]}, 2)
    assert failed.tasks[0].delta is None
    path = draw_forest(failed, tmp_path / "failed.png", "#1 failing method", "auc")
    assert pixels(path).std() > 0.01

    between = failed.model_copy(update={"is_look": False, "verdict": None})
    path = draw_forest(between, tmp_path / "between.png", "#2 between looks", "auc")
    assert not has_color(pixels(path), FLAG_COLORS["win"])
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically


def test_a_painter_whose_worker_died_starts_another_and_loses_no_picture(tmp_path):
    """kill -9 of the painter's worker process: the next picture starts a new one (or is drawn here);
    every picture asked for is on disk after `flush`."""
    import os
    import signal

    from support.summary import gate_result as result_of

    svc = services(make_lab(tmp_path / "lab"))
    painter = Painter()
    try:
        result = result_of(BETTER, 2)
        painter.write_forest(svc.lab, 1, "first", result)
        painter.flush()
        assert forest_path(svc.lab, 1).is_file()
        (pid,) = [p.pid for p in painter._pool._processes.values()]
        assert pid != os.getpid()  # drawn in a process of its own
        os.kill(pid, signal.SIGKILL)
        for hid in (2, 3):
            painter.write_forest(svc.lab, hid, "after the kill", result)
        painter.flush()
        assert all(forest_path(svc.lab, hid).is_file() for hid in (2, 3))
        assert pixels(forest_path(svc.lab, 3)).shape == pixels(forest_path(svc.lab, 1)).shape
    finally:
        painter.close()
