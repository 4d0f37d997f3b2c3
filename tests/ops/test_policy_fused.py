"""``actor_rollout_ref.actor.megatron.use_fused_kernels=true`` (and with ``fused_lm_head=true``: log-probs from the
hidden states and the LM-head weight, vocabulary chunk by chunk) reaches the policy's log-prob head and the RL step
gives what the current implementation gives (tolerances of tests/parallel/test_rl_step_layouts.py), at TP=2
on a model whose vocabulary Megatron pads (131 → 256 columns; the padding lies in rank 1's shard).
About a minute on the shared 2-core machine (three RL steps, each building actor and ref on 2 gloo ranks);
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
    out = torchrun([WORKER, str(model)], nproc=2, timeout=600).stdout
    for kind in ("fused", "fused_lm_head"):  # the logits op, then the LM head fused with it
        line = next(ln for ln in out.splitlines() if ln.startswith(f"TP=2 {kind} calls"))
        print(line)  # pytest -s shows the differences
        calls = re.search(r"calls (\d+) \(other (\d+)\)", line)
        assert int(calls.group(1)) > 0 and int(calls.group(2)) == 0, line  # that path and only it ran
        diffs = {k: float(v) for k, v in re.findall(r"(\w+) ([\d.e+-]+)(?:,|$)", line.split("current|: ")[1])}
        assert diffs.keys() == TOL.keys(), line
        assert all(diffs[k] <= TOL[k] for k in TOL), line
