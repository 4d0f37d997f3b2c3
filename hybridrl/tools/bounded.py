"""Calls that run at once, each within a time limit, and never hang the caller: tool calls and environment
``open()``/``step()``/``close()``.

Each call runs in a daemon thread, at most ``max_workers`` at a time; a coroutine function's coroutine runs in an
event loop of its own there. Each call's limit counts from when it starts running (a call queued behind others
does not lose its time). A call past its limit is answered as timed out at once **and gives its worker slot back
then**, so calls that hang for good never hold up later ones: a round of N calls that all hang costs at most
``ceil(N / max_workers)`` limits, on every step, however many hung before.

What becomes of a call past its limit:

- a coroutine is cancelled in its loop: one hung in an ``await`` (a socket, a sleep, a subprocess) ends there,
  and its thread with it;
- a synchronous call cannot be stopped (Python cannot kill a thread): it is *abandoned*, its thread runs on
  holding no slot until the call returns (a daemon: it never holds up the process's exit).

Why threads rather than killable worker processes for synchronous calls: a tool would have to be rebuilt in each
worker from its entry point (losing in-process state such as a client's connection pool), every argument and
result pickled, and each worker would import hybridrl and the plugin; and a hang is a bug of the tool, which a
coroutine tool (cancelled) or a tool that runs its risky work in a subprocess it kills (the ``python`` tool does)
does not have. The price is the abandoned threads, which are bounded: at most :data:`MAX_STUCK` per process, over
all tools and environments. Starting a round while that many abandoned calls still run raises
:class:`StuckCallsError`, naming the callers and their limit's key — a tool that never returns stops the run with
that message after ``MAX_STUCK`` hung calls rather than growing threads until the OS refuses one (threads count
against the kernel's ``pid_max``, 32768 by default, shared by every rank of the node). A warning comes at a
quarter of it. Abandoned calls that return at last (slow, not hung) stop counting.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hybridrl.tracking import say

MAX_STUCK = 2048  # abandoned calls still running, per process, before the run stops (StuckCallsError)


@dataclass(slots=True, kw_only=True)
class Outcome:
    value: Any = None
    error: BaseException | None = None  # what the call raised
    timed_out: bool = False


class StuckCallsError(RuntimeError):
    """Too many calls past their limit still run in abandoned threads: something hangs for good."""


@dataclass(slots=True, eq=False, kw_only=True)
class _Call:
    fn: Callable[[], Any]
    stuck_as: str  # how it is named among the stuck calls: "tool 'x' (…tool_timeout_s=3)"
    state: str = "queued"  # queued → running → done | abandoned
    began: float = 0.0
    outcome: Outcome | None = None
    cancel: Callable[[], None] | None = None  # cancels a running coroutine's task


_stuck_lock = threading.Lock()
_stuck: Counter[str] = Counter()  # callers -> their abandoned calls still running, in this process
_warned = False


def stuck() -> dict[str, int]:
    """This process's abandoned calls that still run, by caller."""
    with _stuck_lock:
        return {k: v for k, v in _stuck.items() if v > 0}


def _stick(name: str) -> None:
    global _warned
    with _stuck_lock:
        _stuck[name] += 1
        total = sum(_stuck.values())
        warn, _warned = not _warned and total >= MAX_STUCK // 4, _warned or total >= MAX_STUCK // 4
    if warn:
        say(f"warning: {total} calls past their time limit still run in abandoned threads ({_describe()}); the "
            f"run stops at {MAX_STUCK} (hybridrl/tools/bounded.py)")


def _unstick(name: str) -> None:
    with _stuck_lock:
        _stuck[name] -= 1


def _describe() -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(stuck().items(), key=lambda kv: -kv[1]))


class Bounded:
    """``key``: the config key of the limit its callers pass (named in :class:`StuckCallsError`)."""

    def __init__(self, *, key: str, max_workers: int = 32) -> None:
        self.key = key
        self.slots = threading.BoundedSemaphore(max_workers)
        self._changed = threading.Condition()

    def run(self, calls: Sequence[Callable[[], Any]], *, timeout_s: float,
            names: Sequence[str] | None = None) -> list[Outcome]:
        """An outcome per call, in order. The calls start together, as far as ``max_workers`` allows; each has
        ``timeout_s`` from when it starts running. ``names``: each call's caller ("tool 'x'"), for the stuck count.
        Raises :class:`StuckCallsError` (running nothing) while :data:`MAX_STUCK` abandoned calls still run."""
        if (total := sum(stuck().values())) >= MAX_STUCK:
            raise StuckCallsError(
                f"{total} calls past their time limit still run in abandoned threads ({_describe()}): they never "
                "returned, and Python cannot stop a thread. A tool's or environment's call must end within its "
                f"limit ({self.key}={timeout_s:g}): give its blocking I/O a timeout, make it a coroutine function "
                "(cancelled at the limit), or run its work in a subprocess that it kills at the limit (as the "
                "python tool does)")
        names = names if names is not None else ["a call"] * len(calls)
        items = [_Call(fn=fn, stuck_as=f"{name} ({self.key}={timeout_s:g})") for fn, name in zip(calls, names,
                                                                                               strict=True)]
        for c in items:
            threading.Thread(target=self._work, args=(c,), daemon=True, name="hybridrl-bounded").start()
        with self._changed:
            while True:
                now = time.monotonic()
                for c in items:
                    if c.state == "running" and now - c.began >= timeout_s:
                        self._abandon(c)
                running = [c.began + timeout_s for c in items if c.state == "running"]
                if all(c.outcome is not None for c in items):
                    return [c.outcome for c in items if c.outcome is not None]
                self._changed.wait(timeout=max(0.0, min(running) - now) if running else None)

    def _abandon(self, c: _Call) -> None:
        """Answer ``c`` as timed out and give its slot back (the lock is held)."""
        c.state, c.outcome = "abandoned", Outcome(timed_out=True)
        self.slots.release()
        _stick(c.stuck_as)
        if c.cancel is not None:
            c.cancel()

    def _work(self, c: _Call) -> None:
        self.slots.acquire()
        with self._changed:
            c.state, c.began = "running", time.monotonic()
            self._changed.notify_all()
        try:
            outcome = Outcome(value=self._call(c))
        except BaseException as e:  # noqa: BLE001  (a SystemExit of a tool is its error too)
            outcome = Outcome(error=e)
        with self._changed:
            if c.state == "abandoned":  # answered as timed out already; its slot was given back then
                _unstick(c.stuck_as)
            else:
                c.state, c.outcome = "done", outcome
                self.slots.release()
                self._changed.notify_all()

    def _call(self, c: _Call) -> Any:
        result = c.fn()
        if not inspect.iscoroutine(result):
            return result
        loop = asyncio.new_event_loop()
        try:
            task = loop.create_task(result)
            with self._changed:
                if c.state == "abandoned":
                    task.cancel()
                else:
                    c.cancel = lambda: loop.call_soon_threadsafe(task.cancel)
            return loop.run_until_complete(task)
        finally:
            with self._changed:
                c.cancel = None  # the loop closes: nothing may be scheduled on it from now on
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
