"""Benchmark: does one-step-off-policy training learn as the synchronous run does? grpo_tiny on 2 CPU ranks.

    python tests/bench/async_learning.py [--steps 200] [--test-freq 25] [--modes sync,S=1] [--seeds 1]

Each mode is the whole ``grpo_tiny`` recipe (its SFT warm start and arithmetic task, built into the cache if
missing; 1 torch thread per rank) under ``torchrun --nproc-per-node 2``, disaggregated — rank 1 generates, rank 0
trains:

- ``sync``: each step waits for its rollouts (``async_training.enable=false``);
- ``S=1``: one-step-off-policy (``async_training.staleness_threshold=1``), token-level rollout correction;
- ``S=1 partial``: and ``async_training.partial_rollout=true``.

Each mode runs once per ``trainer.seed`` of ``--seeds`` (the prompts' order and the samples follow the seed). Prints
``eval/accuracy`` (greedy, the 200 held-out problems) at every evaluation, averaged over the seeds, each seed's
last evaluation, the last evaluation's difference against ``sync`` (the issue asks within 0.05) and each mode's
median ``timing/step``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from launch_run import train

AOR = "actor_rollout_ref"
DISAGG = [f"{AOR}.rollout.placement=disaggregated", f"{AOR}.rollout.num_ranks=1"]
S1 = ["async_training.enable=true", "async_training.staleness_threshold=1",
      "algorithm.rollout_correction.rollout_is=token"]
MODES = {"sync": DISAGG, "S=1": [*DISAGG, *S1], "S=1 partial": [*DISAGG, *S1, "async_training.partial_rollout=true"]}


def run(out: Path, overrides: list[str], *, steps: int, test_freq: int) -> list[dict[str, float]]:
    return train(out, ["recipe=grpo_tiny", f"trainer.total_training_steps={steps}", f"trainer.test_freq={test_freq}",
                       *overrides], nproc=2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--test-freq", type=int, default=25)
    p.add_argument("--modes", default="sync,S=1")
    p.add_argument("--seeds", default="1", help="comma-separated trainer.seed values")
    args = p.parse_args()
    seeds = [int(x) for x in args.seeds.split(",")]
    curves: dict[str, dict[int, dict[int, float]]] = {}  # mode -> seed -> step -> accuracy
    step_times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for mode in args.modes.split(","):
                print(f"running {mode}, seed {seed} ({args.steps} steps)…", file=sys.stderr, flush=True)
                rows = run(Path(tmp) / f"{mode.replace(' ', '_').replace('=', '')}_{seed}",
                           [*MODES[mode], f"trainer.seed={seed}"], steps=args.steps, test_freq=args.test_freq)
                curves.setdefault(mode, {})[seed] = {int(r["step"]): r["eval/accuracy"] for r in rows
                                                     if "eval/accuracy" in r}
                step_times.setdefault(mode, []).extend(r["timing/step"] for r in rows if r["step"] > 0)
    modes = list(curves)
    steps = sorted(set.intersection(*(set(c) for m in modes for c in curves[m].values())))

    def mean(mode: str, step: int) -> float:
        return statistics.mean(curves[mode][s][step] for s in seeds)

    print("| step | " + " | ".join(f"{m} eval/accuracy (mean of {len(seeds)})" for m in modes) + " |")
    print("|---|" + "---|" * len(modes))
    for s in steps:
        print(f"| {s} | " + " | ".join(f"{mean(m, s):.3f}" for m in modes) + " |")
    last = steps[-1]
    for seed in seeds:
        print(f"| step {last}, seed {seed} | " + " | ".join(f"{curves[m][seed][last]:.3f}" for m in modes) + " |")
    print("| median timing/step (s) | " + " | ".join(f"{statistics.median(step_times[m]):.2f}" for m in modes) + " |")
    for m in modes[1:]:
        print(f"\n{m} − {modes[0]} at step {last} (mean over seeds): {mean(m, last) - mean(modes[0], last):+.3f}")


if __name__ == "__main__":
    main()
