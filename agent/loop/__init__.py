"""The driver loop behind `autoresearch run`: keeps hypotheses in flight, executes their runs,
enforces budgets and guards, and stops gracefully.

It is deliberately plain, and holds no state of a hypothesis: each hypothesis is its LangGraph
thread (`agent.graph`), and the loop only schedules threads. It picks or proposes hypotheses up to
`max_in_flight`, takes each thread as far as it goes from its checkpoint (to the interrupt that
waits for a look's runs, a human, or a new champion's fresh runs), while the execution layer (the
`Driver` the measurement API gives, `Experiment.driver`, in a thread of its own) works the queue;
when one in-flight look has all its runs, it resumes that thread. After a crash or `kill -9`, a
restart resumes every active thread from its checkpoint; the runs they queued are reconciled by
the execution layer under the same keys.

An LLM outage is infrastructure: a proposal the endpoint could not give creates no hypothesis
(the empty one is withdrawn), a thread that needs the endpoint waits at its node, and the loop
backs off (doubling, capped) while human seeds and runs in flight go on.

The package, one job per module: `scheduler` (`Loop`: which threads run, and when), `threads`
(a thread taken as far as it goes, and what it is given), `guards` (budgets, back-offs, the
plateau), `lease` (the lab's lease, signals, the clock), `reporting` (what the loop says),
`driver_thread` (the execution layer's thread), `options` (`LoopOptions`, the derived in-flight room).
"""

from agent.loop.driver_thread import DriverThread
from agent.loop.guards import ENVIRONMENT_CHANGED, GUARD_BACKOFF_S, GUARD_STREAK, LLM_BACKOFF_S
from agent.loop.options import LoopOptions, choose_policy, in_flight_room
from agent.loop.scheduler import Loop

__all__ = ["ENVIRONMENT_CHANGED", "GUARD_BACKOFF_S", "GUARD_STREAK", "LLM_BACKOFF_S", "DriverThread", "Loop", "LoopOptions", "choose_policy",
           "in_flight_room"]
