"""What holds the loop back: the time and count budgets, the failure streak's back-off, the LLM's
budget and outage back-off, the plateau; and which hypothesis starts next under them."""

from __future__ import annotations

import time
from typing import Any

from agent.config import agent_config
from agent.errors import BudgetExceeded, LLMError
from agent.graph import claim, open_proposal, plateau_of
from agent.lifecycle import Decision, Status
from agent.policy import llm_client
from agent.records import Hypothesis

GUARD_STREAK = 3  # hypotheses in a row rejected or failing before the loop backs off
GUARD_BACKOFF_S = 600.0
LLM_BACKOFF_S = (5.0, 300.0)  # the first and the longest wait before asking an unreachable endpoint again
ENV_CHECK_S = 60.0  # how often the loop looks whether the installed packages changed under it (0.1 s a look)
CLUSTER_ENV_CHECK_S = 10.0  # how often it asks a cluster whether its environment's nodes are all gone
ENVIRONMENT_CHANGED = "environment changed"  # the loop's stop reason then (`run` exits with code 3)


class Guards:
    """`Loop`'s budgets and guards."""

    def out_of_time(self) -> bool:
        return self.opts.hours is not None and time.monotonic() - self.t0 > self.opts.hours * 3600

    def count_left(self) -> bool:
        return self.opts.forever or self.opts.max_hypotheses is None or self.started < self.opts.max_hypotheses

    def blocked(self) -> bool:
        """A guard holds new proposals back: the failure streak's back-off, or the LLM's daily budget
        or outage. Each holds back only proposals: human seeds still start (issue 20)."""
        return self.guard_holds() or self.llm_blocked()

    def guard_holds(self) -> bool:
        """The failure streak's back-off is in force (it holds proposals, never human seeds)."""
        return time.time() < self.backoff_until

    def llm_blocked(self) -> bool:
        if llm_client(self.policy) is None:
            return False
        return time.time() < self.llm_retry_at or self.llm_budget_spent()

    def may_start(self) -> bool:
        """Whether a new hypothesis may start now: a seed, or a proposal if no guard holds proposals
        back (`next_hypothesis` decides which)."""
        if self.stop.is_set() or self.out_of_time():
            return False
        return self.count_left()

    def llm_budget_spent(self) -> bool:
        """Whether today's LLM spend reached a cap (dollars, or tokens); said once (in `status` too)
        when it does."""
        client = llm_client(self.policy)
        reached = getattr(client, "budget_reached", None) if client is not None else None
        why = reached() if reached is not None else None
        if why is None:
            self._budget_said = False
            return False
        if not self._budget_said:
            self._budget_said = True
            msg = f"{why}; no new hypothesis until the cap resets at UTC midnight"
            self.records.event("budget", msg)
            self.say(msg)
        return True

    def environment_moved(self, driver: Any) -> bool:
        """Whether the measurement environment on this machine changed under the running loop (a
        `pip install -U torch` into its venv): looked at every ENV_CHECK_S. Its warm workers hold the
        old modules and import the new ones, so no run measured from now on would be one
        environment's: the loop stops (`stop_reason` "environment changed", an `environment` event;
        `run` exits with code 3) and its next start re-measures the baseline in the new one. Only
        where the driver's stages run on this machine (on Ray the nodes report theirs per result, and
        the loop stops the same way when every node of the driver's environment is gone while nodes of
        another live: `Driver.environment_gone`)."""
        from pipeline.api import environment_change, environment_facts

        if not driver.measures_here:  # on a cluster: its nodes of the driver's environment all gone, others live
            if time.monotonic() - self._env_checked < CLUSTER_ENV_CHECK_S:
                return False
            self._env_checked = time.monotonic()
            why = driver.environment_gone()
            if why is None:
                return False
            msg = (f"the cluster's environment changed under the running loop ({why}): stopping; start it again to "
                   "measure in the cluster's environment (the baseline is re-measured then)")
            return self._environment_stop(msg)
        if time.monotonic() - self._env_checked < ENV_CHECK_S:
            return False
        running = driver.environment
        self._env_checked = time.monotonic()
        now = self.lab.config.run.environment_of(environment_facts())
        if now.id == running.id:
            return False
        return self._environment_stop(
            f"the environment changed under the running loop ({environment_change(running, now)}): stopping; "
            "start it again to measure in the new one (the baseline is re-measured then)")

    def _environment_stop(self, msg: str) -> bool:
        self.records.event("environment", msg)
        self.say(msg)
        self.stop_reason = ENVIRONMENT_CHANGED
        self.stop.set()
        return True

    def plateau(self) -> bool:
        """`[agent] plateau_after` measured hypotheses in a row without a promotion: said once per
        baseline (an event in `status` and the digest); True when reached."""
        n = plateau_of(self.svc)
        if n is None:
            return False
        after = agent_config(self.lab).agent.plateau_after
        base = self.svc.workspace.baseline_head()
        said = [e for e in self.records.events(50) if e.kind == "plateau"]
        if not any(base[:10] in e.message for e in said):
            msg = (f"plateau: {n} measured hypotheses in a row without a promotion (baseline {base[:10]}, "
                   f"[agent] plateau_after = {after}); the LLM policy is told so in its next proposal")
            self.records.event("plateau", msg)
            self.say(msg)
        # a human seed queued is the new direction the pause asks for: it runs (and counts, if it fails)
        if self.opts.pause_on_plateau and not self.stop.is_set() and self.records.next_queued() is None:
            self.stop_reason = "plateau"
            self.say("stopping: --pause-on-plateau (seed a new direction, then run again)")
            self.stop.set()
        return True

    def guard(self) -> None:
        """Back off after GUARD_STREAK hypotheses in a row that never produced evidence."""
        streak, last = 0, None
        for h in self.records.done_newest_first():
            last = h.finished_at if last is None else last
            failed = h.decision == Decision.REJECT and h.reject_kind not in ("exhausted",)
            if not failed and h.verdict is not None:
                fr = self._failure_report(h)
                failed = bool(fr and fr.get("not_promising"))
            if not failed:
                break
            streak += 1
        if streak >= GUARD_STREAK and time.time() >= self.backoff_until:
            last = last or 0
            if time.time() - last < GUARD_BACKOFF_S:
                self.backoff_until = last + GUARD_BACKOFF_S
                msg = (f"guard: {streak} hypotheses in a row were rejected or failed their runs; "
                       f"no new proposal until {time.strftime('%H:%M:%S', time.localtime(self.backoff_until))} "
                       "(human seeds still start)")
                self.records.event("guard", msg)
                self.say(msg)

    def _failure_report(self, h: Hypothesis) -> dict | None:
        g = self.records.latest_verdict(h.id)
        return g.failures.model_dump(mode="json") if g is not None else None

    # -------------------------------------------------------------- hypotheses

    def next_hypothesis(self) -> Hypothesis | None:
        held = self.guard_holds()
        if held:  # a human seed is never held back by the guard; the policy's own follow-ups (queued) are
            seeds = [x for x in self.records.all((Status.QUEUED,)) if x.origin == "human"]
            h = min(seeds, key=lambda x: (-x.priority, x.id or 0), default=None)
        else:
            h = self.records.next_queued()
        if h is not None:  # taken off the queue: its thread starts at its first node
            return claim(self.records, h)
        if held or self.llm_blocked():
            return None
        base = self.svc.workspace.baseline_head()
        if self.records.exhausted(self.policy.name, base):
            return None  # nothing untried around this baseline; wait for human seeds or a new baseline
        return open_proposal(self.records, self.policy.name)  # an empty one: its thread proposes

    def _llm_failed(self, h: Hypothesis, e: LLMError) -> Hypothesis:
        """The endpoint down or refusing requests (`LLMUnavailable`, or `LLMError` itself: the request refused), or the
        budget spent, where a thread needs an answer (an answer that is garbage is the nodes' to
        record). A proposal that did not come is no hypothesis: the empty one is withdrawn (row and
        thread). Otherwise the thread waits at its node. The endpoint is asked again after a back-off."""
        h = self.records.get(h.id)
        now = time.time()
        if not h.title:
            self.records.delete(h.id)
            self.checkpointer.delete_thread(str(h.id))
            self.started -= 1
        else:
            self.llm_waiting.add(h.id)
        if isinstance(e, BudgetExceeded):
            self.llm_budget_spent()  # says it once; the budget, not a back-off, holds proposals now
            return h
        self.llm_backoff_s = min(LLM_BACKOFF_S[1], max(LLM_BACKOFF_S[0], self.llm_backoff_s * 2))
        self.llm_retry_at = now + self.llm_backoff_s
        retry = time.strftime("%H:%M:%S", time.localtime(self.llm_retry_at))
        if self.llm_down_since is None:
            self.llm_down_since = now
            self.records.event("llm_down", f"LLM unreachable: {e}")
        self.say(f"LLM unreachable since {time.strftime('%H:%M:%S', time.localtime(self.llm_down_since))}"
                 f" ({e}); next try at {retry}")
        return h

    def _llm_back(self) -> None:
        """The endpoint answered: said once, whoever saw it go down (this process or one before it)."""
        from agent.commands import llm_unreachable_since

        since = self.llm_down_since or llm_unreachable_since(self.records)
        if since is None:
            return
        down = time.time() - since
        self.llm_down_since, self.llm_backoff_s, self.llm_retry_at = None, 0.0, 0.0
        msg = f"LLM reachable again after {down:.0f} s"
        self.records.event("llm_up", msg)
        self.say(msg)
