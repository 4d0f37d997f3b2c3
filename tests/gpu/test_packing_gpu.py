"""Packed rows (THD) against padded ones on the GPU: one actor RL step, fp32, one rank.

The CPU suite's step (``tests/parallel/workers/rl_step.py``: old/ref log-probs, two PPO mini-batches, Adam and SGD)
run on CUDA twice — ``tp1pp1cp1`` (packed: ``use_remove_padding``, the default; Transformer Engine's THD attention
where TE is installed, hybridrl's packed local attention otherwise) and ``tp1pp1cp1-pad`` (a padded row per sample).
Figure: the attention used, max |Δ| of the log-probs, of every step metric and of the weights after the step.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from gpu_checks import REPO, report, work_dir  # tests/gpu is on sys.path under pytest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="no CUDA device: GPU checks run with tests/gpu/run_all.sh on a GPU machine"),
]
CHECK = "packing_thd"
WORKER = REPO / "tests" / "parallel" / "workers" / "rl_step.py"
TOL = 1e-5  # fp32; the CPU suite sees ≤ 1e-6 (cuBLAS and TE's kernels sum in other orders)


def test_packed_equals_padded_on_the_gpu(torchrun) -> None:
    from hybridrl.models.tiny import make_tiny_model

    out = work_dir() / "packing"
    out.mkdir(parents=True, exist_ok=True)
    model = make_tiny_model(out / "model", arch="qwen2", hidden=64, layers=4, heads=4, kv_heads=2,
                            max_positions=128, tie=True, seed=3)
    torchrun([str(WORKER), str(model), str(out), "tp1pp1cp1", "tp1pp1cp1-pad"], nproc=1, timeout=600)
    worst: dict[str, float] = {}
    for mode in ("token-mean", "seq-mean-token-mean"):
        packed = torch.load(out / f"tp1pp1cp1dp1-{mode}.pt")
        padded = torch.load(out / f"tp1pp1cp1-paddp1-{mode}.pt")
        for key in ("old_logprobs", "ref_logprobs", "entropy"):
            worst[key] = max(worst.get(key, 0.0), float((packed[key] - padded[key]).abs().max()))
        for a, b in zip(packed["steps"], padded["steps"], strict=True):
            for key in ("pg_loss", "grad_norm", "ppo_kl", "kl_ref", "entropy"):
                worst[f"step/{key}"] = max(worst.get(f"step/{key}", 0.0), abs(a[key] - b[key]))
        worst["weights"] = max(worst.get("weights", 0.0), max(
            float((packed["weights"][k] - padded["weights"][k]).abs().max()) for k in packed["weights"]))
    attention = "Transformer Engine THD" if importlib.util.find_spec("transformer_engine") else "local packed"
    report(check=CHECK, figure=f"{attention}; " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    bad = {k: v for k, v in worst.items() if not v <= (1e-4 if k == "weights" else TOL)}
    assert not bad, bad

