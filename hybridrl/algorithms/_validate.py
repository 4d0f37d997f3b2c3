"""One way for algorithm ``Config.__post_init__`` checks to word an invalid value.

The registry prefixes the message with the plugin name and config key, so the message itself
names the field, the value and what would be valid.
"""

from __future__ import annotations

from typing import Any


def require(ok: bool, field: str, value: Any, valid: str) -> None:
    """Raise ``ValueError`` naming ``field`` unless ``ok``; write checks so NaN fails them."""
    if not ok:
        raise ValueError(f"{field}={value!r} is invalid; valid: {valid}")
