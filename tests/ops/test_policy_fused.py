"""``actor_rollout_ref.actor.megatron.use_fused_kernels=true`` reaches the policy's log-prob head and the RL step
gives what the current implementation gives (tolerances of tests/parallel/test_rl_step_layouts.py), at TP=2
on a model whose vocabulary Megatron pads (131 → 256 columns; the padding lies in rank 1's shard).
Over a minute on the shared 2-core machine (two RL steps, each building actor and ref on 2 gloo ranks);
the policy-level check is the point: the key must reach the head and change nothing but rounding."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hybridrl.models.tiny import make_tiny_model

WORKER = str(Path(__file__).parent / "workers" / "policy_fused.py")
TOL = {"old_logprobs": 2e-6, "ref_logprobs": 2e-6, "entropy": 2e-6, "metrics": 2e-6, "weights": 1e-5}


@pytest.mark.distributed
def test_use_fused_kernels_gives_the_same_rl_step(torchrun, tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "tiny", arch="qwen2", hidden=64, layers=2, heads=4, kv_heads=2, vocab=131,
                            max_positions=128, tie=True, seed=3)
    out = torchrun([WORKER, str(model)], nproc=2).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("TP=2 fused calls"))
    print(line)  # pytest -s shows the differences
    assert int(re.search(r"fused calls (\d+)", line).group(1)) > 0, line  # the second run took the fused path
    diffs = {k: float(v) for k, v in re.findall(r"(\w+) ([\d.e+-]+)(?:,|$)", line.split("current|: ")[1])}
    assert diffs.keys() == TOL.keys(), line
    assert all(diffs[k] <= TOL[k] for k in TOL), line
