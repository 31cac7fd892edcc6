"""Every error of `pipeline/`, in one place: a small family, one class per way a caller reacts.

    PipelineError                    the root: every error the pipeline raises on purpose (exit code 1)
    ├── UserError                    a user's mistake: one line on the CLI, exit code 2
    │   └── LabConfigError           the lab as configured cannot be used: research.toml (the file, the
    │                                key and what was expected), the lab's own `prepare` failing, a
    │                                store measured on other datasets. The loop stops: the lab's to fix.
    │                                A ValueError too, so research.toml's validators raise it for pydantic
    ├── MethodFailure                the branch's code failed (a stage, its predictions.csv, its smoke
    │                                run): recorded against the hypothesis, fed back for repair at smoke
    ├── InfrastructureFailure        the machinery failed, not the idea (a worker, a cluster, git, the
    │                                store's database, a tracking server): retried, re-queued or said in
    │                                one line, never counted against a hypothesis
    ├── PromotionConflict            a commit does not merge onto the baseline (names the paths)
    ├── Interrupted                  the loop is stopping during a smoke run: no verdict recorded
    └── UnsafeTree                   a tree or path the driver refuses to read or write through
                                     (an OSError too: `pipeline.safefs`)

The sandbox (executors/sandbox.py, standard library only: it travels to Ray nodes as source) raises
plain `OSError`s with an errno: ENODEV for a GPU it cannot bind, EFBIG for an output over its cap.

Each class says its exit code (`exit_code`): the CLI exits with the code of what it caught.

A user's mistake of any other kind (an unknown task or executor, a stage argument into the seal,
`init` refused, a gate, power or gate-sim request that makes no sense, a lab another driver holds)
is a plain `UserError` whose message says what and where: nothing catches those by kind.
Each module re-exports the errors it raises, so `from pipeline.dag import UserError` works too.
"""

from __future__ import annotations

from pathlib import Path


class PipelineError(Exception):
    """The root of every error the pipeline raises on purpose (`except PipelineError` catches them
    all; anything else is a bug or the standard library's)."""

    exit_code = 1


class UserError(PipelineError):
    """Base for mistakes in user input: never shown with a traceback."""

    exit_code = 2


class LabConfigError(UserError, ValueError):
    """The lab as configured cannot be used. `where` (research.toml, or None) and `key` (e.g.
    `benchmark.tasks`, or None) say where when known; `expected` says what is wrong. A validator of
    research.toml raises it without `where` (pydantic wants a ValueError); `parse_config` adds the file."""

    def __init__(self, where: str | Path | None, key: str | None, expected: str):
        self.path = str(where) if where is not None else None
        self.key, self.expected = key, expected
        super().__init__("".join(f"{part}: " for part in (self.path, key) if part) + expected)


class MethodFailure(PipelineError):
    """The branch's own code failed (not the machinery): a stage, its predictions.csv (missing,
    malformed, incomplete, not finite), or its smoke run on tiny data. Recorded against the
    hypothesis; at smoke, the message is fed back to the implementer."""


class InfrastructureFailure(PipelineError, RuntimeError):
    """The machinery failed, not the idea: a worker that cannot start, a cluster or the store's
    database that does not answer, a commit git cannot resolve or check out, a tracking server that
    is down. Retried, re-queued or said in one line; never counted against a hypothesis."""


class PromotionConflict(PipelineError):
    """A hypothesis does not merge onto the baseline (`pipeline.labrepo`): the paths that conflict."""


class Interrupted(PipelineError):
    """The loop was asked to stop during a smoke run: nothing is recorded against the hypothesis (its
    compute is booked, `SmokeExec`), and the next start redoes it. `started` False: it was stopped
    before it held anything (a wait for a share), so it spent nothing."""

    def __init__(self, *args: object, started: bool = True):
        super().__init__(*args)
        self.started = started


class UnsafeTree(PipelineError, OSError):
    """A tree or a path in it that the driver refuses to write or read through (one line)."""

    def __str__(self) -> str:
        return str(self.strerror)
