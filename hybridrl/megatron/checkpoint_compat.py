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
"""

from __future__ import annotations

import ctypes
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
    if os.getppid() != parent_pid:  # the parent died before the prctl
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
