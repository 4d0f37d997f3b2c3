"""An engine's own processes: finding them, killing exactly them, starting them without the trainer's torchrun
environment, and a watcher that kills them when the trainer dies — by SIGKILL too.

Shared by the engines that run in processes of their own (``sglang``, ``vllm``). Nothing here imports an engine.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridrl import preemption

if TYPE_CHECKING:
    import psutil

REAPER = Path(__file__).with_name("reaper.py")  # run as a script: it imports psutil only, not hybridrl

TORCHRUN_ENV = ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_ERROR_FILE", "MASTER_ADDR", "MASTER_PORT", "RANK",
                "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME",
                "ROLE_RANK", "ROLE_WORLD_SIZE")


@contextmanager
def without_torchrun_env() -> Iterator[None]:
    """Start an engine's processes without the trainer's torchrun variables (they describe the trainer's world, not
    the engine's: an engine that reads ``MASTER_PORT``, ``LOCAL_RANK`` or the agent store joins the wrong world or
    hangs); restore them after."""
    saved = {k: os.environ.pop(k) for k in TORCHRUN_ENV if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


@contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` updated with ``values`` inside (read by the processes started there); restored after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def new_children(before: set[int]) -> list[psutil.Process]:
    """The processes this process started since ``before`` (pids), without multiprocessing's resource tracker."""
    import psutil

    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.pid not in before and "resource_tracker" not in " ".join(child.cmdline()):
                out.append(child)
        except psutil.NoSuchProcess:
            pass
    return out


def kill_processes(procs: list[psutil.Process], *, grace_s: float = 3.0) -> None:
    """SIGTERM ``procs`` (and their children), SIGKILL what is left after ``grace_s``; reap them."""
    import psutil

    everyone: dict[int, psutil.Process] = {}
    for proc in procs:
        try:
            everyone[proc.pid] = proc
            everyone.update({c.pid: c for c in proc.children(recursive=True)})
        except psutil.NoSuchProcess:
            pass
    alive = list(everyone.values())
    for proc in alive:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(alive, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)


def start_reaper(procs: list[psutil.Process]) -> subprocess.Popen[bytes] | None:
    """A watcher process that SIGKILLs ``procs`` (and their children) as soon as this process is gone, however it
    died; it exits by itself once they are gone. ``atexit`` and signal handlers cannot cover a SIGKILLed trainer,
    and an engine process may outlive its parent for minutes, ignoring SIGTERM (vLLM's EngineCore does).

    It runs in a session of its own, so a signal to the trainer's process group does not end it first."""
    if not procs:
        return None
    args = [sys.executable, str(REAPER), str(os.getpid())] + [f"{p.pid}:{p.create_time()!r}" for p in procs]
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, start_new_session=True, close_fds=True)


def stop_reaper(reaper: subprocess.Popen[bytes] | None) -> None:
    """End a watcher whose processes were shut down cleanly."""
    if reaper is not None and reaper.poll() is None:
        reaper.kill()
        reaper.wait()


def alive(proc: psutil.Process) -> bool:
    """Whether the psutil process ``proc`` still runs (a zombie does not)."""
    import psutil

    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


_AT_EXIT: dict[int, Callable[[], None]] = {}  # id(owner) -> its shutdown
_PREVIOUS: dict[int, Any] = {}  # the trainer's own SIGTERM/SIGINT handlers


def shut_down_at_exit(owner: object, shutdown: Callable[[], None]) -> None:
    """Call ``shutdown`` at interpreter exit and on SIGTERM/SIGINT (after which the trainer does what it did before:
    by default, die by the signal) unless :func:`forget` came first."""
    _AT_EXIT[id(owner)] = shutdown
    preemption.before_hard_exit(shut_down_all_now)
    if _PREVIOUS or threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGINT):
        _PREVIOUS[signum] = signal.getsignal(signum)
        if not preemption.defers(_PREVIOUS[signum]):  # a preempted run still generates: shut down at exit only
            signal.signal(signum, on_terminate)
    atexit.register(_shutdown_all)


def forget(owner: object) -> None:
    _AT_EXIT.pop(id(owner), None)


def _shutdown_all() -> None:
    for shutdown in list(_AT_EXIT.values()):
        shutdown()


def shut_down_all_now() -> None:
    """Every registered shutdown, now (a process about to ``os._exit``: no atexit hook will run)."""
    _shutdown_all()


def on_terminate(signum: int, frame: Any) -> None:
    """SIGTERM/SIGINT: every registered shutdown, then what the trainer did before (by default: die by it)."""
    _shutdown_all()
    previous = _PREVIOUS.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
