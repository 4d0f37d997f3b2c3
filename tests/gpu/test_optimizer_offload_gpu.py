"""Megatron's optimizer CPU offload through ``optim.override_optimizer_config`` (verl's Qwen3-VL-8B script's settings)
on CUDA: one rank, a tiny Qwen2 in bf16 with the distributed optimizer.

Two policies from the same weights take the same two steps: Megatron's device optimizer, and its
``HybridDeviceOptimizer`` with ``optimizer_cpu_offload``, ``optimizer_offload_fraction=1``,
``overlap_cpu_optimizer_d2h_h2d`` and ``use_precision_aware_optimizer`` (what verl's script sets); between the steps
hybridrl's own memory phase (``megatron.optimizer_offload``: the state to host and back) runs on both, as verl's script
also sets it. Figure: max |Δ| of the weights after the steps (the CPU Adam's fp32 update against the device one), the
device memory each optimizer holds after a step (the offloaded one should hold no Adam state on the device).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from gpu_checks import REPO, report, work_dir  # tests/gpu is on sys.path under pytest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="no CUDA device: GPU checks run with tests/gpu/run_all.sh on a GPU machine"),
]
CHECK = "optimizer_cpu_offload"
TOL = 2e-2  # bf16 weights: one bf16 ulp at |w| ≈ 1 is 7.8e-3; the two Adams round differently

CODE = """
import json, sys, torch
sys.path.insert(0, {workers!r})
from rl_step import fixed_batch
from transformers import AutoConfig
from hybridrl.config.schema import MegatronConfig, OptimConfig
from hybridrl.megatron.config import MicroBatching
from hybridrl.megatron.offload import PolicyOffload
from hybridrl.megatron.parallel import ParallelConfig, init_parallel, seed_everything
from hybridrl.megatron.policy import MegatronPolicy
init_parallel(ParallelConfig())
seed_everything(1)
hf = AutoConfig.from_pretrained({model!r})
batch = fixed_batch(hf.vocab_size, hf.pad_token_id)
VERL = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1, overlap_cpu_optimizer_d2h_h2d=True,
            use_precision_aware_optimizer=True)
def loss(logp, ent, mb, *, normalizer):
    return -(logp * mb.response_mask).sum() / normalizer, {{}}
out = {{}}
for name, given in (("device", {{}}), ("offload", VERL)):
    megatron = MegatronConfig(dtype="bfloat16", use_distributed_optimizer=True)
    policy = MegatronPolicy(model_dir={model!r}, megatron=megatron, total_steps=2, pad_token_id=hf.pad_token_id,
                            optim=OptimConfig(lr=1e-3, override_optimizer_config=given))
    phases = PolicyOffload(policy, optimizer=True)
    torch.cuda.synchronize(); before = torch.cuda.memory_allocated()
    for _ in range(2):
        policy.train_step(batch, loss, batching=MicroBatching(micro_batch_size=8), loss_agg_mode="token-mean")
        phases.offload(); phases.reload()
    torch.cuda.synchronize()
    inner = getattr(policy.optimizer, "chained_optimizers", [policy.optimizer])[0].optimizer
    out[name] = dict(type=type(inner).__name__, held=torch.cuda.memory_allocated() - before,
                     weights=[p.detach().float().cpu() for p in policy.parameters()])
    del policy, phases, inner
delta = max(float((a - b).abs().max()) for a, b in zip(out["device"]["weights"], out["offload"]["weights"]))
print("RESULT", json.dumps(dict(delta=delta, device=out["device"]["held"], offload=out["offload"]["held"],
                                optimizer=out["offload"]["type"])))
"""


def test_optimizer_cpu_offload_trains_as_the_device_optimizer() -> None:
    import json

    from hybridrl.models.tiny import make_tiny_model

    out = work_dir() / "optimizer_offload"
    out.mkdir(parents=True, exist_ok=True)
    model = make_tiny_model(out / "model", arch="qwen2", hidden=256, layers=4, heads=4, kv_heads=2,
                            max_positions=128, tie=True, seed=3)
    code = CODE.format(workers=str(REPO / "tests" / "parallel" / "workers"), model=str(model))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "4"})
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        report(check=CHECK, figure=f"failed: {(proc.stderr.strip().splitlines() or ['(no output)'])[-1][:200]}")
        raise AssertionError(proc.stderr[-3000:])
    r = json.loads(lines[-1].removeprefix("RESULT "))
    report(check=CHECK, figure=f"{r['optimizer']}: max |Δ weight| vs the device optimizer {r['delta']:.1e}; device "
                               f"memory held after the steps {r['device'] / 2**20:.1f} MiB (device optimizer) vs "
                               f"{r['offload'] / 2**20:.1f} MiB (offloaded)", **r)
    assert r["optimizer"] == "HybridDeviceOptimizer", r
    assert r["delta"] <= TOL and r["offload"] < r["device"], r
