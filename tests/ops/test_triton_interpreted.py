"""The Triton kernels (hybridrl/ops/triton_kernels.py) on CPU under Triton's interpreter (TRITON_INTERPRET=1, in
a subprocess: the flag is read when triton is imported) against the plain-PyTorch kernels: block statistics
and gradients in fp32 and bf16, and the chunked LM-head op driven by them. The compiled CUDA run is
tests/gpu/test_fused_logprob_gpu.py."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

CHECK = r"""
import torch
from hybridrl.ops import lm_head_logprob_entropy, torch_kernels, triton_kernels
from hybridrl.ops.logprob import combine

g = torch.Generator().manual_seed(0)
x = torch.randn(5, 2500, generator=g) * 3
t = torch.tensor([0, 2299, -1, 2400, 17])
for dtype in (torch.float32, torch.bfloat16):
    xd = x.to(dtype)
    got, want = triton_kernels.row_stats(xd, t, 2300, 0.7), torch_kernels.row_stats(xd, t, 2300, 0.7)
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=1e-6)
    log_z, ent, _ = combine(want[None], None)
    args = (t, 2300, 0.7, log_z, ent, torch.randn(5, generator=g), torch.randn(5, generator=g))
    got = triton_kernels.row_grad(xd, *args, torch.empty_like(xd))
    want = torch_kernels.row_grad(xd, *args, torch.empty_like(xd))
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())

hidden, weight = torch.randn(6, 16, generator=g), torch.randn(1100, 16, generator=g)
target = torch.randint(0, 1050, (6,), generator=g)
out = []
for k in (triton_kernels, torch_kernels):
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, ent = lm_head_logprob_entropy(h, w, target, vocab_size=1050, chunk_size=512, kernels=k)
    (lp - ent).sum().backward()
    out.append((lp, ent, h.grad, w.grad))
for a, b in zip(*out):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item())
print("OK")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_interpreted_match_torch() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout[-3000:] + proc.stderr[-3000:]
