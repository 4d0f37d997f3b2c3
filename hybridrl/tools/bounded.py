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
    def __init__(self, *, max_workers: int = 8) -> None:
        self.slots = threading.BoundedSemaphore(max_workers)

    def run(self, calls: Sequence[Callable[[], Any]], *, timeout_s: float) -> list[Outcome]:
        """An outcome per call, in order; the calls start together and each has ``timeout_s`` from the start."""
        futures = [self._start(call) for call in calls]
        deadline = time.monotonic() + timeout_s
        pending = set(futures)
        while pending and (left := deadline - time.monotonic()) > 0:
            _, pending = wait(pending, timeout=left, return_when=FIRST_COMPLETED)
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

    def _start(self, call: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()

        def work() -> None:
            with self.slots:
                if not future.set_running_or_notify_cancel():  # answered as timed out while it waited
                    return
                try:
                    result = call()
                    future.set_result(asyncio.run(result) if inspect.iscoroutine(result) else result)
                except BaseException as e:  # noqa: BLE001  (a SystemExit of a tool is its error too)
                    future.set_exception(e)

        threading.Thread(target=work, daemon=True, name="hybridrl-bounded").start()
        return future
