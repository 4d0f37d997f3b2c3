"""Refactoring check: seeded metrics of a few steps of each tiny RL recipe, recorded before a change and compared after.

    python tests/bench/pinned_metrics.py --record pinned.json   # on the commit before the change
    python tests/bench/pinned_metrics.py --check pinned.json    # after it: every metric equal to 1e-6

Each recipe runs ``--steps`` steps (``launch/train.py`` under torchrun, 1 rank, 1 torch thread) from the same random
tiny model (``make_tiny_model``, its tokenizer has a chat template) instead of its SFT warm start, on data its recipe
builds in a fresh cache; the step-0 and final evaluations run too. Timing, throughput and memory metrics are left
out: they are the machine's, not the algorithm's. A behaviour-preserving change leaves every other metric equal.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launch_run import REPO, free_port

RECIPES = ("grpo_tiny", "ppo_tiny", "dapo_tiny", "grpo_multiturn_tiny")
MACHINE_PREFIXES = ("timing/", "timing_cpu/", "perf/", "memory/", "throughput/")
TOLERANCE = 1e-6


def run(recipe: str, steps: int, work: Path) -> list[dict[str, float]]:
    from hybridrl.models.tiny import make_tiny_model

    model = work / "model"
    if not model.exists():
        make_tiny_model(model, hidden=64, layers=2, heads=4, kv_heads=2, max_positions=256)
    out = work / recipe
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(REPO / "launch" / "train.py"), f"recipe={recipe}",
           f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.model.build_if_missing=null",
           f"trainer.total_training_steps={steps}", f"trainer.test_freq={steps}", "trainer.save_freq=-1",
           "trainer.logger=[console,jsonl]", f"trainer.output_dir={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYBRIDRL_CACHE_DIR": str(work / "cache")}
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=work, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{recipe} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    print(f"{recipe}: {len(rows)} rows in {time.monotonic() - t0:.0f} s", flush=True)
    return [{k: v for k, v in row.items() if not k.startswith(MACHINE_PREFIXES)} for row in rows]


def compare(before: dict[str, list[dict[str, float]]], now: dict[str, list[dict[str, float]]]) -> list[str]:
    problems = []
    for recipe, rows in before.items():
        got = now.get(recipe, [])
        if len(got) != len(rows):
            problems.append(f"{recipe}: {len(rows)} rows before, {len(got)} now")
        for i, (a, b) in enumerate(zip(rows, got, strict=False)):
            for key in sorted(k for k in set(a) | set(b) if not k.startswith(MACHINE_PREFIXES)):
                x, y = a.get(key), b.get(key)
                same = (isinstance(x, (int, float)) and isinstance(y, (int, float))
                        and (x == y or (math.isnan(x) and math.isnan(y)) or abs(x - y) <= TOLERANCE)) or x == y
                if not same:
                    problems.append(f"{recipe} row {i} {key}: {x} before, {y} now")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--record", type=Path)
    what.add_argument("--check", type=Path)
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pinned-") as tmp:
        now = {r: run(r, args.steps, Path(tmp)) for r in args.recipes.split(",")}
    if args.record:
        args.record.write_text(json.dumps(now, indent=1, sort_keys=True))
        print(f"recorded {sum(len(v) for v in now.values())} rows of {len(now)} recipes in {args.record}")
        return
    problems = compare(json.loads(args.check.read_text()), now)
    print("\n".join(problems) if problems else f"identical to {TOLERANCE:g}: {', '.join(now)}")
    raise SystemExit(1 if problems else 0)


if __name__ == "__main__":
    main()
