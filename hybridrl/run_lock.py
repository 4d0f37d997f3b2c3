"""One run per output directory: an exclusive lock on ``trainer.output_dir``, held for the run.

Rank 0 takes an ``fcntl.flock`` on ``<output_dir>/.hybridrl.lock`` before the run writes anything there
and keeps it until its process exits (the kernel releases it even after SIGKILL, so a crashed run never
leaves a stale lock). The file records the holder's pid, host and start time; a second run on the same
directory fails at once, on every rank, naming them. Other ranks take no lock.
On NFS, Linux emulates ``flock`` with POSIX byte-range locks, which the server enforces across nodes.

:func:`output_dir_problem` is the static check (writable, without creating anything).

Importing this module imports neither torch nor transformers; :func:`hold_output_dir` imports
torch.distributed itself.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import IO

LOCK_FILE = ".hybridrl.lock"


class OutputDirLockedError(RuntimeError):
    """Another run holds the output directory."""


class RunLock:
    """An exclusive lock on ``directory`` (created if missing), until :meth:`release` or process exit."""

    def __init__(self, directory: str | Path, *, key: str = "trainer.output_dir") -> None:
        self.path = Path(directory) / LOCK_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f: IO[str] = self.path.open("a+")  # neither truncates nor replaces the holder's record
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = _describe(f.read())
            f.close()
            raise OutputDirLockedError(
                f"{key}={str(directory)!r} is in use by another hybridrl run ({holder}; lock file {self.path}); "
                f"wait for it to end, or give this run another {key}") from None
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                            "started": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
        f.flush()
        self._f: IO[str] | None = f

    def release(self) -> None:
        if self._f is not None:
            self._f.close()  # closing the file releases the lock
            self._f = None


def _describe(record: str) -> str:
    try:
        r = json.loads(record)
        return f"pid {r['pid']} on host {r['host']}, started {r['started']}"
    except (ValueError, KeyError, TypeError):
        return "its pid and host are not recorded yet"


_HELD: list[RunLock] = []  # rank 0's lock, held until the process exits


def hold_output_dir(directory: str | Path, *, key: str = "trainer.output_dir") -> None:
    """Collective: rank 0 locks ``directory`` for the rest of its process; if another run holds it, every
    rank raises :class:`OutputDirLockedError` together."""
    import torch.distributed as dist

    from hybridrl.distributed import host_group

    problem: tuple[bool, str] | None = None  # (locked by another run, message)
    if dist.get_rank() == 0:
        try:
            _HELD.append(RunLock(directory, key=key))
        except OutputDirLockedError as e:
            problem = (True, str(e))
        except OSError as e:  # e.g. not writable: every rank stops, not only this one
            problem = (False, f"{key}={str(directory)!r}: can't create its lock file ({type(e).__name__}: {e})")
    box = [problem]
    dist.broadcast_object_list(box, src=0, group=host_group.get())
    if box[0] is not None:
        locked, message = box[0]
        raise OutputDirLockedError(message) if locked else OSError(message)


def output_dir_problem(path: str | Path, *, key: str = "trainer.output_dir") -> str | None:
    """Why a run could not write ``path`` (None: it could), checked without creating anything: ``path``, or
    its nearest existing ancestor (which the run would create it in), must be a writable directory."""
    given = Path(path)
    existing = given.absolute()
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "is" if existing == given.absolute() else f"would be created under {existing}, which is"
        return f"{key}={str(given)!r} {what} not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is" if existing == given.absolute() else f"would be created in {existing}, which is"
        return f"{key}={str(given)!r} {what} not writable by this user (uid {os.getuid()})"
    if (given / LOCK_FILE).exists() and not os.access(given / LOCK_FILE, os.W_OK):
        return f"{key}={str(given)!r}: its lock file {given / LOCK_FILE} is not writable by this user"
    return None
