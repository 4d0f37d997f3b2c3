"""Benchmark: does each tiny recipe learn on any machine? Each run is the README's main-job command from an empty cache.

    python tests/bench/tiny_recipes.py [--recipes grpo_tiny,opd_tiny] [--seeds 1,2,3] [--threads 1,2]
                                       [--steps N] [--shared-cache] [--out bench_tiny]

For every recipe × ``trainer.seed`` × ``OMP_NUM_THREADS``: ``torchrun --nproc-per-node 1 launch/train.py recipe=R
trainer.seed=S`` (the jsonl logger added to the console) in a fresh ``HYBRIDRL_CACHE_DIR`` — so the run first builds
its data, its random model and its SFT warm start(s) (which stop on their held-out greedy accuracy,
``trainer.target_accuracy``), as a newcomer's first run does; ``--shared-cache`` reuses one cache for all runs of a
thread count instead. Prints a markdown row per run: ``eval/accuracy`` (greedy, held out) at step 0 and at the end
and its gain, minutes to the first RL step (warm-start builds included) and in all; for a distillation recipe also
``distill/reverse_kl`` (mean of the first and of the last 10 steps). Then each recipe's claim as what held on all of
its runs: the lowest start, the lowest gain.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launch_run import REPO, free_port


def run(recipe: str, *, seed: int, threads: int, cache: Path, out: Path, steps: int | None) -> dict[str, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(REPO / "launch" / "train.py"), f"recipe={recipe}",
           f"trainer.seed={seed}", "trainer.logger=[console,jsonl]", f"trainer.output_dir={out}"]
    cmd += [f"trainer.total_training_steps={steps}"] if steps else []
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HYBRIDRL_CACHE_DIR": str(cache)}
    t0, first_step, configured, tail = time.monotonic(), None, False, []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          cwd=out.parent) as proc:  # the warm starts' own outputs/ land beside the runs
        assert proc.stdout is not None
        for line in proc.stdout:  # the warm starts' SFT lines come before the RL run's "config OK"
            tail = [*tail[-40:], line]
            configured = configured or "config OK" in line
            if configured and first_step is None and re.match(r"step 1/", line):
                first_step = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{''.join(tail)}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    kl = [r["distill/reverse_kl"] for r in rows if "distill/reverse_kl" in r]
    result = {"start": evals[0], "end": evals[-1], "gain": evals[-1] - evals[0], "evals": evals,
              "first_step_min": (first_step or float("nan")) / 60, "total_min": (time.monotonic() - t0) / 60}
    if kl:
        result |= {"kl_first": statistics.fmean(kl[:10]), "kl_last": statistics.fmean(kl[-10:])}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipes", default="grpo_tiny,opd_tiny")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--steps", type=int, default=None, help="trainer.total_training_steps (default: the recipe's)")
    parser.add_argument("--shared-cache", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    root = (args.out or Path(tempfile.mkdtemp(prefix="bench_tiny_"))).resolve()
    root.mkdir(parents=True, exist_ok=True)
    print("| recipe | seed | threads | start | end | gain | to RL step 1 (min) | total (min) | reverse KL |")
    print("|---|---|---|---|---|---|---|---|---|")
    results: dict[str, list[dict[str, float]]] = {}
    for threads in map(int, args.threads.split(",")):
        for recipe in args.recipes.split(","):
            for seed in map(int, args.seeds.split(",")):
                name = f"{recipe}-s{seed}-t{threads}"
                cache = root / (f"cache-t{threads}" if args.shared_cache else f"cache-{name}")
                r = run(recipe, seed=seed, threads=threads, cache=cache, out=root / name, steps=args.steps)
                results.setdefault(recipe, []).append(r)
                kl = f"{r['kl_first']:.3f} → {r['kl_last']:.3f}" if "kl_first" in r else ""
                print(f"| {recipe} | {seed} | {threads} | {r['start']:.3f} | {r['end']:.3f} | {r['gain']:+.3f} | "
                      f"{r['first_step_min']:.1f} | {r['total_min']:.1f} | {kl} |", flush=True)
    for recipe, rs in results.items():
        print(f"{recipe}: on all {len(rs)} runs start ≥ {min(r['start'] for r in rs):.3f}, gain ≥ "
              f"{min(r['gain'] for r in rs):+.3f}; first RL step after ≤ "
              f"{max(r['first_step_min'] for r in rs):.1f} min")


if __name__ == "__main__":
    main()
