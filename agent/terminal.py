"""What `autoresearch run` shows a person: on a terminal, timestamped lines and a progress bar per
look in flight (runs finished of the look's total, running, an ETA from the measured run times);
piped into a file, plain timestamped lines only (the loop says where the looks stand every 30 s).
At the end, a table of what this run decided. Everything goes to stderr but the closing table.
"""

from __future__ import annotations

import sys
import time
from typing import Any


class RunDisplay:
    def __init__(self, tty: bool | None = None):
        self.tty = sys.stderr.isatty() if tty is None else tty
        self._bars: dict[int, Any] = {}
        self._progress: Any = None
        if self.tty:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self.console = Console(stderr=True, log_path=False)
            self._progress = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[running]} running, ETA {task.fields[eta]}"),
                console=self.console, transient=True)

    # the loop's callbacks -----------------------------------------------------------------------

    def say(self, msg: str) -> None:
        if self.tty:
            self.console.log(msg, markup=False, highlight=False)
        else:
            sys.stderr.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {msg}\n")
            sys.stderr.flush()

    def looks(self, state: dict[int, dict[str, Any]]) -> None:
        """One bar per hypothesis whose look is in flight; a finished look's bar goes."""
        if self._progress is None:
            return
        if state and not self._progress.live.is_started:
            self._progress.start()
        for hid, s in state.items():
            eta = _eta(s.get("eta_s"))
            desc = f"#{hid} look {s['look']}"
            if hid not in self._bars or self._progress.tasks[self._index(hid)].description != desc:
                if hid in self._bars:
                    self._progress.remove_task(self._bars.pop(hid))
                self._bars[hid] = self._progress.add_task(desc, total=s["total"], running=s["running"], eta=eta)
            self._progress.update(self._bars[hid], completed=s["done"], total=s["total"], running=s["running"],
                                  eta=eta)
        for hid in [h for h in self._bars if h not in state]:
            self._progress.remove_task(self._bars.pop(hid))
        if not self._bars and self._progress.live.is_started:
            self._progress.stop()

    def _index(self, hid: int) -> int:
        return next(i for i, t in enumerate(self._progress.tasks) if t.id == self._bars[hid])

    def close(self) -> None:
        if self._progress is not None and self._progress.live.is_started:
            self._progress.stop()

    # the end ------------------------------------------------------------------------------------

    def decided(self, rows: list[dict[str, Any]], stopped: str | None) -> None:
        """The closing table, on stdout: what this run worked on and where each stands."""
        if not rows:
            print("nothing was decided in this run" + (f" (stopped: {stopped})" if stopped else ""))
            return
        if sys.stdout.isatty():
            from rich.console import Console
            from rich.table import Table

            t = Table(title="this run" + (f" (stopped: {stopped})" if stopped else ""))
            for col in ("id", "title", "status", "verdict", "decision", "baseline"):
                t.add_column(col)
            for r in rows:
                t.add_row(str(r["id"]), r["title"] or "", r["status"], r["verdict"] or "-", r["decision"] or "-",
                          r["promoted_tag"] or "")
            Console().print(t)
            return
        width = max(len(r["title"] or "") for r in rows)
        print(f"{'id':>4}  {'title':<{width}}  {'status':<12} {'verdict':<13} {'decision':<9} baseline")
        for r in rows:
            print(f"{r['id']:>4}  {(r['title'] or ''):<{width}}  {r['status']:<12} {r['verdict'] or '-':<13} "
                  f"{r['decision'] or '-':<9} {r['promoted_tag'] or ''}")
        if stopped:
            print(f"stopped: {stopped}")


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"
