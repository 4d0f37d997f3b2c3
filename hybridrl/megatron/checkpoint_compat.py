"""Every adaptation hybridrl makes to megatron-core 0.16.1's checkpoint writer, in one place.

Each item names the upstream behaviour it works around; ``tests/megatron/test_checkpoint_compat.py`` shows that
each is still needed (it fails once upstream changes, so the item can go).

1. **The writer's results queue outlives a killed rank.** ``FileSystemWriterAsync`` (under every
   ``dist_checkpointing.save`` of the torch_dist strategy, synchronous ones too) makes, at the first save, a
   ``multiprocessing`` *spawn* ``Manager()`` for its results queue (``filesystem_async._get_write_results_queue``)
   and keeps it for the life of the process. The manager is a server process that re-imports the trainer's
   ``__main__`` (~340 MB) and inherits its stdout/stderr. A rank that exits shuts it down; a rank that is SIGKILLed
   (OOM killer, ``kill -9``, a node agent) leaves it running for good, holding the run's log open.
   :func:`install_results_queue` starts that manager before Megatron does, with an initializer that has the kernel
   SIGKILL it when the rank dies (``PR_SET_PDEATHSIG``), and gives Megatron its queue.
2. **The writer's forked workers outlive a killed rank.** Each save forks worker processes
   (``FileSystemWriterAsync.write_preloaded_data_multiproc``, one per write bucket) that write the shards and
   report through a ``JoinableQueue``. A worker whose rank is SIGKILLed mid-save keeps running; seen in the fault
   suite under load: one stuck in ``JoinableQueue.task_done`` (its ``Condition.notify`` waiting for the dead
   rank's acknowledgement) for good, and multiprocessing's resource tracker with it (it lives while any holder of
   its pipe does). :func:`install_worker_death_signal` wraps the worker's entry
   (``FileSystemWriterAsync.write_preloaded_data``) so it first asks the kernel to SIGKILL it when the rank dies.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import threading
from multiprocessing.managers import SyncManager
from typing import Any

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_MANAGER: Any = None  # keeps the manager (and so its queue) alive for the process


def die_with_parent(parent_pid: int) -> None:
    """In a child process: be SIGKILLed when the parent dies (Linux), or now if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:  # not Linux, or refused: nothing to do
        return
    if os.getppid() != parent_pid or parent_pid == 1:  # the parent died before the prctl
        os.kill(os.getpid(), signal.SIGKILL)


def install_results_queue() -> None:
    """Item 1: idempotent; call from the main thread (the death signal follows the thread that started the child)."""
    global _MANAGER
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from torch import multiprocessing as mp

    if _MANAGER is not None or filesystem_async._results_queue is not None:
        return
    assert threading.current_thread() is threading.main_thread()
    manager = SyncManager(ctx=mp.get_context("spawn"))  # what Megatron's ctx.Manager() makes, plus the initializer
    manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
    _MANAGER = manager
    filesystem_async._results_queue = manager.Queue()


def install_worker_death_signal() -> None:
    """Item 2: idempotent. The workers' target is read from the class at each save (``partial(FileSystemWriterAsync
    .write_preloaded_data, ...)``), so the wrapped static method is what every later fork runs."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    original = FileSystemWriterAsync.__dict__["write_preloaded_data"]
    if getattr(original, "_hybridrl_dies_with_parent", False):
        return
    write = original.__func__

    @functools.wraps(write)
    def dies_with_parent(*args: Any, **kwargs: Any) -> Any:
        die_with_parent(os.getppid())  # in the forked worker: its parent is the rank
        return write(*args, **kwargs)

    wrapped = staticmethod(dies_with_parent)
    wrapped._hybridrl_dies_with_parent = True  # type: ignore[attr-defined]
    FileSystemWriterAsync.write_preloaded_data = wrapped
