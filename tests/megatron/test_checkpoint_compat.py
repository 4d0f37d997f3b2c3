"""``hybridrl/megatron/checkpoint_compat.py``: each item is still needed, and its fix works."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

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


def _manager_after_sigkill(mode: str, tmp: Path) -> list[psutil.Process]:
    out, err = tmp / f"{mode}.out", tmp / f"{mode}.err"  # files: a surviving manager holds a pipe open
    with out.open("w") as o, err.open("w") as e:
        code = subprocess.run([sys.executable, "-c", SCRIPT, mode], stdout=o, stderr=e, timeout=120).returncode
    assert code == -signal.SIGKILL, err.read_text()[-3000:]
    pids = [int(p) for p in out.read_text().split()]
    assert pids, err.read_text()[-3000:]  # the manager started
    deadline = time.monotonic() + 10
    alive = [psutil.Process(p) for p in pids if psutil.pid_exists(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    return alive


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
