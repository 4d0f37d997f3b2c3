"""Benchmark: asynchronous against synchronous training on 2 CPU ranks (1 engine rank, 1 trainer rank).

    python tests/bench/async_vs_sync.py [--steps 8] [--warmup 2] [--workloads grpo_tiny,balanced]

Each mode is a real run (``torchrun --nproc-per-node 2 launch/train.py recipe=grpo_tiny …``, 1 torch thread per
rank) on the recipe's random-init tiny model (built into the cache if missing; no SFT warm start, so every
response runs to the length cap and the work per step is fixed):

- ``colocated sync``: both ranks train (DP=2) and generate (an engine each);
- ``disaggregated sync``: rank 1 generates, rank 0 trains; each step waits for its rollouts;
- ``S=1``, ``S=2``: the same ranks with ``async_training.enable=true`` and that staleness threshold;
- ``S=1 partial``, ``S=2 partial``: and ``async_training.partial_rollout=true`` (an update interrupts the running
  generation, which continues on the new weights).

Workloads: ``grpo_tiny`` (the recipe's batch; training outweighs generation about 5 : 1) and ``balanced`` (longer
responses, one optimizer step and no reference pass, an engine that decodes 24 rows at a time: generation and
training take about as long, L ≈ 2). From the disaggregated synchronous run's
own stage times: t_gen = median ``timing/gen``, t_train = median (``timing/step`` − ``timing/gen``), and the overlap
limit L = t_sync / max(t_gen, t_train). For each asynchronous mode: speed-up = t_sync / t_async (median
``timing/step``) and speed-up / L. Prints a markdown table (medians over the timed steps).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
AOR = "actor_rollout_ref"
WORKLOADS = {
    "grpo_tiny": [],
    # 32-token responses; one optimizer step and no reference pass; the engine decodes 24 rows at a time
    "balanced": ["data.max_response_length=32", f"{AOR}.actor.ppo_mini_batch_size=64",
                 f"{AOR}.actor.use_kl_loss=false", f"+{AOR}.rollout.engine_kwargs.max_batch_size=24"],
}
DISAGG = [f"{AOR}.rollout.placement=disaggregated", f"{AOR}.rollout.num_ranks=1"]
MODES = {
    "colocated sync": [],
    "disaggregated sync": DISAGG,
    "S=1": [*DISAGG, "async_training.enable=true", "async_training.staleness_threshold=1",
            "algorithm.rollout_correction.rollout_is=token"],
    "S=2": [*DISAGG, "async_training.enable=true", "async_training.staleness_threshold=2",
            "algorithm.rollout_correction.rollout_is=token"],
}
MODES |= {f"{mode} partial": [*keys, "async_training.partial_rollout=true"] for mode, keys in list(MODES.items())
          if mode.startswith("S=")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(out: Path, overrides: list[str], steps: int) -> list[dict[str, float]]:
    from hybridrl.paths import cache_dir

    model = Path(cache_dir()) / "bench" / "tiny-random-qwen2"  # bootstrap builds only inside the cache
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(REPO / "launch" / "train.py"), "recipe=grpo_tiny",
           f"{AOR}.model.path={model}", f"{AOR}.model.build_if_missing=tiny", "data.val_files=[]",
           "trainer.val_before_train=false", "trainer.test_freq=0", "trainer.save_freq=0", "trainer.logger=[jsonl]",
           f"trainer.total_training_steps={steps}", f"trainer.output_dir={out}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"step": 0' not in line]


def median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    args = p.parse_args()
    print("| workload | mode | median timing/step (s) | t_gen | t_train | L | speed-up | share of L "
          "| trainer idle | engine idle | staleness max | partial samples |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for workload in args.workloads.split(","):
            sync = None
            for mode, keys in MODES.items():
                name = f"{workload}-{mode.replace(' ', '_').replace('=', '')}"  # '=' would read as an override
                rows = run(Path(tmp) / name, [*WORKLOADS[workload], *keys], args.steps + args.warmup)[args.warmup:]
                t = median(rows, "timing/step")
                cells = [workload, mode, f"{t:.2f}"]
                if mode == "disaggregated sync":
                    t_gen = median(rows, "timing/gen")
                    t_train = statistics.median(r["timing/step"] - r["timing/gen"] for r in rows)
                    sync = (t, t_gen, t_train, t / max(t_gen, t_train))
                    cells += [f"{t_gen:.2f}", f"{t_train:.2f}", f"{sync[3]:.2f}", "1.00", "", "", "", "", ""]
                elif sync is not None and mode.startswith("S="):
                    speedup = sync[0] / t
                    cells += ["", "", "", f"{speedup:.2f}", f"{speedup / sync[3]:.0%}",
                              f"{median(rows, 'async/trainer_idle_ratio'):.2f}",
                              f"{median(rows, 'async/engine_idle_ratio'):.2f}",
                              f"{max(r['async/staleness_max'] for r in rows):.0f}",
                              f"{median(rows, 'async/partial_samples'):.0f}"]
                else:
                    cells += [""] * 9
                print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
