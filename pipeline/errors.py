"""Errors a user can cause. The CLI turns each into one line on stderr and exit code 2."""


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
