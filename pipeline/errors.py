"""Every error of `pipeline/`, in one place: a small family, one class per way a caller reacts.

    PipelineError                    the root: every error the pipeline raises on purpose (exit code 1)
    ├── UserError                    a user's mistake: one line on the CLI, exit code 2
    │   ├── LabConfigError           research.toml: names the file, the key and what was expected
    │   ├── KeyedConfigError         what a validator of research.toml found, with its key (a
    │   │                            ValueError too: pydantic reports it as LabConfigError)
    │   ├── HarnessCommandError      the lab's own `prepare` failed (the loop stops: the lab's to fix)
    │   └── MixedDatasets            a comparison would mix datasets (the loop stops: use a fresh store)
    ├── ServiceUnavailable           a service does not answer (the store's database, a Ray
    │                                cluster): one line, exit code 1
    ├── MethodFailure                the branch's code failed: recorded against the hypothesis
    │   ├── PredictionsError         predictions.csv unusable: a method failure of the run
    │   └── SmokeFailed              a candidate's pipeline failed on tiny data (fed back for repair)
    ├── InfrastructureFailure        the machinery failed, not the idea: retried or re-queued
    │   ├── ExecutorError            an executor cannot work (worker, cluster)
    │   └── WorktreeError            a commit cannot be resolved or checked out
    ├── PromotionConflict            a commit does not merge onto the baseline (names the paths)
    ├── Interrupted                  the loop is stopping during a smoke run: nothing is recorded
    └── UnsafeTree                   a tree or path the driver refuses to read or write through
                                     (an OSError too: `pipeline.safefs`)

    SandboxError, OutputTooLarge (OSErrors) live in executors/sandbox.py, which must stay
    standard-library only and self-contained (it travels to Ray nodes as source).

Each class says its exit code (`exit_code`): the CLI exits with the code of what it caught.

A user's mistake of any other kind (an unknown task or executor, a stage argument into the seal,
`init` refused, a gate, power or gate-sim request that makes no sense, a lab another driver holds)
is a plain `UserError` whose message says what and where: nothing catches those by kind.
Each module re-exports the errors it raises, so `from pipeline.dag import UserError` works too.
"""

class PipelineError(Exception):
    """The root of every error the pipeline raises on purpose (`except PipelineError` catches them
    all; anything else is a bug or the standard library's)."""

    exit_code = 1


class UserError(PipelineError):
    """Base for mistakes in user input: never shown with a traceback."""

    exit_code = 2


class LabConfigError(UserError):
    """research.toml (or the lab around it) is malformed: names the file, the key and what is expected."""

    def __init__(self, path: str, key: str, expected: str):
        self.path, self.key, self.expected = str(path), key, expected
        where = f"{self.path}: {key}: " if key else f"{self.path}: "
        super().__init__(where + expected)


class KeyedConfigError(UserError, ValueError):
    """A problem a validator of research.toml found, with the key it is about (`parse_config` makes it
    a `LabConfigError` naming the file; a ValueError, so pydantic's validators report it)."""

    def __init__(self, key: str, expected: str):
        self.key = key
        super().__init__(expected)


class HarnessCommandError(UserError):
    """The lab's own `prepare` failed: its code or its data, not a hypothesis."""


class MethodFailure(PipelineError):
    """The branch's own code failed (not the machinery): recorded against the hypothesis."""


class InfrastructureFailure(PipelineError, RuntimeError):
    """The machinery failed, not the idea (a worker, a cluster, git, the database): retried,
    re-queued or said, never counted against a hypothesis."""


class PredictionsError(MethodFailure):
    """predictions.csv is missing, malformed, incomplete or not finite: a method failure of the run."""


class SmokeFailed(MethodFailure):
    """The candidate's pipeline failed on tiny data; the message is fed back to the implementer."""


class Interrupted(PipelineError):
    """The loop was asked to stop during a smoke run: nothing is recorded, the next start redoes it."""


class ExecutorError(InfrastructureFailure):
    """The executor itself cannot work (worker cannot start, cluster unreachable)."""


class WorktreeError(InfrastructureFailure):
    """A commit cannot be resolved or checked out."""


class PromotionConflict(PipelineError):
    """A hypothesis does not merge onto the baseline (`pipeline.labrepo`): the paths that conflict."""


class ServiceUnavailable(PipelineError):
    """A service the command needs cannot be reached (the store's database, a Ray cluster): one
    line on the CLI, exit code 1."""


class UnsafeTree(PipelineError, OSError):
    """A tree or a path in it that the driver refuses to write or read through (one line)."""

    def __str__(self) -> str:
        return str(self.strerror)


class MixedDatasets(UserError):
    """A comparison would mix runs measured on different datasets (a new generator version,
    data_seed, size or trusted commit under an old store): refused, never judged."""


