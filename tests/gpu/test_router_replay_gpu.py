"""R3 router replay through vLLM and SGLang on the GPU: the engine records the experts of every position it runs
(``engine_kwargs.return_routed_experts``, turned on by ``router_replay.mode=R3``; vLLM's aux output, which needs its V2
model runner and so Triton; SGLang's ``enable_return_routed_experts``, whose CPU MoE path hybridrl refuses: GPU only)
and the trainer's old-log-prob pass and update route through them.

``grpo_moe_tiny`` (a tiny Qwen3-MoE, its own SFT start) with ``rollout.name=vllm|sglang``, 3 steps, fp32 actor.
Figure: the largest ``router_replay/engine_mismatch`` (the share of (token, MoE layer) pairs whose own top-k in the
trainer differs from the engine's — what R3 exists to remove; 0 on CPU with the hf engine), the largest
``rollout/logprob_abs_diff``, and the update's own routing against the replayed one
(``actor/router_replay_mismatch``). The engine's routing rows reaching the trainer at all is the check (a shape or
count mismatch fails the run); the figure says how far the trainer's own routing is from the engine's on this box.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from gpu_checks import REPO, check_named, last_error, moe_r3_overrides, read_metrics, report, work_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="no CUDA device: GPU checks run with tests/gpu/run_all.sh on a GPU machine"),
]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_r3_through_the_engine(torchrun, engine: str) -> None:
    check = f"grpo_moe_tiny_{engine}_r3"
    if importlib.util.find_spec(engine) is None:
        report(check=check, figure=f"not run: {engine} not installed (pip install {engine} on the GPU box)")
        pytest.fail(f"{engine} is not installed")
    work = work_dir()
    try:
        torchrun([str(REPO / "launch" / "train.py"), *moe_r3_overrides(work, engine)], nproc=1,
                 timeout=check_named(check).timeout_s - 15)
    except AssertionError as e:
        report(check=check, figure=f"the run failed: {last_error(str(e))}")
        raise
    steps = [r for r in read_metrics(work / check) if "reward/mean" in r]
    engine = max(r["router_replay/engine_mismatch"] for r in steps)
    update = max(r.get("actor/router_replay_mismatch", 0.0) for r in steps)
    diff = max(r["rollout/logprob_abs_diff"] for r in steps)
    report(check=check, figure=f"{len(steps)} steps | router_replay/engine_mismatch ≤ {engine:.2e} | "
                               f"actor/router_replay_mismatch ≤ {update:.2e} | logprob_abs_diff ≤ {diff:.1e}",
           engine_mismatch_max=engine, update_mismatch_max=update, logprob_abs_diff_max=diff)
    assert len(steps) == 3 and all(math.isfinite(v) for r in steps for v in r.values() if isinstance(v, float))
    assert engine < 0.05, f"the trainer's routing is far from the engine's: {engine:.3f} of (token, layer) pairs"
