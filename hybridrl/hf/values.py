"""Reading numbers out of a HF ``config.json``: each check raises ``ValueError`` naming where the value came from."""

from __future__ import annotations

from typing import Any


def positive_int(value: Any, where: str) -> int:
    """``value`` as an int ≥ 1 (a whole float too, as JSON may write it)."""
    whole = isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer()
    if not whole or value < 1:
        raise ValueError(f"{where}={value!r} must be an integer ≥ 1")
    return int(value)


def number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}={value!r} must be a number")
    return float(value)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
