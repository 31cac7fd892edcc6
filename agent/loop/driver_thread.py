"""The execution layer's own thread: the driver works the queue while the loop advances hypotheses."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger("autoresearch.loop")

DRIVER_POLL_S = 0.2  # the driver's thread: the longest it waits for a stage result before it claims again


class DriverThread:
    """The execution layer works the queue in a thread of its own: stages are submitted, polled,
    cached and scored while the loop's thread advances hypotheses (a gate, a summary and its
    pictures, a smoke run, an LLM request), so no slot waits for the graph. Only this thread
    drives the driver and its executor, and it closes the driver when halted; the loop meets it
    through the store (it queues runs and reads their status), and asks the driver only whether its
    cluster's environment is gone (`Driver.environment_gone`, which reads the executor under its lock). An error of the driver's is
    re-raised in the loop's thread by `check`, as if the loop had driven the queue itself."""

    def __init__(self, driver: Any, stop: threading.Event):
        self.driver, self.stop = driver, stop
        self._halt = threading.Event()
        self.error: BaseException | None = None
        self.cpu_s = 0.0
        self._thread = threading.Thread(target=self._work, name="autoresearch-driver", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _work(self) -> None:
        t0 = time.thread_time()
        try:
            self.driver.drive(until=self._halt.is_set, stop=self.stop, poll_s=DRIVER_POLL_S)
        except BaseException as e:  # handed to the loop's thread
            self.error = e
        finally:
            self.cpu_s = time.thread_time() - t0  # the driver's own CPU (benchmarks/scale.py reports it per run)
            # closed by this thread, before it ends: a warm worker it started dies with it (PDEATHSIG
            # follows the thread that forked, not the process), so no stage may still be in flight then
            try:
                self.driver.close()
            except BaseException as e:
                log.exception("closing the driver failed")
                self.error = self.error or e

    def check(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        if self.started and not self.alive and not (self._halt.is_set() or self.stop.is_set()):
            raise RuntimeError("the driver thread ended unexpectedly")

    def halt(self) -> None:
        """Stop the thread after its current step and wait until it has closed the driver."""
        self._halt.set()
        while self.started and self.alive:
            self._thread.join(0.5)
