"""Running a reward manager so that a hung one cannot hang the trainer: a per-batch time limit.

The call runs in a daemon thread; past ``timeout_s`` the trainer raises ``TimeoutError`` naming the
reward (the hung thread is abandoned, and dies with the process). Raised errors pass through with the
plugin named. A plugin that must be killable mid-call (C extensions holding the GIL, subprocesses)
needs a process of its own; that is a separate execution mode.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def call_with_timeout(fn: Callable[[Any], Any], arg: Any, *, timeout_s: float | None, what: str) -> Any:
    """``fn(arg)``, or ``TimeoutError`` naming ``what`` after ``timeout_s`` seconds (None: no limit)."""
    if timeout_s is None:
        return fn(arg)
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(arg)
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    worker = threading.Thread(target=run, name=f"hybridrl {what}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise TimeoutError(f"{what}: scoring one batch took longer than {timeout_s} s; the reward is stuck or too "
                           "slow (raise reward.timeout_s, or null for no limit)")
    if "error" in box:
        raise RuntimeError(f"{what} raised {type(box['error']).__name__}: {box['error']}") from box["error"]
    return box["value"]
