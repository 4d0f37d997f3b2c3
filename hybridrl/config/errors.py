"""The errors of what a user gave — config, data files, checkpoints — as opposed to bugs.

A :class:`UserError` ends a run with its message alone (exit code 2, no traceback unless ``HYBRIDRL_DEBUG=1``:
:mod:`hybridrl.trainers.entry`); every other exception keeps its traceback. Config errors report every
violation at once, each naming its key; data and checkpoint errors name the file and row, line or step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class ConfigIssue:
    key: str  # dotted config key that causes the violation
    value: Any
    message: str  # what is wrong and what would be valid

    def __str__(self) -> str:
        if self.value is None:
            return f"{self.key}: {self.message}"
        return f"{self.key}={self.value!r}: {self.message}"


class UserError(ValueError):
    """A mistake in the run's input, said in one message that names the key, file, row or checkpoint and what to do."""


class DataError(UserError):
    """A data file's problem found while reading its rows (a bad byte at line N, an over-long prompt, a missing
    key): the message names the file and the row or line."""


class CheckpointError(UserError):
    """Checkpoints that ``trainer.resume`` cannot use; the message names them and how to start over."""


class ConfigError(UserError):
    """Raised with all violations found, before any model or engine is built."""

    def __init__(self, issues: list[ConfigIssue]) -> None:
        self.issues = list(issues)
        n = len(self.issues)
        lines = "\n".join(f"  - {i}" for i in self.issues)
        super().__init__(f"{n} problem{'s' if n != 1 else ''} in the config:\n{lines}")


class Issues(list[ConfigIssue]):
    """The one collector of a validation pass: every owner of a rule adds its problems, each with its key."""

    def add(self, key: str, value: object, message: str) -> None:
        self.append(ConfigIssue(key=key, value=value, message=message))

    def positive(self, key: str, value: int | float) -> None:
        if value < 1:
            self.add(key, value, "must be ≥ 1")
