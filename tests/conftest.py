"""Shared test helpers: run a script on N ranks (gloo on CPU) with torchrun."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence

import pytest

RunRanks = Callable[..., subprocess.CompletedProcess[str]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(args: Sequence[str], *, nproc: int, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc-per-node=nproc <args>`` on a free local port, 1 torch thread per rank.

    ``args`` is what follows torchrun's options: a script path or ``-m module``, then its arguments.
    Raises with the ranks' output when they fail.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-8000:]}")
    return proc


@pytest.fixture(scope="session")
def torchrun() -> RunRanks:
    return run_ranks
