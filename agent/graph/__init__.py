"""One LangGraph graph per hypothesis: propose → implement → evaluate ⇄ decide → [promote] → summarize
→ [reverify]; decide → summarize → hold → promote (a held promotion); promote → evaluate when a
re-based hypothesis is measured again.

The graph is the hypothesis's one state machine. Its state carries the lifecycle: `phase` (a
`Status`), `look` and `verdict`, and the champion a promotion made until it is re-verified. Each
node does one step and returns the state's update through `Nodes._to`, which projects it onto the
hypothesis's row in the same step (`agent.lifecycle.project`, the one writer of `status`); where
the thread goes next is the named routers' (`GraphSpec`), from the state alone. The thread (id =
hypothesis id) is checkpointed after every node and, after any stop, crash or `kill -9`, resumed
from that checkpoint — never started over. The facts of a step (branches, tags, runs, gate
records, the summary) live in the store and git, keyed, and come before the projection: a node that
died half-way is simply run again, and one that died after its projection (the row a step ahead of
the checkpoint) takes the row's update without doing its step twice (`_replayed`).

A thread waits in four places, each a LangGraph `interrupt()` kept in its checkpoint:
- `evaluate`, for the runs of a look (`{"kind": "look", "runs": [...]}`): the driver loop
  (`agent.loop`) executes runs for every hypothesis in flight and resumes the thread with
  `Command(resume="finished")` once they are all in;
- `hold`, for a human (`{"kind": "hold"}`): a held promotion (`--supervised`, or a result too
  good to be true); `review --approve/--reject` records the answer and the loop resumes the thread
  with `Command(resume="approve"|"reject")`. With a replication step it first waits there for the
  replication's runs, as `promote` does (a pass resumed from that wait that reaches the human's
  question ends there: the runs' "finished" is never read as the reviewer's answer);
- `promote`, for the runs of a promotion's replication (`[gate] replicate_runs`; `{"kind": "look",
  "replication": true, "runs": [...]}`): queued at the decision, judged here (or at `hold`); a
  promotion whose gain is not there again is abandoned;
- `reverify`, after a promotion's summary, for the new champion's runs on fresh seeds
  (`{"kind": "look", "champion": tag, "runs": [...]}`); the thread ends when how it held up is
  recorded. The hypothesis is `done` (decided) while its thread waits there.
Promotion happens in the `promote` node only, and only against the baseline the hypothesis was
measured with: one whose base moved meanwhile (several hypotheses in flight) is re-based there,

The package, one job per module: `state` (the thread's `State`, the `Services` a graph runs with),
`step` (what every node shares: `Step._to`, the one projection of a step onto the row),
`context` (what the policy reads), `implement` (edits → checks → smoke → commit), `nodes` (the
other nodes), `promotion` (promote, re-base, re-verify, the queue of a look), `spec` (the routers,
the one phase → node table, `GraphSpec`, the thread's start and end), `checkpointer`.
"""

from agent.graph.checkpointer import open_checkpointer
from agent.graph.context import build_context, plateau_of, proposal_context, search_key_costs
from agent.graph.implement import check_not_measured, experiment_message
from agent.graph.nodes import Nodes, allowed_decisions, reverification_message
from agent.graph.promotion import (base_moved, promote, queue_look, queue_rank, queue_refinement, rebase,
                                   rebased_note, reverification, withdraw_replication)
from agent.graph.spec import (END, ENTRY_PHASES, NODE_OF_PHASE, GraphSpec, build_graph, claim, from_start, give_up,
                              graph_spec, open_proposal, thread_input)
from agent.graph.state import HOLD, LOOK, Services, State

__all__ = ["END", "ENTRY_PHASES", "HOLD", "LOOK", "NODE_OF_PHASE", "GraphSpec", "Nodes", "Services", "State",
           "allowed_decisions", "base_moved", "build_context", "build_graph", "check_not_measured", "claim",
           "experiment_message", "from_start", "give_up", "graph_spec", "open_checkpointer", "open_proposal",
           "plateau_of", "promote", "proposal_context", "queue_look", "queue_rank", "queue_refinement", "rebase",
           "rebased_note", "reverification", "reverification_message", "search_key_costs", "thread_input",
           "withdraw_replication"]
