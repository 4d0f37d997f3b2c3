"""Preemption: a SIGTERM (or SIGUSR1) stops the run at the next step boundary, with a checkpoint, exit code 0.

Slurm preempts a job, or ends it at its time limit, by sending SIGTERM to its processes and SIGKILL after a grace
period (``GraceTime`` / ``KillWait``, typically 30–90 s; ``sbatch --signal=SIG@T`` sends SIG ``T`` s earlier);
torchrun forwards a SIGTERM it gets to every rank and SIGKILLs them ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` s later
(30 by default). Each rank therefore only *notes* the signal (any number of times, in any order across ranks):

- at the top of every step the trainer ranks agree (one flag all-reduce, the step guards' :func:`agree`) whether
  any of them was signalled; if so the last finished step is saved — unless its periodic save just did — and the
  loop ends: the run exits 0 and ``trainer.resume=auto`` continues from that checkpoint, bitwise as if never
  stopped. The step in flight when the signal came finishes first (the safe point; a step's state is only whole
  at its end);
- a watchdog bounds it: if the rank is still running ``trainer.preempt_grace_s`` after its first signal (the step
  or the save took too long), it says which step it was at, shuts its engines down and exits 143 (128 + SIGTERM)
  before the SIGKILL would come, the checkpoint being left as the last committed one (a half-written save is
  scratch that the next start removes).

A killed launcher (``kill -9`` of torchrun, an OOM kill of its agent) ends the run too, within seconds: under
torchrun each rank watches its parent, the agent, from :func:`install` on (:func:`watch_launcher`); once it is gone
the rank says so, shuts its engines down and exits :data:`EXIT_CODE_ORPHANED` without a checkpoint (nothing of the
launcher is left to restart, log or stop the ranks, and its store may be gone). Engine processes that outlive a
shutdown are killed by their watcher (:mod:`hybridrl.rollout.engines.reaper`) when the rank is gone.

Colocated SGLang/vLLM engines keep running until the process exits (:mod:`hybridrl.rollout.engines.processes` defers
their shutdown-on-SIGTERM to this module), so a generation in flight completes. Engine ranks of a disaggregated
placement note the signal the same way and end when the trainer tells them to.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from hybridrl.tracking import say

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
EXIT_CODE_TOO_LATE = 128 + signal.SIGTERM
EXIT_CODE_ORPHANED = 128 + signal.SIGHUP  # the launcher is gone (as a shell's jobs end when its terminal hangs up)
LAUNCHER_POLL_S = 0.2
SHUTDOWN_S = 5.0  # the engines' shutdown when the launcher is gone; their watcher kills what is left after


class Preemption:
    """The signals this process received, and the watchdog they started."""

    def __init__(self, *, grace_s: float) -> None:
        self.grace_s = grace_s
        self.signalled_at: float | None = None
        self.signal_name = ""
        self.where = "before the first step"  # for the watchdog's message
        self._done = threading.Event()

    def note(self, signum: int, _frame: Any = None) -> None:
        """The signal handler: remember the first signal, start the watchdog; never raises, never blocks."""
        if self.signalled_at is not None:
            return
        self.signalled_at, self.signal_name = time.monotonic(), signal.Signals(signum).name
        os.write(2, f"[hybridrl] {self.signal_name}: stopping at the next step boundary with a checkpoint "
                    f"(trainer.preempt_grace_s={self.grace_s:g})\n".encode())
        threading.Thread(target=self._watch, name="hybridrl-preemption-watchdog", daemon=True).start()

    @property
    def requested(self) -> bool:
        return self.signalled_at is not None

    def seconds_since(self) -> float:
        assert self.signalled_at is not None
        return time.monotonic() - self.signalled_at

    def finished(self) -> None:
        """The run ended on its own or after the save: the watchdog stands down."""
        self._done.set()

    def _watch(self) -> None:
        if self._done.wait(self.grace_s):
            return
        say(f"{self.signal_name} {self.grace_s:g} s ago (trainer.preempt_grace_s) and still {self.where}: exiting "
            f"{EXIT_CODE_TOO_LATE} without a new checkpoint; resume=auto takes the last committed one. A step plus "
            "a save must fit in trainer.preempt_grace_s, and that below the scheduler's grace period")
        _run_hooks()
        os._exit(EXIT_CODE_TOO_LATE)


_CURRENT: Preemption | None = None
_BEFORE_HARD_EXIT: list[Callable[[], None]] = []


def before_hard_exit(hook: Callable[[], None]) -> None:
    """Run ``hook`` before this module ends the process with ``os._exit`` (no atexit hooks run then): the engines'
    processes register their shutdown here, so that this module needs no engine module."""
    if hook not in _BEFORE_HARD_EXIT:
        _BEFORE_HARD_EXIT.append(hook)


def _run_hooks() -> None:
    for hook in list(_BEFORE_HARD_EXIT):
        hook()


def install(grace_s: float) -> Preemption:
    """Note SIGTERM/SIGUSR1 in this process from now on (main thread only; elsewhere a no-op record); under torchrun,
    exit when the launcher is gone (:func:`watch_launcher`)."""
    global _CURRENT
    _CURRENT = Preemption(grace_s=grace_s)
    if threading.current_thread() is threading.main_thread():
        for signum in SIGNALS:
            signal.signal(signum, _CURRENT.note)
    watch_launcher()
    return _CURRENT


_WATCHING: threading.Thread | None = None
_WATCHED_PARENT: int | None = None
_ORPHAN_EXIT = threading.Lock()  # the watcher and a failing main thread may both find the launcher gone: one exit


def watch_launcher() -> threading.Thread | None:
    """Under torchrun (``TORCHELASTIC_RUN_ID`` set): a daemon thread that polls this rank's parent, torchrun's agent,
    every :data:`LAUNCHER_POLL_S`; when the rank has been re-parented (the agent died, however) it shuts this rank's
    engines down (at most :data:`SHUTDOWN_S`) and exits :data:`EXIT_CODE_ORPHANED`. One per process; None when not
    under torchrun (a run started by hand outlives its shell, as ``nohup`` promises).

    Upstream behaviour it covers: torch's ``SubprocessHandler`` (``torch/distributed/elastic/multiprocessing/
    subprocess_handler``) starts each worker in a session of its own with no death signal, so a SIGKILLed torchrun
    leaves its workers running (``tests/faults/test_killed_launcher.py`` checks that this is still so).

    A thread rather than ``prctl(PR_SET_PDEATHSIG)``: the death signal fires when the *thread* that started the
    process ends, not the process (a launcher that spawns from a worker thread would kill its ranks at random), and
    SIGKILL would skip the engines' shutdown and the line saying why. The poll needs the main thread to let go of
    the GIL now and then, which torch's ops and collectives do. A rank whose peer noticed first meets the peer's
    exit as a failed collective before its own poll: :func:`exit_if_orphaned` turns that into the same exit."""
    global _WATCHING, _WATCHED_PARENT
    if "TORCHELASTIC_RUN_ID" not in os.environ or (_WATCHING is not None and _WATCHING.is_alive()):
        return None
    _WATCHED_PARENT = os.getppid()
    _WATCHING = threading.Thread(target=_watch_parent, args=(_WATCHED_PARENT,), name="hybridrl-launcher-watch",
                                 daemon=True)
    _WATCHING.start()
    return _WATCHING


def orphaned() -> bool:
    """True when this rank watches its launcher and the launcher is gone (the rank was re-parented)."""
    return _WATCHED_PARENT is not None and os.getppid() != _WATCHED_PARENT


def exit_if_orphaned() -> None:
    """For an exception that ends the run: when the launcher is gone, it is the cause (a collective fails once a
    peer rank has left for the same reason), so exit as :func:`watch_launcher` does instead of a traceback."""
    if orphaned():
        assert _WATCHED_PARENT is not None
        _exit_orphaned(_WATCHED_PARENT)


def _watch_parent(parent: int) -> None:
    # a parent of pid 1 is watched like any other: torchrun may be a container's first process
    while os.getppid() == parent:
        time.sleep(LAUNCHER_POLL_S)
    _exit_orphaned(parent)


def _exit_orphaned(parent: int) -> None:
    with _ORPHAN_EXIT:  # never released: the second caller waits for the first one's exit
        try:  # the launcher may have held the only reader of our output
            os.write(2, f"[hybridrl] rank {os.environ.get('RANK', '?')}: the launcher (pid {parent}, torchrun's "
                        f"agent) is gone: shutting the engines down and exiting {EXIT_CODE_ORPHANED} without a "
                        "checkpoint; resume=auto takes the last committed one\n".encode())
        except OSError:
            pass
        shutdown = threading.Thread(target=_run_hooks, name="hybridrl-orphan-shutdown", daemon=True)
        shutdown.start()
        shutdown.join(SHUTDOWN_S)
        os._exit(EXIT_CODE_ORPHANED)


def current() -> Preemption | None:
    return _CURRENT


def defers(handler: Any) -> bool:
    """Whether ``handler`` is a preemption's: an engine's shutdown-on-SIGTERM must not replace or precede it."""
    return getattr(handler, "__self__", None) is not None and isinstance(handler.__self__, Preemption)


def agreed_stop(preemption: Preemption | None, *, where: str) -> str | None:
    """Collective over the trainer ranks: why the run stops now (``"rank r: SIGTERM 3.1 s ago"``), or None."""
    from hybridrl.guards import agree

    if preemption is None:
        return None
    preemption.where = where
    local = f"{preemption.signal_name} {preemption.seconds_since():.1f} s ago" if preemption.requested else None
    return agree(local)
