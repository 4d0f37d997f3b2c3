"""Calls that run at once, each within a time limit, and never raise: tool calls and environment steps.

Each call runs in a daemon thread, at most ``max_workers`` at a time; a coroutine function's coroutine runs in an
event loop of its own there. A call past the limit is answered as timed out at once; its thread is abandoned
(Python cannot stop a thread), keeps its slot until it returns and never holds up the process's exit (a daemon), so
work that can hang for good should run in a subprocess it can kill (as the ``python`` tool does).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, kw_only=True)
class Outcome:
    value: Any = None
    error: BaseException | None = None  # what the call raised
    timed_out: bool = False


class Bounded:
    def __init__(self, *, max_workers: int = 32) -> None:
        self.slots = threading.BoundedSemaphore(max_workers)

    def run(self, calls: Sequence[Callable[[], Any]], *, timeout_s: float) -> list[Outcome]:
        """An outcome per call, in order. The calls start together, as far as ``max_workers`` allows; each has
        ``timeout_s`` from when it starts running (a call queued behind others does not lose its time)."""
        began: dict[int, float] = {}  # call -> when it got its slot (written by its thread)
        futures = [self._start(call, began, i) for i, call in enumerate(calls)]

        def over(i: int, now: float) -> bool:
            return i in began and now - began[i] >= timeout_s

        while True:
            now = time.monotonic()
            pending = [f for i, f in enumerate(futures) if not f.done() and not over(i, now)]
            if not pending:
                break
            first_end = min((began[i] + timeout_s for i, f in enumerate(futures) if not f.done() and i in began),
                            default=now + _POLL_S)
            wait(pending, timeout=max(0.0, min(first_end - now, _POLL_S)), return_when=FIRST_COMPLETED)
        out = []
        for future in futures:
            if not future.done():
                future.cancel()
                out.append(Outcome(timed_out=True))
            elif (e := future.exception()) is not None:
                out.append(Outcome(error=e))
            else:
                out.append(Outcome(value=future.result()))
        return out

    def _start(self, call: Callable[[], Any], began: dict[int, float], i: int) -> Future[Any]:
        future: Future[Any] = Future()

        def work() -> None:
            with self.slots:
                if not future.set_running_or_notify_cancel():  # answered as timed out while it waited
                    return
                began[i] = time.monotonic()
                try:
                    result = call()
                    future.set_result(asyncio.run(result) if inspect.iscoroutine(result) else result)
                except BaseException as e:  # noqa: BLE001  (a SystemExit of a tool is its error too)
                    future.set_exception(e)

        threading.Thread(target=work, daemon=True, name="hybridrl-bounded").start()
        return future


_POLL_S = 0.05  # how often queued calls are looked at
