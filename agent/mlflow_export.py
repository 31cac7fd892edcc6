"""`autoresearch export mlflow`: the lab's hypotheses as MLflow runs, for teams that read results there.

One parent run per hypothesis — params: the config keys its commit changed (and to what); tags:
verdict, decision, commit, branch, baseline tag, origin, status, and its direction (`agent.directions`:
the config keys, else the files, it changed); metrics: the horizontal Δ (with its interval) and each
task's Δ at the last look, and for a promoted hypothesis its champion's figures on its own runs: the
level on the gate split and on the sealed holdout, and the gains since the first baseline on both
(`agent.progress.split_progress`; + is better); artifacts: summary.md and the forest plot — and one
nested run per (task, seed) of its challenger runs, with the metric's value and the run's CPU seconds.

Idempotent, keyed by tags (`autoresearch.hypothesis`, `autoresearch.run`): a second export creates
no run and logs no metric point that is already there; what changed since (a decision, a later
look's Δ, a new summary) is updated. Params are written once (MLflow's rule; a hypothesis's commit,
hence its changed keys, never changes). `run --mlflow URI` exports each hypothesis as it is decided.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from agent.directions import changed_keys, direction_of, label
from agent.records import Hypothesis, Records

log = logging.getLogger("autoresearch.mlflow")

HYP_TAG = "autoresearch.hypothesis"
RUN_TAG = "autoresearch.run"
LAB_TAG = "autoresearch.lab"
__all__ = ["Exporter", "changed_keys", "export"]  # changed_keys: agent.directions's, for callers of old


class Exporter:
    def __init__(self, lab: Any, store: Any, tracking_uri: str, experiment: str | None = None):
        # a tracking server that is down fails in seconds, not after MLflow's minutes of retries
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"  # stdout is the command's data
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            from pipeline.errors import UserError

            raise UserError("export mlflow needs MLflow: pip install -e '.[mlflow]'") from None
        from agent.workspace import Workspace

        self.lab, self.store = lab, store
        self.records = Records(store)
        self.workspace = Workspace(lab)
        self.client = MlflowClient(tracking_uri=tracking_uri)
        name = experiment or f"autoresearch/{lab.config.lab.name}"
        exp = self._call(self.client.get_experiment_by_name, name, what=f"the tracking server at {tracking_uri}")
        if exp is not None:
            self.experiment_id = exp.experiment_id
        else:  # a SQLite store keeps its artifacts beside it, not in ./mlruns of whatever folder we run in
            where = None
            if tracking_uri.startswith("sqlite:///"):
                where = (Path(tracking_uri[len("sqlite:///"):]).resolve().parent / "mlflow-artifacts").as_uri()
            self.experiment_id = self.client.create_experiment(name, artifact_location=where)
        self.created = self.updated = 0
        self._split: dict[str, Any] | None = None  # split_progress, once per export pass

    def _champion(self, h: Hypothesis) -> dict[str, Any] | None:
        """A promoted hypothesis's champion point of `split_progress` (None: not promoted, or its own runs
        not all in yet)."""
        if not h.promoted_tag:
            return None
        if self._split is None:
            from agent.progress import split_progress

            self._split = split_progress(self.lab, self.store, self.records)
        return next((p for p in self._split["points"] if p["label"] == h.promoted_tag), None)

    @staticmethod
    def _call(fn: Any, *args: Any, what: str) -> Any:
        from mlflow.exceptions import MlflowException

        from pipeline.errors import ServiceUnavailable

        import requests

        try:
            return fn(*args)
        except (MlflowException, requests.RequestException) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ServiceUnavailable(f"cannot reach {what}: {first[:300]}") from None

    # ------------------------------------------------------------------------------------------

    def export_all(self) -> dict[str, int]:
        self._split = None
        for h in self.records.all():
            if h.title:
                self.export(h)
        return {"created": self.created, "updated": self.updated}

    def _find(self, key: str, value: str, parent: str | None = None) -> Any | None:
        flt = f"tags.`{key}` = '{value}'"
        if parent is not None:
            flt += f" and tags.`mlflow.parentRunId` = '{parent}'"
        runs = self.client.search_runs([self.experiment_id], filter_string=flt, max_results=2)
        return runs[0] if runs else None

    def export(self, h: Hypothesis) -> str:
        """Create or update the hypothesis's run and its nested runs; returns the parent run's id."""
        if h.promoted_tag:  # a new champion's points: read afresh
            self._split = None
        return self._call(self._export, h, what="the MLflow tracking server")

    def _export(self, h: Hypothesis) -> str:
        from mlflow.entities import Metric, Param, RunTag

        tags = self._tags(h)
        run = self._find(HYP_TAG, str(h.id))
        fresh = run is None
        if run is None:
            run = self.client.create_run(self.experiment_id, tags=tags, run_name=f"#{h.id} {h.title}"[:250])
            self.created += 1
        have_params, have_metrics, have_tags = run.data.params, run.data.metrics, run.data.tags
        run_id = run.info.run_id
        now = _ms()
        params = [Param(k, v) for k, v in changed_keys(self.workspace, h.base_commit, h.commit).items()
                  if k not in have_params]
        new_tags = [RunTag(k, v) for k, v in tags.items() if have_tags.get(k) != v]
        metrics = [Metric(k, v, now, 0) for k, v in self._metrics(h).items() if have_metrics.get(k) != v]
        if params or new_tags or metrics:
            self.client.log_batch(run_id, metrics=metrics, params=params, tags=new_tags)
            if not fresh:
                self.updated += 1
        self._artifacts(run_id, h)
        self._nested(run_id, h)
        status = "FINISHED" if h.status == "done" else "RUNNING"
        if run.info.status != status:
            self.client.update_run(run_id, status=status)
        return run_id

    def _tags(self, h: Hypothesis) -> dict[str, str]:
        base_tags = [t for t in self.workspace.baseline_tags() if h.base_commit and
                     self.workspace.repo.commit(t).hexsha == h.base_commit]
        tags = {HYP_TAG: str(h.id), LAB_TAG: self.lab.config.lab.name, "status": h.status,
                "verdict": h.verdict or "", "decision": h.decision or "", "commit": h.commit or "",
                "branch": h.branch or "", "baseline": base_tags[-1] if base_tags else (h.base_commit or "")[:12],
                "origin": h.origin or "", "promoted_tag": h.promoted_tag or "", "title": (h.title or "")[:500],
                "direction": label(direction_of(self.workspace, h))[:500]}
        if h.reject_kind:
            tags["reject_kind"] = h.reject_kind
        return tags

    def _metrics(self, h: Hypothesis) -> dict[str, float]:
        latest = self.records.latest_verdict(h.id)
        if latest is None:
            return {}
        g = latest.to_json()
        out: dict[str, float] = {"look": float(g.get("look") or 0)}
        hz = g.get("horizontal") or {}
        for key, name in (("delta", "horizontal_delta_sigma"), ("ci_low", "horizontal_ci_low_sigma"),
                          ("ci_high", "horizontal_ci_high_sigma")):
            if hz.get(key) is not None and math.isfinite(hz[key]):
                out[name] = float(hz[key])
        for t in g.get("tasks", []):
            if t.get("delta") is not None and math.isfinite(t["delta"]):
                out[f"delta.{t['task']}"] = float(t["delta"])
        p = self._champion(h)
        if p is not None:
            figures = {"champion.gate_split": p["gate"], "champion.holdout": p["holdout"],
                       "champion.gate_split_gain": p["gate_gain"], "champion.holdout_gain": p["holdout_gain"]}
            out |= {k: float(v) for k, v in figures.items() if v is not None and math.isfinite(v)}
        return out

    def _artifacts(self, run_id: str, h: Hypothesis) -> None:
        from agent.pictures import forest_path
        from agent.summary import summary_path

        have = {a.path for a in self.client.list_artifacts(run_id)}
        for path in (summary_path(self.lab, h.id), forest_path(self.lab, h.id)):
            name = "summary.md" if path.suffix == ".md" else "forest.png"
            if path.is_file() and name not in have:
                self._log_as(run_id, path, name)

    def _log_as(self, run_id: str, path: Path, name: str) -> None:
        import shutil
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            dst = Path(tmp) / name
            shutil.copyfile(path, dst)
            self.client.log_artifact(run_id, str(dst))

    def _nested(self, parent: str, h: Hypothesis) -> None:
        from mlflow.entities import Metric

        if not h.commit:
            return
        existing = {r.data.tags.get(RUN_TAG): r for r in self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent}'", max_results=5000)}
        metric = self.lab.config.benchmark.metric
        for res in self.store.results_for(h.commit):
            key = f"{h.commit[:12]}:{res.task}:{res.seed}"
            values = {"cpu_s": float(res.cpu_s)}
            if res.value is not None and math.isfinite(res.value):
                values[metric] = float(res.value)
            run = existing.get(key)
            if run is None:
                tags = {RUN_TAG: key, "mlflow.parentRunId": parent, "task": res.task, "seed": str(res.seed),
                        "outcome": res.outcome, HYP_TAG + ".of": str(h.id)}
                run = self.client.create_run(self.experiment_id, tags=tags, run_name=f"{res.task} seed {res.seed}")
                self.client.log_batch(run.info.run_id, metrics=[Metric(k, v, _ms(), 0) for k, v in values.items()])
                self.client.set_terminated(run.info.run_id)
                self.created += 1
            else:
                stale = [Metric(k, v, _ms(), 0) for k, v in values.items() if run.data.metrics.get(k) != v]
                if stale:
                    self.client.log_batch(run.info.run_id, metrics=stale)
                    self.updated += 1


def default_tracking_uri(lab: Any) -> str:
    """A SQLite tracking store beside the lab's own (`mlflow ui --backend-store-uri` it to browse)."""
    return f"sqlite:///{lab.state / 'mlflow.db'}"


def _ms() -> int:
    return int(time.time() * 1000)


def export(lab: Any, store: Any, tracking_uri: str, experiment: str | None = None) -> dict[str, int]:
    return Exporter(lab, store, tracking_uri, experiment).export_all()
