"""A dead or hung SGLang engine in a real 2-rank run (colocated, one engine a rank): its scheduler SIGKILLed, or
stopped with SIGSTOP. The run ends within the configured timeout with an error naming the engine's key and the rank,
and no process of it is left.

Time: ~110 s on 2 cores (two runs, each starting two SGLang engines)."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from faults.runs import after_step, left_behind, rank_pids, run_with_fault, train_args

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed: run `bash launch/install_sglang_cpu.sh` (CI's test command does)",
                allow_module_level=True)

pytestmark = [pytest.mark.distributed, pytest.mark.sglang]
TIMEOUT_S = 15  # actor_rollout_ref.rollout.engine_kwargs.request_timeout_s of these runs


def _scheduler(rank_pid: int) -> psutil.Process:
    """The SGLang scheduler process a rank started (it renames itself ``sglang::scheduler…``)."""
    procs = [p for p in psutil.Process(rank_pid).children(recursive=True) if "scheduler" in p.name()]
    assert procs, [(p.pid, p.name()) for p in psutil.Process(rank_pid).children(recursive=True)]
    return procs[0]


def _to_engine_of(rank: int, signum: int) -> Callable[[subprocess.Popen[bytes]], None]:
    def fault(proc: subprocess.Popen[bytes]) -> None:
        os.kill(_scheduler(rank_pids(proc)[rank]).pid, signum)
    return fault


@pytest.mark.parametrize(("rank", "signum", "said"), [
    (1, signal.SIGKILL, r"\[rank1\].*SGLangEngineError: .*died"),
    (0, signal.SIGSTOP, r"\[rank0\].*SGLangEngineError: SGLang .* took longer than "
                        r"actor_rollout_ref\.rollout\.engine_kwargs\.request_timeout_s=15"),
], ids=["sigkill", "sigstop"])
def test_a_dead_or_hung_engine_ends_the_run_naming_it_and_leaves_no_process(tiny: Path, rank: int, signum: int,
                                                                            said: str) -> None:
    out = tiny / f"engine-{signal.Signals(signum).name}"
    args = train_args(tiny, out, "actor_rollout_ref.rollout.name=sglang", "trainer.total_training_steps=4",
                      f"+actor_rollout_ref.rollout.engine_kwargs.request_timeout_s={TIMEOUT_S}")
    ended = run_with_fault(args, when=after_step(1), fault=_to_engine_of(rank, signum),
                           log=tiny / f"engine-{signal.Signals(signum).name}.log")
    print(f"engine {signal.Signals(signum).name} on rank {rank}: exit {ended.code}, "
          f"{ended.seconds_after_fault:.1f} s later")
    assert ended.code != 0 and re.search(said, ended.log), ended.log[-5000:]
    assert ended.seconds_after_fault < TIMEOUT_S + 30, ended.seconds_after_fault
    assert left_behind(ended.mark) == []
