"""Real runs to break: a 2-rank grpo_tiny on a tiny model, started, watched line by line, signalled or killed.

Every process a run starts inherits ``MARK`` (its own value per run), so :func:`left_behind` finds any of them still
alive however deep it was started (engine schedulers, Megatron's writer helpers, reward workers).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rollout.process_marks import marked

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "launch" / "train.py")
MARK = "HYBRIDRL_FAULT_TEST_RUN"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_args(tiny: Path, out: Path, *extra: str, nproc: int = 2, steps: int = 6) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", TRAIN, "recipe=grpo_tiny", f"actor_rollout_ref.model.path={tiny / 'model'}",
            "actor_rollout_ref.model.build_if_missing=null", f"data.train_files=[{tiny / 'train.parquet'}]",
            "data.val_files=[]", "data.build_if_missing=null", "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.n=4", f"trainer.total_training_steps={steps}", "trainer.test_freq=0",
            "reward.name=keyword", "+reward.kwargs.keywords=[a,e,i,o,u,t,n,s]", "+reward.kwargs.mode=any",
            f"trainer.output_dir={out}", *extra]


@dataclass
class Ended:
    code: int
    log: str  # stdout and stderr, interleaved
    seconds_after_fault: float  # from the fault to the exit of the launcher
    mark: str
    pid: int  # the launcher's


def run_with_fault(args: list[str], *, when: Callable[[str], bool], fault: Callable[[subprocess.Popen[bytes]], None],
                   log: Path, timeout_s: float = 300) -> Ended:
    """Start ``args``; at the first output line for which ``when`` holds, call ``fault(proc)``; wait for the launcher
    to end. The output goes to the file ``log`` (a process left behind may hold it open: a pipe would never end)."""
    mark = f"{os.getpid()}-{time.monotonic_ns()}"
    with log.open("wb") as f:
        proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1", MARK: mark})
    t_fault, seen, deadline = None, 0, time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        if t_fault is None:
            lines = log.read_text(errors="replace").split("\n")[:-1]  # whole lines only
            if any(when(line) for line in lines[seen:]):
                fault(proc)
                t_fault = time.monotonic()
            seen = len(lines)
        time.sleep(0.01)
    if proc.poll() is None:
        proc.kill()
    code = proc.wait()
    ended = time.monotonic()
    text = log.read_text(errors="replace")
    assert t_fault is not None, text[-4000:]
    return Ended(code=code, log=text, seconds_after_fault=ended - t_fault, mark=mark, pid=proc.pid)


def after_step(n: int) -> Callable[[str], bool]:
    """The moment step ``n`` has been logged (step ``n + 1`` starts, or its periodic save)."""
    return lambda line: line.startswith(f"step {n}/")


def run_to_end(args: list[str]) -> str:
    p = subprocess.run(args, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return p.stdout


def left_behind(mark: str, *, wait_s: float = 10.0) -> list[int]:
    """The run's processes still alive ``wait_s`` after its launcher ended (they get that long to go)."""
    deadline = time.monotonic() + wait_s
    while (pids := marked(MARK, mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return pids


def metrics(out: Path) -> dict[int, dict[str, float]]:
    """Every logged step's metrics, without the timings (wall-clock dependent)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(("timing", "perf"))} for r in rows}


def rank_pids(proc: subprocess.Popen[bytes]) -> list[int]:
    """torchrun's workers (the ranks), in rank order."""
    import psutil

    ranks = [c for c in psutil.Process(proc.pid).children() if TRAIN in c.cmdline()]
    return [c.pid for c in sorted(ranks, key=lambda c: c.environ().get("RANK", ""))]
