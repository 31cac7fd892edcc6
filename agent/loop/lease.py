"""The loop's hold on its lab: the lease (one driver per lab), the signals that stop it, the clock
of `--hours`."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

from pipeline.api import lease

LEASE_HEARTBEAT_S = 5.0


class LeaseAndClock:
    """`Loop`'s part that takes and keeps the lab's lease and stops on a signal or the deadline."""

    def _release_lease(self) -> None:
        self.heartbeat.stop()
        lease.release(self.store, self.owner)

    def _take_lease(self) -> None:
        """One driver per lab (`pipeline.lease`): take it, or a dead holder's; refresh it while we live."""
        self.owner = lease.Owner.current()
        dead = lease.acquire(self.store, self.owner)
        if dead is not None:
            self._took_over = (f"took over the lab from pid {dead.pid} on {dead.host}, which died "
                               f"(its last heartbeat {time.time() - dead.heartbeat_at:.0f} s ago)")
            self.say(self._took_over)  # a loop event too, once the records are open

        def lost() -> None:
            if not self.stop.is_set():
                self.say("this driver lost the lab's lease to another (it stalled past the lease's staleness): stopping")
                self.stop_reason = "lease lost"
                self.stop.set()

        # the process's one heartbeat: the lease's and, once the driver runs, its runs' (`lease.Heartbeat`)
        self.heartbeat = lease.Heartbeat(self.store, self.owner, LEASE_HEARTBEAT_S, holds_lease=True,
                                         on_lost=lost).start()

    # -------------------------------------------------------------- signals

    def install_signals(self) -> None:
        def handler(signum: int, _frame: Any) -> None:
            if self.stop.is_set():  # a second signal: stop waiting for anything (runs are re-queued)
                raise KeyboardInterrupt
            self.say(f"received {signal.Signals(signum).name}: finishing what can finish, re-queueing the rest")
            self.stop_reason = "signal"
            self.stop.set()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)


    def _start_clock(self) -> threading.Timer | None:
        """`--hours`: at the deadline the loop stops as on SIGTERM, in the middle of a look if need be
        (runs in flight finish or are re-queued; the next start resumes the hypotheses)."""
        if self.opts.hours is None:
            return None

        def deadline() -> None:
            if not self.stop.is_set():
                msg = f"time budget of {self.opts.hours:g} h reached: finishing what can finish, re-queueing the rest"
                self.records.event("budget", msg)
                self.say(msg)
                self.stop_reason = "time budget"
                self.stop.set()

        timer = threading.Timer(max(0.0, self.t0 + self.opts.hours * 3600 - time.monotonic()), deadline)
        timer.daemon = True
        timer.start()
        return timer
