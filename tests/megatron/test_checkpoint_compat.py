"""``hybridrl/megatron/checkpoint_compat.py``: each item is still needed, and its fix works."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import psutil
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    if __name__ == "__main__":
        if sys.argv[1] == "fixed":
            from hybridrl.megatron.checkpoint_compat import install_results_queue
            install_results_queue()
        filesystem_async._get_write_results_queue().put(1)  # what the writer does at the first save
        children = [p for p in psutil.Process().children() if "resource_tracker" not in " ".join(p.cmdline())]
        print(" ".join(str(p.pid) for p in children), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no exit handler runs
""")


# a save's worker, forked as Megatron forks it, blocked in its write (opening a FIFO nobody reads)
WORKER_SCRIPT = textwrap.dedent("""
    import multiprocessing as mp, os, signal, sys, time
    from functools import partial
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    if __name__ == "__main__":
        if sys.argv[1].startswith("fixed"):
            from hybridrl.megatron.checkpoint_compat import install_worker_death_signal
            install_worker_death_signal()
        fifo = sys.argv[2]
        os.mkfifo(fifo)
        ctx = mp.get_context("fork")  # write_preloaded_data_multiproc's
        worker = ctx.Process(target=partial(FileSystemWriterAsync.write_preloaded_data, []), kwargs=dict(
            local_proc_idx=0, write_bucket=(fifo, "key", ([], [])), results_queue=ctx.SimpleQueue(),
            count_queue=ctx.JoinableQueue(), use_fsync=False))
        worker.start()
        print(worker.pid, flush=True)
        time.sleep(1.0)  # it is in open(fifo, "wb"), which never returns
        os.kill(os.getpid(), signal.SIGKILL)
""")


def _manager_after_sigkill(mode: str, tmp: Path, script: str = SCRIPT, *args: str) -> list[psutil.Process]:
    """The processes ``script`` printed that are still alive 10 s after it SIGKILLed itself."""
    out, err = tmp / f"{mode}.out", tmp / f"{mode}.err"  # files: a surviving manager holds a pipe open
    with out.open("w") as o, err.open("w") as e:
        code = subprocess.run([sys.executable, "-c", script, mode, *args], stdout=o, stderr=e,
                              timeout=120).returncode
    assert code == -signal.SIGKILL, err.read_text()[-3000:]
    pids = [int(p) for p in out.read_text().split()]
    assert pids, err.read_text()[-3000:]  # the manager started
    deadline = time.monotonic() + 10
    alive = [psutil.Process(p) for p in pids if psutil.pid_exists(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    return alive


@pytest.mark.slow
def test_item1_the_writers_results_manager_outlives_a_sigkilled_process_unless_installed(tmp_path: Path) -> None:
    """Megatron's own manager is still alive 10 s after its parent's SIGKILL (still needed); the installed one dies
    with its parent."""
    left = _manager_after_sigkill("megatron", tmp_path)
    try:
        assert left, "Megatron's results manager now dies with its parent: drop item 1"
    finally:
        for p in left:
            p.kill()
    assert _manager_after_sigkill("fixed", tmp_path) == []


@pytest.mark.slow
def test_item2_a_saves_forked_worker_outlives_a_sigkilled_rank_unless_wrapped(tmp_path: Path) -> None:
    """Megatron's writer worker, blocked in its write, is still alive 10 s after its rank's SIGKILL (still needed);
    wrapped, the kernel kills it with the rank."""
    left = _manager_after_sigkill("megatron-worker", tmp_path, WORKER_SCRIPT, str(tmp_path / "fifo1"))
    try:
        assert left, "Megatron's writer workers now die with their rank: drop item 2"
    finally:
        for p in left:
            p.kill()
    assert _manager_after_sigkill("fixed-worker", tmp_path, WORKER_SCRIPT, str(tmp_path / "fifo2")) == []
