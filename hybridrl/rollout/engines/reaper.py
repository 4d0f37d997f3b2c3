"""Kill an engine's processes when the trainer that started them dies (see
:func:`hybridrl.rollout.engines.processes.start_reaper`). Run as a script, not imported: it needs psutil only.

    python reaper.py TRAINER_PID PID:CREATE_TIME ...

Polls every 0.2 s. When the trainer is gone (or a zombie), SIGKILLs the listed processes and every descendant they
have (collected before the first kill, so none is orphaned unseen), then exits; it also exits once all of them are
gone. A process is matched by pid *and* start time, so a reused pid is never killed.
"""

from __future__ import annotations

import sys
import time

import psutil

POLL_S = 0.2


def _process(spec: str) -> psutil.Process | None:
    pid, created = spec.split(":", 1)
    try:
        proc = psutil.Process(int(pid))
        return proc if abs(proc.create_time() - float(created)) < 1e-3 else None
    except psutil.NoSuchProcess:
        return None


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def main(argv: list[str]) -> int:
    try:
        trainer: psutil.Process | None = psutil.Process(int(argv[0]))  # is_running() also sees a reused pid
    except psutil.NoSuchProcess:
        trainer = None
    watched = [p for p in map(_process, argv[1:]) if p is not None]
    while watched:
        if trainer is None or not _alive(trainer):
            everyone = {p.pid: p for p in watched}
            for proc in watched:
                try:
                    everyone.update({c.pid: c for c in proc.children(recursive=True)})
                except psutil.NoSuchProcess:
                    pass
            for proc in everyone.values():
                try:
                    proc.kill()
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(list(everyone.values()), timeout=5)
            return 0
        watched = [p for p in watched if _alive(p)]
        time.sleep(POLL_S)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
