"""Config errors that report every violation at once, each naming its key."""

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


class ConfigError(ValueError):
    """Raised with all violations found, before any model or engine is built."""

    def __init__(self, issues: list[ConfigIssue]) -> None:
        self.issues = list(issues)
        n = len(self.issues)
        lines = "\n".join(f"  - {i}" for i in self.issues)
        super().__init__(f"{n} problem{'s' if n != 1 else ''} in the config:\n{lines}")
