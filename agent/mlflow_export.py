"""`autoresearch export mlflow`: the lab's hypotheses as MLflow runs, for teams that read results there.

One parent run per hypothesis — params: the config keys its commit changed (and to what); tags:
verdict, decision, commit, branch, baseline tag, origin, status, and its direction (`agent.directions`:
the config keys, else the files, it changed); metrics: the horizontal Δ (with its interval) and each
task's Δ at the last look, and for a promoted hypothesis its champion's figures on its own runs: the
level on the gate split and on the sealed holdout, and the gains since the first baseline on both
(`agent.progress.split_progress`; + is better), and what its smoke runs spent (`smoke.runs`,
`smoke.cpu_s`, `smoke.gpu_s`, `smoke.wall_s`); artifacts: summary.md and the forest plot — and one
nested run per (task, seed) of its challenger runs, with the metric's value, the run's CPU seconds and,
for a GPU lab, its GPU-seconds (`gpu_s`: share × wall) and the mean utilisation NVML saw (`gpu_util`),
tagged with its measurement environment's id (`environment`: `pipeline.environment`, the `measure_env` table).
`export mlflow` also keeps one run of the lab's compute (`lab compute`, tagged `autoresearch.compute`):
the figures `status` prints as `compute.*` metrics (`compute.useful_gpu_s`, `compute.method_failed_gpu_s`,
`compute.infra_lost_gpu_s`, `compute.gpu_busy_share`, `compute.gpu_mean_util`, the CPU seconds, goodput,
smoke runs and harness calls), a new point whenever one changed.

Idempotent, keyed by tags (`autoresearch.hypothesis`, `autoresearch.run`): a second export creates
no run and logs no metric point that is already there; what changed since (a decision, a later
look's Δ, a new summary) is updated. Params are written once (MLflow's rule; a hypothesis's commit,
hence its changed keys, never changes). `run --mlflow URI` exports each hypothesis as it is decided.

Names follow MLflow's rules (`mlflow.utils.validation`): a config key is the LLM's to choose (a quoted
TOML key may hold `@`, a line break, 300 characters), so a name MLflow would refuse is renamed
(`mlflow_name`: its characters replaced, cut, a hash of the original appended) and the original kept
in the tag `autoresearch.original.<name>`; values are cut to MLflow's limits. A hypothesis whose run
the tracking server still refuses is reported (`failed`, and an `AgentError` from `export`) and tried
again at the next export; the others are exported. Only a server that does not answer stops it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import posixpath
import re
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import requests

from agent.directions import changed_keys, direction_of, label
from agent.errors import AgentError
from agent.lifecycle import Status
from agent.pictures import forest_path
from agent.records import Hypothesis, Records
from agent.summary import summary_path
from agent.verdicts import replicate_record
from agent.workspace import Workspace
from pipeline.api import InfrastructureFailure

log = logging.getLogger("autoresearch.mlflow")

HYP_TAG = "autoresearch.hypothesis"
RUN_TAG = "autoresearch.run"
LAB_TAG = "autoresearch.lab"
COMPUTE_TAG = "autoresearch.compute"  # the lab's one run of compute figures
ORIGINAL_TAG = "autoresearch.original."  # + a renamed name: the name as the lab wrote it
__all__ = ["Exporter", "changed_keys", "export", "mlflow_name"]  # changed_keys: agent.directions's

# MLflow's limits (mlflow/utils/validation.py): MAX_ENTITY_KEY_LENGTH, MAX_PARAM_VAL_LENGTH,
# MAX_TAG_VAL_LENGTH, and half of MAX_BATCH_LOG_REQUEST_SIZE (a server's cap on a request; the client
# splits a batch by count, not by size, and JSON escapes may double a text)
NAME_MAX = 250
PARAM_VALUE_MAX = 6000
TAG_VALUE_MAX = 8000
BATCH_BYTES = 500_000
# MLflow's characters for a name, less the colon (refused on a Windows server) and non-ASCII letters
NAME_CHARS = re.compile(r"[A-Za-z0-9_.\- /]+")
RENAMED_MAX = NAME_MAX - len(ORIGINAL_TAG)  # so that the original's tag name fits too
REJECTED_HTTP = (400, 404, 409)  # MLflow's error codes for a request it refuses (not a server that is down)


def mlflow_name(name: str) -> str:
    """`name` if MLflow takes it as a param, metric or tag name; else its characters outside MLflow's
    replaced by `_` (slashes too: a renamed name is flat), cut to fit, and 8 hex digits of its hash
    appended, so two originals never share one name."""
    if len(name) <= NAME_MAX and NAME_CHARS.fullmatch(name) and _flat_path(name):
        return name
    base = re.sub(r"[^A-Za-z0-9_.\- ]", "_", name)
    if base.startswith(".") or not base:
        base = "_" + base
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{base[:RENAMED_MAX - 9]}.{digest}"


def _flat_path(name: str) -> bool:
    """MLflow's `path_not_unique`, negated: a name that stays itself when read as a file path."""
    norm = posixpath.normpath(name)
    return norm == name and norm != "." and not norm.startswith(("..", "/"))


def _text(value: str, limit: int) -> str:
    return value.replace("\x00", "")[:limit]  # PostgreSQL stores no NUL


def _named(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """`values` under MLflow-safe names, and a tag per renamed name holding its original."""
    out: dict[str, Any] = {}
    originals: dict[str, str] = {}
    for key, value in values.items():
        name = mlflow_name(key)
        out[name] = value
        if name != key:
            originals[ORIGINAL_TAG + name] = _text(key, TAG_VALUE_MAX)
    return out, originals


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


class Exporter:
    def __init__(self, lab: Any, store: Any, tracking_uri: str, experiment: str | None = None):
        # a tracking server that is down fails in seconds, not after MLflow's minutes of retries
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"  # stdout is the command's data
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            from pipeline.api import UserError

            raise UserError("export mlflow needs MLflow: pip install -e '.[mlflow]'") from None

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

        try:
            return fn(*args)
        except (MlflowException, requests.RequestException) as e:
            raise InfrastructureFailure(f"cannot reach {what}: {_first_line(e)}") from None

    def _reachable(self) -> bool:
        try:
            self.client.get_experiment(self.experiment_id)
            return True
        except Exception:
            return False

    # ------------------------------------------------------------------------------------------

    def export_all(self) -> dict[str, Any]:
        """Every hypothesis; one the server refuses is in `failed` (and tried again next time), the
        rest are exported. A server that stops answering stops it (`InfrastructureFailure`)."""
        self._split = None
        failed: list[dict[str, Any]] = []
        for h in self.records.all():
            if not h.title:
                continue
            try:
                self.export(h)
            except (AgentError, OSError) as e:  # the server refused this one's run; an artifact store a file
                failed.append({"hypothesis": h.id, "error": str(e) if isinstance(e, AgentError) else
                               f"#{h.id}: {type(e).__name__}: {_first_line(e)}"})
                log.warning("MLflow export: %s", failed[-1]["error"])
        from mlflow.exceptions import MlflowException

        try:
            self.export_compute()
        except (MlflowException, requests.RequestException) as e:  # as a hypothesis's refused run
            failed.append({"hypothesis": None, "error": str(self._refused(e, "the lab's compute run"))})
            log.warning("MLflow export: %s", failed[-1]["error"])
        return {"created": self.created, "updated": self.updated, "failed": failed}

    def export_compute(self) -> str:
        """The lab's compute figures (`Store.goodput`, as `status` prints them: CPU and GPU seconds
        useful / failed / lost to infrastructure, smoke runs, the harness's calls, GPU busy share and
        utilisation) as `compute.*` metrics of one run tagged `autoresearch.compute`; a value that
        changed since the last export is a new point of its history. Returns the run's id."""
        from mlflow.entities import Metric

        values = {f"compute.{k}": float(v) for k, v in self.store.goodput().as_dict().items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        run = self._find(COMPUTE_TAG, "lab")
        fresh = run is None
        if fresh:
            run = self.client.create_run(self.experiment_id, run_name="lab compute",
                                         tags={COMPUTE_TAG: "lab", LAB_TAG: self.lab.config.lab.name})
            self.client.set_terminated(run.info.run_id)
            self.created += 1
            have: dict[str, float] = {}
        else:
            have = run.data.metrics
        now = _ms()
        stale = [Metric(k, v, now, 0) for k, v in values.items() if have.get(k) != v]
        if stale:
            self._log(run.info.run_id, metrics=stale)
            self.updated += not fresh
        return run.info.run_id

    def _find(self, key: str, value: str, parent: str | None = None) -> Any | None:
        flt = f"tags.`{key}` = '{value}'"
        if parent is not None:
            flt += f" and tags.`mlflow.parentRunId` = '{parent}'"
        runs = self.client.search_runs([self.experiment_id], filter_string=flt, max_results=2)
        return runs[0] if runs else None

    def export(self, h: Hypothesis) -> str:
        """Create or update the hypothesis's run and its nested runs; returns the parent run's id.

        A server that refuses this hypothesis's run (a name, a value, a state) raises `AgentError`
        (that one is reported, the others exported); one that does not answer, `InfrastructureFailure`."""
        from mlflow.exceptions import MlflowException

        if h.promoted_tag:  # a new champion's points: read afresh
            self._split = None
        try:
            return self._export(h)
        except (MlflowException, requests.RequestException) as e:
            raise self._refused(e, f"#{h.id}") from None

    def _refused(self, e: Exception, what: str) -> AgentError:
        """The error of a request the tracking server failed: `what`'s refusal (`AgentError`, to report
        and try again next time), or, when the server does not answer, `InfrastructureFailure` (raised)."""
        from mlflow.exceptions import MlflowException

        refused = isinstance(e, MlflowException) and e.get_http_status_code() in REJECTED_HTTP
        if refused or self._reachable():  # this run's, not the server's
            return AgentError(f"the MLflow tracking server refused {what}: {_first_line(e)}")
        raise InfrastructureFailure(f"cannot reach the MLflow tracking server: {_first_line(e)}") from None

    def _log(self, run_id: str, metrics: Sequence[Any] = (), params: Sequence[Any] = (),
             tags: Sequence[Any] = ()) -> None:
        """`log_batch` in requests under `BATCH_BYTES` (many renamed keys' originals can pass a server's cap)."""
        batch: dict[str, list[Any]] = {"metrics": [], "params": [], "tags": []}
        size = 0
        for kind, items in (("params", params), ("tags", tags), ("metrics", metrics)):
            for item in items:
                n = len(json.dumps([item.key, item.value]))
                if size + n > BATCH_BYTES and any(batch.values()):
                    self.client.log_batch(run_id, **batch)
                    batch, size = {"metrics": [], "params": [], "tags": []}, 0
                batch[kind].append(item)
                size += n
        if any(batch.values()):
            self.client.log_batch(run_id, **batch)

    def _export(self, h: Hypothesis) -> str:
        from mlflow.entities import Metric, Param, RunTag

        # what the repository and the store say of h, read first; then MLflow's names and the writes
        keys = changed_keys(self.workspace, h.base_commit, h.commit)
        direction = label(direction_of(self.workspace, h))
        latest, champion = self.records.latest_verdict(h.id), self._champion(h)
        changed, renamed = _named(keys)
        smoke = {f"smoke.{k}": v for k, v in self.store.smoke_spent(str(h.id)).items() if v}
        metric_values, renamed_metrics = _named(self._metrics(latest, champion, replicate_record(self.store, h.id))
                                                | smoke)
        own = self._tags(h, direction)
        tags = own | renamed | renamed_metrics  # the originals through `_log`: there may be many
        run = self._find(HYP_TAG, str(h.id))
        fresh = run is None
        if run is None:
            run = self.client.create_run(self.experiment_id, tags=own, run_name=f"#{h.id} {h.title}"[:NAME_MAX])
            self.created += 1
        have_params, have_metrics, have_tags = run.data.params, run.data.metrics, run.data.tags
        run_id = run.info.run_id
        now = _ms()
        params = [Param(k, _text(v, PARAM_VALUE_MAX)) for k, v in changed.items() if k not in have_params]
        new_tags = [RunTag(k, v) for k, v in tags.items() if have_tags.get(k) != v]
        metrics = [Metric(k, v, now, 0) for k, v in metric_values.items() if have_metrics.get(k) != v]
        if params or new_tags or metrics:
            self._log(run_id, metrics=metrics, params=params, tags=new_tags)
            if not fresh:
                self.updated += 1
        self._artifacts(run_id, h)
        self._nested(run_id, h)
        status = "FINISHED" if h.status == Status.DONE else "RUNNING"
        if run.info.status != status:
            self.client.update_run(run_id, status=status)
        return run_id

    def _tags(self, h: Hypothesis, direction: str) -> dict[str, str]:
        base_tags = [t for t in self.workspace.baseline_tags() if h.base_commit and
                     self.workspace.repo.commit(t).hexsha == h.base_commit]
        tags = {HYP_TAG: str(h.id), LAB_TAG: self.lab.config.lab.name, "status": h.status,
                "verdict": h.verdict or "", "decision": h.decision or "", "commit": h.commit or "",
                "branch": h.branch or "", "baseline": base_tags[-1] if base_tags else (h.base_commit or "")[:12],
                "origin": h.origin or "", "promoted_tag": h.promoted_tag or "", "title": (h.title or "")[:500],
                "direction": direction[:500]}
        if h.reject_kind:
            tags["reject_kind"] = h.reject_kind
        return {k: _text(v, TAG_VALUE_MAX) for k, v in tags.items()}

    @staticmethod
    def _metrics(latest: Any, champion: dict[str, Any] | None, replication: dict[str, Any] | None = None
                 ) -> dict[str, float]:
        """The gate's latest look (`Records.latest_verdict`), a champion's point and the promotion's
        replication (`[gate] replicate_runs`), as MLflow metrics."""
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
        if champion is not None:
            figures = {"champion.gate_split": champion["gate"], "champion.holdout": champion["holdout"],
                       "champion.gate_split_gain": champion["gate_gain"],
                       "champion.holdout_gain": champion["holdout_gain"]}
            out |= {k: float(v) for k, v in figures.items() if v is not None and math.isfinite(v)}
        if replication is not None:
            figures = {"replication.delta_sigma": replication.get("mean"), "replication.t": replication.get("t"),
                       "replication.passed": 1.0 if replication.get("passed") else 0.0}
            out |= {k: float(v) for k, v in figures.items() if v is not None and math.isfinite(v)}
        return out

    def _artifacts(self, run_id: str, h: Hypothesis) -> None:

        have = {a.path for a in self.client.list_artifacts(run_id)}
        for path in (summary_path(self.lab, h.id), forest_path(self.lab, h.id)):
            name = "summary.md" if path.suffix == ".md" else "forest.png"
            if path.is_file() and name not in have:
                self._log_as(run_id, path, name)

    def _log_as(self, run_id: str, path: Path, name: str) -> None:

        with tempfile.TemporaryDirectory() as tmp:
            dst = Path(tmp) / name
            shutil.copyfile(path, dst)
            self.client.log_artifact(run_id, str(dst))

    def _nested(self, parent: str, h: Hypothesis) -> None:
        from mlflow.entities import Metric, RunTag

        if not h.commit:
            return
        existing = {r.data.tags.get(RUN_TAG): r for r in self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent}'", max_results=5000)}
        (metric,), renamed = _named({self.lab.config.benchmark.metric: None})
        results = self.store.results_for(h.commit)
        gpu = self.store.gpu_by_run(r.run_id for r in results)
        for res in results:
            key = f"{h.commit[:12]}:{res.task}:{res.seed}"
            values = {"cpu_s": float(res.cpu_s)}
            gpu_s, util = gpu.get(res.run_id, (0.0, None))
            if gpu_s:
                values["gpu_s"] = gpu_s
            if util is not None:
                values["gpu_util"] = util
            if res.value is not None and math.isfinite(res.value):
                values[metric] = float(res.value)
            run = existing.get(key)
            if run is None:
                tags = {RUN_TAG: key, "mlflow.parentRunId": parent, "task": _text(res.task, TAG_VALUE_MAX),
                        "seed": str(res.seed), "outcome": res.outcome, HYP_TAG + ".of": str(h.id), **renamed,
                        **({"environment": res.env_id} if res.env_id else {})}  # `pipeline.environment`
                run = self.client.create_run(self.experiment_id, tags=tags,
                                             run_name=f"{res.task} seed {res.seed}"[:NAME_MAX])
                self._log(run.info.run_id, metrics=[Metric(k, v, _ms(), 0) for k, v in values.items()])
                self.client.set_terminated(run.info.run_id)
                self.created += 1
            else:
                stale = [Metric(k, v, _ms(), 0) for k, v in values.items() if run.data.metrics.get(k) != v]
                # a run exported before results recorded their environment gets its tag now
                env = [RunTag("environment", res.env_id)] if res.env_id and run.data.tags.get("environment") != res.env_id else []
                if stale or env:
                    self._log(run.info.run_id, metrics=stale, tags=env)
                    self.updated += 1


def default_tracking_uri(lab: Any) -> str:
    """A SQLite tracking store beside the lab's own (`mlflow ui --backend-store-uri` it to browse)."""
    return f"sqlite:///{lab.state / 'mlflow.db'}"


def _ms() -> int:
    return int(time.time() * 1000)


def export(lab: Any, store: Any, tracking_uri: str, experiment: str | None = None) -> dict[str, Any]:
    return Exporter(lab, store, tracking_uri, experiment).export_all()
