"""The ``sglang`` rollout engine's processes: they never outlive the trainer, and their death is an error.

Process-wide bookkeeping for every SGLang engine started in this (trainer) process:

- :func:`starting` marks an engine start in progress: a failing engine child then raises
  :class:`SGLangEngineError` at once (through :func:`on_sigquit`, SGLang's ``custom_sigquit_handler``).
- :func:`supervise` (after start) and :func:`release` (at shutdown) keep the list of live engines that
  an ``atexit`` hook and the SIGTERM/SIGINT handlers shut down — exactly their processes, then the
  trainer does what it did before (dies by the signal by default).
- :func:`on_sigquit`: an SGLang child SIGQUITs the trainer when it fails. Instead of SGLang's SIGKILL of
  the whole process tree, the engine call in progress (or the next one) raises the error.
- :func:`deadline` and :func:`thread_env` bound the start and set the threads the processes start with.

Nothing here imports sglang; taking SGLang's signal handlers back is :mod:`hybridrl.rollout.engines.sglang_compat`'s.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from hybridrl.rollout.engines import processes
from hybridrl.rollout.engines import sglang_compat as compat
from hybridrl.rollout.engines.processes import alive  # noqa: F401  (the engine asks this module)

SIGQUIT_GRACE_S = 10.0  # how long a SIGQUIT waits for the failing engine process to be gone


class SGLangEngineError(RuntimeError):
    """The SGLang engine failed to start, crashed, timed out or refused a request."""


class SupervisedEngine(Protocol):
    """What supervision needs of an engine (:class:`hybridrl.rollout.engines.sglang.SGLangRolloutEngine`)."""

    engine: Any  # SGLang's ``Engine``; None once shut down
    procs: list[Any]  # psutil.Process of the engine's own processes
    failure: str | None  # set here when one of them died

    def describe(self) -> str: ...

    def shutdown(self) -> None: ...


_LIVE: dict[int, SupervisedEngine] = {}
_STARTING: set[int] = set()


@contextmanager
def starting(engine: SupervisedEngine) -> Iterator[None]:
    """While ``engine`` starts, a SIGQUIT from an engine child raises :class:`SGLangEngineError`."""
    _STARTING.add(id(engine))
    try:
        yield
    finally:
        _STARTING.discard(id(engine))


def supervise(engine: SupervisedEngine) -> None:
    """After start: ``engine``'s processes die with the trainer, and their death raises in it."""
    _LIVE[id(engine)] = engine
    processes.shut_down_at_exit(engine, engine.shutdown)
    compat.take_back_signals(engine.engine, {signal.SIGTERM: processes.on_terminate, signal.SIGQUIT: on_sigquit})


def release(engine: SupervisedEngine) -> None:
    """At shutdown: ``engine`` is no longer supervised."""
    _LIVE.pop(id(engine), None)
    processes.forget(engine)


def _shutdown_all() -> None:
    for engine in list(_LIVE.values()):
        engine.shutdown()


def on_sigquit(signum: int, frame: Any) -> None:
    """An SGLang child sends SIGQUIT to the trainer when it fails: fail loudly instead of SGLang's SIGKILL.

    The child sends it *before* it exits (with code 0, which SGLang's own watchdog then takes for a
    clean exit), so wait a little for an engine process to be gone before deciding. Inside an engine
    call the handler runs as a callback of the engine's event loop, which would swallow an exception:
    there it cancels the call, which then raises the error.
    """
    if _STARTING:
        raise SGLangEngineError("an SGLang engine process failed during start (see its log above)")
    engines = list(_LIVE.values())
    deadline_at = time.monotonic() + SIGQUIT_GRACE_S
    dead: list[tuple[SupervisedEngine, Any]] = []
    while engines and not dead and time.monotonic() < deadline_at:
        dead = [(e, p) for e in engines for p in e.procs if not alive(p)]
        if not dead:
            time.sleep(0.1)
    if not dead:
        return  # no engine process died: a stray SIGQUIT (e.g. from a child being shut down) is ignored
    message = (f"SGLang engine process(es) {[p.pid for _, p in dead]} died (see their log above); "
               f"engine config: {dead[0][0].describe()}")
    running = [e.engine.loop for e in engines if e.engine is not None and e.engine.loop.is_running()]
    for engine in engines:
        engine.failure = message
    _shutdown_all()
    if not running:
        raise SGLangEngineError(message)
    for loop in running:
        for task in asyncio.all_tasks(loop):
            task.cancel()


class deadline:  # noqa: N801 - used as a context manager
    """Raise ``TimeoutError`` in the main thread after ``seconds`` (SIGALRM; no limit off the main thread)."""

    def __init__(self, seconds: float | None, *, what: str) -> None:
        self.seconds, self.what = seconds, what
        self.armed = seconds is not None and threading.current_thread() is threading.main_thread()

    def __enter__(self) -> None:
        if self.armed:
            self.previous = signal.signal(signal.SIGALRM, self._fire)
            signal.setitimer(signal.ITIMER_REAL, float(self.seconds))  # type: ignore[arg-type]

    def _fire(self, signum: int, frame: Any) -> None:
        raise TimeoutError(f"SGLang {self.what} took longer than {self.seconds} s")

    def __exit__(self, *exc: object) -> None:
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)


@contextmanager
def thread_env(threads: int) -> Iterator[None]:
    """Start the engine's processes with ``OMP_NUM_THREADS=threads`` (they read it when they start).

    On a CPU shared with the trainer, OpenMP's default (all cores) makes the scheduler's threads spin
    against the other processes: 50x slower generation was measured on 2 cores.
    """
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        yield
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved
