"""Benchmark: the engine–trainer mismatch of an MoE policy in bf16 with and without router replay (R3), grpo_moe_tiny.

    python tests/bench/router_replay.py [--steps 6] [--modes disabled,R3,R2]

Each mode is the ``grpo_moe_tiny`` recipe (its tiny Qwen3-MoE warm start, built into the cache if missing; 1 torch
thread, 1 rank) with the engine and the trainer in bfloat16 (``rollout.engine_kwargs.dtype``, ``megatron.dtype``):
different kernels and a near tie in a router send some tokens to other experts in the engine than in the trainer.
The runs share seeds, so step 1 scores the same samples with the same weights in every mode. Prints per mode the
median over steps of ``rollout/logprob_abs_diff`` (mean |log π_engine − log π_trainer| per token at the
old-log-prob pass), ``router_replay/engine_mismatch`` (R3: the share of (token, MoE layer) pairs whose trainer top-k
differs from the engine's; the same routers without the replay would use those) and ``actor/router_replay_mismatch``
(the update against the replayed routing), and the median ``timing/step``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from launch_run import train

BF16 = ["actor_rollout_ref.actor.megatron.dtype=bfloat16", "+actor_rollout_ref.rollout.engine_kwargs.dtype=bfloat16"]
KEYS = ("rollout/logprob_abs_diff", "router_replay/engine_mismatch", "actor/router_replay_mismatch", "timing/step")


def run(out: Path, mode: str, steps: int) -> list[dict[str, float]]:
    return train(out, ["recipe=grpo_moe_tiny", f"trainer.total_training_steps={steps}", "trainer.test_freq=0",
                       "trainer.val_before_train=false", f"actor_rollout_ref.actor.router_replay.mode={mode}", *BF16],
                 nproc=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--modes", default="disabled,R3,R2")
    args = p.parse_args()
    print("| mode | step 1 logprob_abs_diff | median logprob_abs_diff | median engine_mismatch | "
          "median update mismatch | median timing/step (s) |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            print(f"running {mode} ({args.steps} steps)…", file=sys.stderr, flush=True)
            rows = [r for r in run(Path(tmp) / mode, mode, args.steps) if r["step"] > 0]

            def median(key: str, rows: list[dict[str, float]] = rows) -> str:
                values = [r[key] for r in rows if key in r]
                return f"{statistics.median(values):.3g}" if values else "–"

            first = rows[0]["rollout/logprob_abs_diff"]
            print(f"| {mode} | {first:.3g} | " + " | ".join(median(k) for k in KEYS[:3]) + f" | {median(KEYS[3])} |")


if __name__ == "__main__":
    main()
