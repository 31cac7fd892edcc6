"""Every error of `pipeline/`, in one place. Users' mistakes are `UserError`s: the CLI prints them
as one line and exits 2. The others are the pipeline's own conditions, caught where they mean
something (a method failure, an infrastructure failure).

    Exception
    ├── UserError                    one line, exit code 2
    │   ├── LabConfigError           research.toml: file, key, what was expected
    │   ├── LabNotFoundError         --repo is not a lab
    │   ├── UnknownTaskError
    │   ├── InitError                `init` refused
    │   ├── UnknownExecutorError     --executor names none
    │   ├── SandboxUnavailable       the kernel refuses the sandbox; the lab did not opt out
    │   ├── HarnessCommandError      the lab's own `prepare` failed
    │   ├── SealedPathError          a stage argument points into the seal
    │   ├── StageCommandError        a stage command cannot be rendered
    │   ├── GateInputError, PowerInputError, SimInputError
    │   └── LabBusy                  another live driver holds the lab's lease
    ├── ServiceUnavailable           one line, exit code 1: a service does not answer
    │   ├── StoreUnavailable         the store's database
    │   └── RayUnavailable           the Ray cluster at --ray-address
    ├── PredictionsError             predictions.csv unusable: a method failure of the run
    ├── SmokeFailed                  a candidate's pipeline failed on tiny data (fed back for repair)
    ├── Interrupted                  the loop is stopping during a smoke run
    ├── RuntimeError
    │   ├── ExecutorError            an executor cannot work (worker, cluster)
    │   ├── WorktreeError            a commit cannot be resolved or checked out
    │   │   └── UnknownCommitError
    │   └── StoreError               the database cannot be opened or is not ours
    └── OSError
        └── SandboxError, OutputTooLarge   in executors/sandbox.py, which must stay standard-library
                                           only (it travels to Ray nodes as source)

Each module re-exports the errors it raises, so `from pipeline.dag import SealedPathError` works too.
"""

class UserError(Exception):
    """Base for mistakes in user input: never shown with a traceback."""


class LabConfigError(UserError):
    """research.toml (or the lab around it) is malformed: names the file, the key and what is expected."""

    def __init__(self, path: str, key: str, expected: str):
        self.path, self.key, self.expected = str(path), key, expected
        where = f"{self.path}: {key}: " if key else f"{self.path}: "
        super().__init__(where + expected)


class UnknownTaskError(UserError):
    """A task name that the harness's suite does not have."""


class LabNotFoundError(UserError):
    """The --repo directory is not a lab (no research.toml)."""


class InitError(UserError):
    """`autoresearch init` refused: the target exists and is not empty, or is not writable."""


class SimInputError(UserError):
    """A gate-sim request that cannot be simulated (names the flag and what is expected)."""


class GateInputError(UserError):
    """The gate was given runs or settings it cannot judge (names the field and what is expected)."""


class PowerInputError(UserError):
    """A power / MDE request that makes no sense (σ ≤ 0, α outside (0, 1), fewer than 2 runs...)."""


class HarnessCommandError(UserError):
    """The lab's own `prepare` failed: its code or its data, not a hypothesis."""


class SealedPathError(UserError):
    """A stage command would hand the branch's code a path into the sealed test labels."""


class StageCommandError(UserError):
    """A stage command cannot be parsed or references a value the run does not have."""


class UnknownExecutorError(UserError):
    """`--executor` names no executor."""


class SandboxUnavailable(UserError):
    """The kernel refuses the namespaces the sandbox needs; the lab did not opt out."""


class PredictionsError(Exception):
    """predictions.csv is missing, malformed, incomplete or not finite: a method failure of the run."""


class SmokeFailed(Exception):
    """The candidate's pipeline failed on tiny data; the message is fed back to the implementer."""


class Interrupted(Exception):
    """The loop was asked to stop during a smoke run: nothing is recorded, the next start redoes it."""


class ExecutorError(RuntimeError):
    """The executor itself cannot work (worker cannot start, cluster unreachable)."""


class WorktreeError(RuntimeError):
    """A commit cannot be resolved or checked out."""


class UnknownCommitError(WorktreeError):
    """The revision names no commit in the lab's repository."""


class ServiceUnavailable(Exception):
    """A service the command needs cannot be reached (the store's database, a Ray cluster): one
    line on the CLI, exit code 1."""


class StoreUnavailable(ServiceUnavailable):
    """The store's database does not answer."""


class RayUnavailable(ServiceUnavailable):
    """No Ray cluster at the address given."""


class MixedDatasets(UserError):
    """A comparison would mix runs measured on different datasets (a new generator version,
    data_seed, size or trusted commit under an old store): refused, never judged."""


class LabBusy(UserError):
    """Another live driver holds this lab's lease."""


class StoreError(RuntimeError):
    """The database could not be opened or does not hold what the store expects."""
