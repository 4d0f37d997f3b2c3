"""One training run for a benchmark: ``torchrun --nproc-per-node N launch/train.py OVERRIDES`` with 1 torch thread a
rank and the jsonl logger, its metrics rows returned (a failed run ends the benchmark with its output)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def train(out: Path, overrides: list[str], *, nproc: int) -> list[dict[str, float]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(REPO / "launch" / "train.py"), "trainer.logger=[jsonl]",
           f"trainer.output_dir={out}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
