"""Notifications (`[notify]` in research.toml, `run --notify URL`): tell the humans who are not watching.

Targets: a generic JSON webhook (POST), a Slack-compatible webhook (`{"text": …}`: Slack, Mattermost,
Teams) and e-mail over SMTP (STARTTLS and login when configured). Secrets come from the environment
only (`url_env`, `password_env`) and are never stored, logged or shown: `status` names a target by
its name, kind and host. A URL with user info (`user:password@host`) is refused (`resolve`, at
`run`; `check_urls` for a check without a run); and an error is stored, logged and shown only with every part of every
configured URL that may hold a secret (user info, path and its segments, query and its values,
fragment) and every password replaced by `***` (`Scrubber`). A Slack-compatible target's text is made
inert (`slack_text`): no `@channel`/`<!here>` mention, no disguised link, whatever an LLM-written
title says.

Delivery goes through an outbox in the store (`agent.records.Notification`):

- **Written with the event.** `Records.event` (a loop event: plateau, LLM down/up, guard, takeover,
  disk) and `Records.update` (a hold, a promotion, an abandon after escalation) call the `Outbox`
  inside their own transaction, so the event and its notifications commit together: a `kill -9`
  loses neither. Each row is keyed (event key, target) and unique, so an event is staged once.
- **Sent by a thread** (`Sender`) the loop starts: it never blocks the loop, and every network
  operation has a timeout (`timeout_s`). It claims a row by a state transition in the store
  (pending → sending, attempts + 1), sends it, and marks it sent in one small transaction right after
  the target accepted it. A failure puts it back with an exponential back-off (`backoff_s`, doubling,
  at most `backoff_max_s`); after `max_attempts` it is failed. At most `rate_per_hour` attempts per
  target; `dead_after` failed attempts in a row make the target dead in `status` (and a loop event).
- **Exactly once, with one window.** One driver holds a lab (its lease), so one sender. At start
  it puts back the rows a dead predecessor left in `sending`: they are sent again. That is the one
  window where a notification can arrive twice: the target accepted it and the process died
  before the row was marked sent (a few milliseconds). Every request carries a stable idempotency
  key for the receiver to dedupe: the `Idempotency-Key` header (webhooks) and the `Message-ID`
  (e-mail), the same on every attempt.
- **The daily digest** at `digest_at` (local time) and the **disk check** (the stage cache over 90 %
  of `[run] cache_max_gb`, said at most once a day) are the sender's own timers: the digest's key is
  its date, so a restart does not send it twice.

What is left at exit (a back-off not yet over, a target down) is sent by the next `run`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import urllib.error
from collections import deque
from typing import Any

from sqlalchemy import update
from sqlmodel import select

from agent.config import agent_config
from agent.lifecycle import Decision, Review, Status
from agent.notify_delivery import Scrubber, deliver
from agent.notify_targets import Target, targets
from agent.records import ACTIVE, LoopEvent, Notification, NotifyTargetState, Records

log = logging.getLogger("autoresearch.notify")

TICK_S = 1.0  # the sender's poll when nothing wakes it
DISK_CHECK_S = 60.0
DISK_SHARE = 0.9
DISK_REPEAT_S = 86400.0  # the disk warning at most once a day
FLUSH_S = 10.0  # at close: how long the loop waits for due notifications to go out

TITLES = {
    "plateau": "plateau", "llm_down": "LLM unreachable", "llm_up": "LLM reachable again",
    "guard": "guard: proposals held back", "takeover": "driver takeover", "disk": "disk near its cap",
    "budget": "budget", "reverified": "champion re-verified", "error": "error in a hypothesis",
    "notify_dead": "a notification target is dead", "environment": "measurement environment",
}


SUBJECT_MAX = 200
STALE_CLAIM_TIMEOUTS = 10  # a claim older than this many timeouts is a sender that died mid-attempt


def one_line(text: str) -> str:
    """A subject: an LLM-written title may hold line breaks, which an e-mail header refuses."""
    return " ".join(text.split())[:SUBJECT_MAX]


# ----------------------------------------------------------------------------- what to say

def _hyp_line(h: Any) -> str:
    return f"#{h.id} {h.title!r}"


class Outbox:
    """The writing half: turns loop events and hypothesis transitions into outbox rows, inside the
    caller's transaction (`Records.event`, `Records.update`)."""

    def __init__(self, lab: Any, config: Any, targets_: list[Target]):
        self.lab_name = lab.config.lab.name
        self.first_look = lab.config.gate.looks[0]
        self.web_url = (config.web_url or "").rstrip("/") or None
        self.targets = targets_
        self.woken = threading.Event()

    def wake(self) -> None:
        self.woken.set()

    def stage(self, s: Any, kind: str, key: str, subject: str, body: str, link: str | None = None) -> bool:
        """Add a row per target that wants `kind`, unless the event was staged already (a node run
        again after a crash). True if any was added."""
        wanted = [t for t in self.targets if kind in t.events]
        if not wanted:
            return False
        have = set(s.exec(select(Notification.target).where(Notification.key == key)))
        added = False
        for t in wanted:
            if t.id not in have:
                s.add(Notification(key=key, target=t.id, kind=kind, subject=one_line(f"[{self.lab_name}] {subject}"),
                                   body=body, link=link))
                added = True
        return added

    def on_event(self, s: Any, ev: LoopEvent) -> bool:
        if ev.kind not in TITLES:
            return False
        first = ev.message.split(":", 1)[0] if ev.kind == "plateau" else TITLES[ev.kind]
        return self.stage(s, ev.kind, f"event:{ev.id}", first, ev.message)

    def on_update(self, s: Any, before: dict[str, Any], h: Any) -> bool:
        staged = False
        # a held hypothesis awaits its reviewer once its review is pending (after its replication, if it has one)
        if h.status == Status.HELD and h.review == Review.PENDING and (before["status"], before["review"]) != (
                Status.HELD, Review.PENDING):
            link = self._link(h)
            body = (f"{_hyp_line(h)} awaits review: verdict {h.verdict} at {h.look} runs.\n"
                    f"{h.rationale_decision or ''}\n"
                    f"Review: {link or 'autoresearch serve'}, or autoresearch review {h.id} --approve / --reject")
            # once per base: a hold re-based onto a new baseline and held again is news to its reviewer
            key = f"hold:{h.id}" + (f"@{h.base_commit[:12]}" if h.base_commit else "")
            staged |= self.stage(s, "hold", key, f"#{h.id} held for review: {h.title}", body, link)
        if h.promoted_tag and not before["promoted_tag"]:
            body = (f"{_hyp_line(h)} promoted to the baseline as {h.promoted_tag}: verdict {h.verdict} at {h.look} "
                    f"runs.\n{h.rationale_decision or ''}")
            staged |= self.stage(s, "promote", f"promote:{h.id}", f"#{h.id} promoted ({h.promoted_tag}): {h.title}",
                                 body, self._link(h))
        if h.decision == Decision.ABANDON and before["decision"] != Decision.ABANDON and (h.look or 0) > self.first_look:
            body = (f"{_hyp_line(h)} abandoned after escalation to {h.look} runs: verdict {h.verdict}.\n"
                    f"{h.rationale_decision or ''}")
            staged |= self.stage(s, "abandon", f"abandon:{h.id}", f"#{h.id} abandoned after escalation: {h.title}",
                                 body, self._link(h))
        return staged

    def _link(self, h: Any) -> str | None:
        return f"{self.web_url}/hypotheses/{h.id}" if self.web_url else None


def digest_text(records: Records, store: Any, since: float) -> str:
    """The daily digest, in a few lines (`autoresearch digest` has the full one)."""

    hyps = records.briefs()
    recent = [h for h in hyps if (h.finished_at or h.updated_at) >= since]
    done = [h for h in recent if h.status == Status.DONE]
    lines = [f"The last 24 h: {len(recent)} hypotheses tried."]
    for label, group in (("promoted", [h for h in done if h.promoted_tag]),
                         ("abandoned", [h for h in done if h.decision in (Decision.ABANDON, Decision.REFINE)]),
                         ("rejected", [h for h in done if h.decision == Decision.REJECT])):
        if group:
            lines.append(f"{label}: " + "; ".join(_hyp_line(h) + (f" → {h.promoted_tag}" if h.promoted_tag else "")
                                                 for h in group))
    active = [h for h in hyps if h.status in ACTIVE]
    if active:
        lines.append("in flight: " + "; ".join(f"{_hyp_line(h)} ({h.status})" for h in active))
    pending = [h for h in hyps if h.review == Review.PENDING]
    lines.append(f"awaiting review: {', '.join(f'#{h.id}' for h in pending) or 'none'}")
    lines.append(f"measured in a row without a promotion: {records.since_promotion()}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- sending

class Sender:
    """The delivering half: a daemon thread working the outbox (see the module's docstring)."""

    def __init__(self, lab: Any, store: Any, records: Records, outbox: Outbox, config: Any):
        self.lab, self.store, self.records, self.outbox, self.cfg = lab, store, records, outbox, config
        self.targets = {t.id: t for t in outbox.targets}
        self.scrub = Scrubber(outbox.targets)
        self.sent_at: dict[str, deque[float]] = {t: deque() for t in self.targets}
        self.stopping = threading.Event()
        self.next_disk = 0.0
        self.flush_until = 0.0
        self.thread = threading.Thread(target=self._run, name="autoresearch-notify", daemon=True)

    def start(self) -> "Sender":
        self._recover()
        self.thread.start()
        return self

    def close(self, flush_s: float = FLUSH_S) -> None:
        """Stop, after giving due notifications up to `flush_s` to go out (the rest wait for the next run)."""
        self.flush_until = time.monotonic() + flush_s
        self.stopping.set()
        self.outbox.wake()
        self.thread.join(flush_s + self.cfg.timeout_s * 2 + 1)
        if self.thread.is_alive():  # an attempt still under way: its row stays claimed, the next run resends it
            log.warning("notifications: a send was still under way at exit; it is retried at the next start")

    # --- the store --------------------------------------------------------------------------------

    def _recover(self) -> None:
        """Rows a dead sender left claimed go back to pending (the one window: they may have arrived),
        and each target's state row exists; the rate window is refilled from the store."""
        with self.store.session() as s:
            s.exec(update(Notification).where(Notification.state == "sending").values(state="pending"))
            for t in self.targets.values():
                row = s.get(NotifyTargetState, t.id)
                if row is None:
                    s.add(NotifyTargetState(target=t.id, kind=t.kind, where=t.where))
                else:
                    row.kind, row.where = t.kind, t.where
                    s.add(row)
            hour = time.time() - 3600
            for tid, at in s.exec(select(Notification.target, Notification.claimed_at).where(
                    Notification.claimed_at >= hour)):  # type: ignore[operator]
                if tid in self.sent_at and at is not None:
                    self.sent_at[tid].append(at)
            s.commit()
        for q in self.sent_at.values():
            ordered = sorted(q)
            q.clear()
            q.extend(ordered)

    def _due(self) -> list[Notification]:
        with self.store.session() as s:
            # a claim left by an attempt that never finished (the store failed as it ended) goes back
            stale = time.time() - STALE_CLAIM_TIMEOUTS * self.cfg.timeout_s
            s.exec(update(Notification).where(Notification.state == "sending", Notification.claimed_at < stale)
                   .values(state="pending"))
            # a target whose hourly allowance is spent is left out, so it never holds the others back
            spent = [tid for tid, window in self.sent_at.items() if self._spent(window)]
            s.commit()
            open_targets = [tid for tid in self.targets if tid not in spent]
            q = (select(Notification).where(Notification.state == "pending", Notification.next_at <= time.time(),
                                            Notification.target.in_(open_targets))  # type: ignore[attr-defined]
                 .order_by(Notification.id).limit(50))
            return list(s.exec(q))

    def _spent(self, window: deque[float]) -> bool:
        """Whether a target's attempts in the last hour reached `rate_per_hour` (the window is trimmed)."""
        while window and window[0] < time.time() - 3600:
            window.popleft()
        return len(window) >= self.cfg.rate_per_hour

    def _claim(self, row: Notification) -> bool:
        with self.store.session() as s:
            res = s.exec(update(Notification).where(Notification.id == row.id, Notification.state == "pending")
                         .values(state="sending", attempts=Notification.attempts + 1, claimed_at=time.time()))
            s.commit()
            return res.rowcount == 1

    def _done(self, row: Notification, t: Target, error: str | None) -> None:
        now = time.time()
        attempts = row.attempts + 1
        with self.store.session() as s:
            if error is None:
                s.exec(update(Notification).where(Notification.id == row.id, Notification.state == "sending")
                       .values(state="sent", sent_at=now, last_error=None))
            else:
                gave_up = attempts >= self.cfg.max_attempts
                wait = min(self.cfg.backoff_max_s, self.cfg.backoff_s * 2 ** (attempts - 1))
                s.exec(update(Notification).where(Notification.id == row.id, Notification.state == "sending")
                       .values(state="failed" if gave_up else "pending", next_at=now + wait, last_error=error))
            st = s.get(NotifyTargetState, t.id) or NotifyTargetState(target=t.id, kind=t.kind, where=t.where)
            became_dead = False
            if error is None:
                st.fails_in_row, st.failing_since, st.last_ok_at, st.dead = 0, None, now, False
            else:
                st.fails_in_row += 1
                st.failing_since = st.failing_since or now
                st.last_error = error
                became_dead = not st.dead and st.fails_in_row >= self.cfg.dead_after
                st.dead = st.dead or became_dead
            s.add(st)
            s.commit()
        if became_dead:
            self.records.event("notify_dead", f"notification target {t.id} ({t.kind}, {t.where}) is dead: "
                                              f"{st.fails_in_row} failed attempts in a row ({error})")

    # --- the thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            stopping = self.stopping.is_set()
            try:
                if not stopping:
                    self._timers()
                self._send_due(flush=stopping)
            except Exception as e:  # a database hiccup: the next tick retries; the loop goes on
                log.warning("notifications: %s: %s", type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
            if stopping:
                return
            self.outbox.woken.wait(TICK_S)
            self.outbox.woken.clear()

    def _send_due(self, flush: bool = False) -> None:

        for row in self._due():
            if flush and time.monotonic() > self.flush_until:
                return
            if self.stopping.is_set() and not flush:
                return
            t = self.targets[row.target]
            window = self.sent_at[t.id]
            if self._spent(window):
                continue  # this target's hourly allowance is spent: the row waits
            if not self._claim(row):
                continue
            window.append(time.time())
            try:
                deliver(t, row, self.outbox.lab_name, self.cfg.timeout_s)
                error = None
            except urllib.error.HTTPError as e:
                error = self.scrub(f"HTTP {e.code} {e.reason}")
            except Exception as e:  # refused, timed out, TLS, SMTP refusals: all a failed attempt
                error = self.scrub(f"{type(e).__name__}: {e}")
            self._done(row, t, error)
            if error:
                log.warning("notification %s to %s failed (attempt %d): %s", row.key, t.id, row.attempts + 1, error)

    def _timers(self) -> None:
        wants = {k for t in self.targets.values() for k in t.events}
        if "digest" in wants and self.cfg.digest_at:
            self._digest()
        if "disk" in wants and time.monotonic() >= self.next_disk:
            self.next_disk = time.monotonic() + DISK_CHECK_S
            self._disk()

    def _digest(self) -> None:
        """Once a local day, at or after `digest_at`; keyed by the date, so never twice."""
        hh, mm = (int(x) for x in self.cfg.digest_at.split(":"))
        now = time.localtime()
        if (now.tm_hour, now.tm_min) < (hh, mm):
            return
        key = f"digest:{time.strftime('%Y-%m-%d', now)}"
        with self.store.session() as s:
            if s.exec(select(Notification.id).where(Notification.key == key)).first() is not None:
                return
        text = digest_text(self.records, self.store, time.time() - 86400)
        with self.store.session() as s:
            if self.outbox.stage(s, "digest", key, f"daily digest {key.split(':')[1]}", text,
                                 self.outbox.web_url):
                s.commit()

    def _disk(self) -> None:
        cap_gb = self.lab.config.run.cache_max_gb
        if cap_gb is None:
            return
        used, cap = self.store.cache_bytes(), cap_gb * (1 << 30)
        if used <= DISK_SHARE * cap:
            return
        last = self.records.last_event(("disk",))
        if last is not None and time.time() - last.created_at < DISK_REPEAT_S:
            return
        self.records.event("disk", f"disk: the stage cache holds {used / (1 << 30):.3g} GB, {used / cap:.0%} of "
                                   f"[run] cache_max_gb = {cap_gb:g} (entries the baseline and runs in flight "
                                   "need are never evicted)")


def attach(lab: Any, store: Any, records: Records, cli_urls: list[str] | None = None,
           env: dict[str, str] | None = None) -> Sender | None:
    """The loop's notifications: the outbox on `records` and its sender started; None if no target."""

    cfg = agent_config(lab).notify
    ts = targets(cfg, list(cli_urls or []), dict(os.environ) if env is None else env)
    if not ts:
        return None
    outbox = Outbox(lab, cfg, ts)
    records.outbox = outbox
    return Sender(lab, store, records, outbox, cfg).start()


# ----------------------------------------------------------------------------- status

def status(store: Any) -> dict[str, Any]:
    """Per target seen in this store: counts by state, whether it is dead and since when (no secrets)."""
    from sqlalchemy import func

    with store.session() as s:
        counts: dict[str, dict[str, int]] = {}
        for tid, state, n in s.exec(select(Notification.target, Notification.state, func.count())
                                    .group_by(Notification.target, Notification.state)):
            counts.setdefault(tid, {})[state] = n
        states = {r.target: r for r in s.exec(select(NotifyTargetState))}
    out = []
    for tid in sorted(set(counts) | set(states)):
        st, c = states.get(tid), counts.get(tid, {})
        out.append({"target": tid, "kind": st.kind if st else None, "where": st.where if st else None,
                    "sent": c.get("sent", 0), "pending": c.get("pending", 0) + c.get("sending", 0),
                    "failed": c.get("failed", 0), "dead": bool(st and st.dead),
                    "fails_in_row": st.fails_in_row if st else 0,
                    "failing_since": st.failing_since if st else None,
                    "last_error": st.last_error if st else None})
    return {"targets": out, "dead": [t["target"] for t in out if t["dead"]]}


def status_lines(notify: dict[str, Any]) -> list[str]:
    lines = []
    for t in notify.get("targets", []):
        counts = f"{t['sent']} sent, {t['pending']} pending, {t['failed']} failed"
        if t["dead"]:
            since = time.strftime("%Y-%m-%d %H:%M", time.localtime(t["failing_since"] or 0))
            lines.append(f"notify: {t['target']} ({t['kind']}, {t['where']}) DEAD: {t['fails_in_row']} failed "
                         f"attempts in a row since {since} ({t['last_error']}); {counts}")
        else:
            lines.append(f"notify: {t['target']} ({t['kind']}, {t['where']}) ok; {counts}")
    return lines
