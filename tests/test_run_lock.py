"""One run per output directory (``hybridrl/run_lock.py``), and the static writability check."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrl.run_lock import LOCK_FILE, OutputDirLockedError, RunLock, output_dir_problem

HOLD = ("import sys, time\nfrom hybridrl.run_lock import RunLock\nlock = RunLock(sys.argv[1])\n"
        "print('held', flush=True)\ntime.sleep(600)\n")


def test_a_second_run_fails_naming_the_holder_and_a_killed_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(OutputDirLockedError) as e:
            RunLock(out)
        assert str(e.value).startswith(f"trainer.output_dir={str(out)!r} is in use by another hybridrl run "
                                       f"(pid {holder.pid} on host {socket.gethostname()}, started ")
        assert str(out / LOCK_FILE) in str(e.value)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = RunLock(out)  # the kernel dropped the dead holder's lock
    assert f'"pid": {os.getpid()}' in (out / LOCK_FILE).read_text()
    lock.release()


def test_the_same_process_cannot_take_it_twice(tmp_path: Path) -> None:
    lock = RunLock(tmp_path)
    with pytest.raises(OutputDirLockedError, match=f"pid {os.getpid()}"):
        RunLock(tmp_path, key="trainer.output_dir")
    lock.release()
    RunLock(tmp_path).release()


def test_output_dir_problem_creates_nothing(tmp_path: Path) -> None:
    assert output_dir_problem(tmp_path / "a" / "b") is None and not (tmp_path / "a").exists()
    (tmp_path / "file").write_text("x")
    assert output_dir_problem(tmp_path / "file") == f"trainer.output_dir={str(tmp_path / 'file')!r} is not a directory"
    assert output_dir_problem(tmp_path / "file" / "run") == (
        f"trainer.output_dir={str(tmp_path / 'file' / 'run')!r} would be created under {tmp_path / 'file'}, "
        "which is not a directory")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write any directory")
def test_output_dir_problem_reports_an_unwritable_parent(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    try:
        assert output_dir_problem(ro / "run", key="trainer.output_dir") == (
            f"trainer.output_dir={str(ro / 'run')!r} would be created in {ro}, which is not writable by this "
            f"user (uid {os.getuid()})")
    finally:
        ro.chmod(0o700)
