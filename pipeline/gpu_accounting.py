"""The GPU side of the driver's books: what the executor's GPU sampler saw, written to the store every
few seconds (`gpu_usage`: the loop's GPU busy %), and what it says of a stage's GPUs (NVML's mean
utilisation while it ran; an attempt lost to a CUDA out-of-memory on a shared GPU, booked as lost
to infrastructure)."""

from __future__ import annotations

import time
from typing import Any

from pipeline.outcomes import StageOutcome


GPU_USAGE_ROW_S = 60.0  # the sampler's intervals are added to one row of the store for this long

OOM_ALONE_DETAIL = "CUDA out of memory on a GPU shared with other stages; run again alone"  # the lost attempt's row


class GpuAccounting:
    """`pipeline.runner.Driver`'s GPU accounting (its `executor`, `store`, `_gpu_usage_*` counters)."""

    def _record_gpu_usage_every(self, every_s: float) -> bool:
        """Write the GPU sampler's totals if `every_s` passed since the last time: whether it was time."""
        if time.monotonic() - self._gpu_usage_at > every_s:
            self._gpu_usage_at = time.monotonic()
            self._record_gpu_usage()
            return True
        return False

    def _record_gpu_usage(self, last: bool = False) -> None:
        """What the executor's GPU sampler saw since the last call, as one row of the store (`last`:
        the driver closes, the executor may wait a moment for its latest samples)."""
        sampled = getattr(self.executor, "gpu_usage", None)  # optional in the protocol: an executor may sample nothing
        usage = (sampled(wait=True) if last else sampled()) if sampled is not None else None
        if usage is None:
            return
        totals = (int(usage["samples"]), int(usage["busy"]), float(usage["util_sum"]))  # type: ignore[arg-type]
        last = self._gpu_usage_totals
        if totals[0] > last[0]:
            # a row a minute, written every few seconds: a month of 5-s rows was 500k rows, 80 MB
            row, since = self._gpu_usage_row
            extend = row if row is not None and time.time() - since < GPU_USAGE_ROW_S else None
            row_id = self.store.gpu_usage_add(str(usage["holder"]), list(usage["gpus"]),  # type: ignore[arg-type]
                                              self._gpu_usage_since, totals[0] - last[0], totals[1] - last[1],
                                              totals[2] - last[2], extend=extend)
            if row_id != row:
                self._gpu_usage_row = (row_id, self._gpu_usage_since)
            self._gpu_usage_totals, self._gpu_usage_since = totals, time.time()

    def _record_gpu_extra(self, fl: Any, res: Any) -> None:
        """What the executor says of the stage's GPUs: NVML's mean utilisation while it ran, and an
        attempt lost to a CUDA out-of-memory on a shared GPU (its own row, lost to infrastructure)."""
        if res.extra.get("gpu_util") is not None:
            self.store.stage_gpu_used(fl.exec_id, float(res.extra["gpu_util"]), int(res.extra.get("gpu_samples", 0)))
        lost = res.extra.get("gpu_oom_retried_alone")
        if lost:
            eid = self.store.stage_started(fl.lead, fl.node.name, fl.node.key, executor=self.executor.name,
                                           log_path=str(fl.job.log_path))
            self.store.stage_finished(eid, StageOutcome.INFRA, cpu_s=lost["cpu_s"], wall_s=lost["wall_s"],
                                      gpu_s=lost["gpu_s"], host=res.host,
                                      detail=OOM_ALONE_DETAIL)
