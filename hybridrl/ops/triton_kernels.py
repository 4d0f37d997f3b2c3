"""The block kernels in Triton, for CUDA tensors: the contract of ``csrc/logprob_entropy.cpp``.

``row_stats``: one program per row streams the block's columns in tiles of ``BLOCK`` with an online max
(the running S and T are rescaled when the max grows: S ← S·e^{m-m'}, T ← e^{m-m'}(T + (m-m')S)).
``row_grad``: one program per (row, tile), writes ``(g_lp (1[j=y] - p_j) - g_ent p_j (log p_j + H)) / T`` into
``out`` (may alias the logits). fp32 math whatever the logits' dtype. With ``TRITON_INTERPRET=1`` they run on
CPU tensors too (tests/ops/test_triton_interpreted.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _row_stats_kernel(X, Y, STATS, ld, valid, temp, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    row = X + i * ld
    m = tl.full((), float("-inf"), tl.float32)
    S = tl.zeros((), tl.float32)
    T = tl.zeros((), tl.float32)
    for c in range(0, valid, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        mask = cols < valid
        z = tl.load(row + cols, mask=mask, other=float("-inf")).to(tl.float32) / temp
        new_m = tl.maximum(m, tl.max(z, 0))
        d = z - new_m
        e = tl.where(mask, tl.exp(d), 0.0)
        a = tl.exp(m - new_m)
        T = tl.where(S > 0, a * (T + (m - new_m) * S), 0.0) + tl.sum(tl.where(mask, e * d, 0.0), 0)
        S = S * a + tl.sum(e, 0)
        m = new_m
    t = tl.load(Y + i)
    zy = tl.load(row + tl.maximum(t, 0)).to(tl.float32) / temp
    zy = tl.where(t < 0, 0.0, tl.where(t < valid, zy, float("-inf")))
    tl.store(STATS + 4 * i, m)
    tl.store(STATS + 4 * i + 1, S)
    tl.store(STATS + 4 * i + 2, zy)
    tl.store(STATS + 4 * i + 3, T)


@triton.jit
def _row_grad_kernel(X, Y, LZ, H, GL, GE, OUT, ld, ldo, ncols, valid, temp, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside, mask = cols < ncols, cols < valid
    z = tl.load(X + i * ld + cols, mask=mask, other=0.0).to(tl.float32) / temp
    lz, h, a, b = tl.load(LZ + i), tl.load(H + i), tl.load(GL + i), tl.load(GE + i)
    t = tl.load(Y + i)
    lp = z - lz
    p = tl.exp(lp)
    g = -a * p - b * p * (lp + h) + tl.where(cols == t, a, 0.0)
    g = tl.where(mask, g / temp, 0.0)
    tl.store(OUT + i * ldo + cols, g.to(OUT.dtype.element_ty), mask=inside)


def row_stats(logits_NC: torch.Tensor, target_N: torch.Tensor, valid: int, temperature: float) -> torch.Tensor:
    assert logits_NC.stride(1) == 1, "rows must be contiguous"
    N = logits_NC.shape[0]
    out_N4 = torch.empty(N, 4, device=logits_NC.device, dtype=torch.float32)
    if N:
        _row_stats_kernel[(N,)](logits_NC, target_N.contiguous(), out_N4, logits_NC.stride(0), valid,
                                float(temperature), BLOCK=BLOCK)
    return out_N4


def row_grad(logits_NC: torch.Tensor, target_N: torch.Tensor, valid: int, temperature: float, log_z_N: torch.Tensor,
             entropy_N: torch.Tensor, g_lp_N: torch.Tensor, g_ent_N: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    assert logits_NC.stride(1) == 1 and out.stride(1) == 1, "rows must be contiguous"
    N, C = logits_NC.shape
    if N and C:
        f32 = [x.float().contiguous() for x in (log_z_N, entropy_N, g_lp_N, g_ent_N)]
        _row_grad_kernel[(N, triton.cdiv(C, BLOCK))](logits_NC, target_N.contiguous(), *f32, out,
                                                    logits_NC.stride(0), out.stride(0), C, valid,
                                                    float(temperature), BLOCK=BLOCK)
    return out
