"""The engine-process helpers without an engine: the reaper kills a watched process (and its children) once the
process that started them is SIGKILLed, even one that ignores SIGTERM; it leaves alone what it does not watch."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import psutil

SCRIPT = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    import psutil
    from hybridrl.rollout.engines import processes

    stubborn = "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \\
               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); time.sleep(300)"
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # the test reads this script's pipe to its end
    watched = subprocess.Popen([sys.executable, "-c", stubborn], **quiet)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True, **quiet)
    time.sleep(1.0)  # the watched one has started its own child
    processes.start_reaper([psutil.Process(watched.pid)])
    print(watched.pid, [c.pid for c in psutil.Process(watched.pid).children()][0], other.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_the_reaper_kills_the_watched_tree_when_its_trainer_is_sigkilled() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    watched, grandchild, other = map(int, out.stdout.split())
    deadline = time.time() + 10
    while time.time() < deadline and not (_gone(watched) and _gone(grandchild)):
        time.sleep(0.1)
    try:
        assert _gone(watched) and _gone(grandchild), out.stderr
        assert not _gone(other)  # not watched: left alone
    finally:
        for pid in (watched, grandchild, other):
            if not _gone(pid):
                psutil.Process(pid).kill()
