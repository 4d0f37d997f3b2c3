"""kill -9 of one rank of a real 2-rank run, in a checkpoint write and mid-step: the run ends, no process is left
(Megatron's checkpoint-writer helper outlived a killed rank: ``hybridrl/megatron/checkpoint_compat.py`` item 1),
and ``resume=auto`` logs exactly the uninterrupted run's metrics.

Time: ~50 s on 2 cores (three runs of a tiny model, plus conftest's reference)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from faults.runs import after_step, left_behind, metrics, rank_pids, run_to_end, run_with_fault, train_args

from hybridrl.checkpoint.rl import latest_complete

pytestmark = pytest.mark.distributed


def _after(seconds: float) -> Callable[[], bool]:
    """True from ``seconds`` after its first call."""
    first: list[float] = []
    return lambda: time.monotonic() - (first or first.append(time.monotonic()) or first)[0] >= seconds


def _kill_rank_when(rank: int, ready: Callable[[], bool]) -> Callable[[subprocess.Popen[bytes]], None]:
    def fault(proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + 10
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.002)
        os.kill(rank_pids(proc)[rank], signal.SIGKILL)
    return fault


def test_kill_9_in_a_save_and_mid_step_then_resume_gives_the_uninterrupted_run(tiny: Path, reference: Path) -> None:
    out = tiny / "kill9"
    root = out / "checkpoints"
    args = train_args(tiny, out, "trainer.save_freq=1")
    # 1. rank 1, while step 2's checkpoint is being written (step 1's is committed)
    in_save = run_with_fault(args, when=after_step(2), log=tiny / "kill9-in-save.log",
                             fault=_kill_rank_when(1, lambda: (root / ".tmp_step_00000002").exists()))
    print(f"kill -9 rank 1 in a save: exit {in_save.code} {in_save.seconds_after_fault:.1f} s later")
    assert in_save.code != 0 and "Signal 9 (SIGKILL) received by PID" in in_save.log, in_save.log[-4000:]
    assert in_save.seconds_after_fault < 60 and left_behind(in_save.mark) == []
    assert latest_complete(root) in (root / "step_00000001", root / "step_00000002")  # the kill may lose the race
    # 2. rank 0, mid-step: 0.1 s into step 4 (generation, update or sync at this size)
    mid_step = run_with_fault(args, when=after_step(3), fault=_kill_rank_when(0, _after(0.1)),
                              log=tiny / "kill9-mid-step.log")
    print(f"kill -9 rank 0 mid-step: exit {mid_step.code} {mid_step.seconds_after_fault:.1f} s later")
    assert mid_step.code != 0 and left_behind(mid_step.mark) == [], mid_step.log[-4000:]
    # 3. to the end
    run_to_end(args)
    assert metrics(out) == metrics(reference)
