"""Fused log-prob of the target token and entropy, from vocab-parallel logits or straight from the LM head.

Same math as :mod:`hybridrl.megatron.vocab_parallel` (its docstring has the formulas), computed so that no
softmax-sized temporary exists. A *block* of columns (one TP rank's shard, or one vocabulary chunk of it)
is reduced by a kernel (``csrc/logprob_entropy.cpp`` on CPU, :mod:`.triton_kernels` on CUDA,
:mod:`.torch_kernels` as the fallback) to per-row statistics of z = logits / temperature:
    m = max z,  S = Σ e^{z-m},  T = Σ e^{z-m} (z - m),  zy = z_target (0 off-block)
Blocks combine exactly (chunks locally, then TP ranks by all-reduce MAX of m, all-reduce SUM of the
rescaled S' = S e^{m-M}, T' = e^{m-M} (T + (m - M) S) and zy):
    log Z = M + log S,   log p(y) = zy - log Z,   H = log S - T / S
The backward recomputes each block from the logits (or from hidden × weightᵀ, chunk by chunk) and writes
∂/∂z_j = g_lp (1[j=y] - p_j) - g_ent p_j (log p_j + H), divided by the temperature.

Deviations from ``vocab_parallel``: H is computed from shifted sums (T/S) rather than log Z - Σ p z (same
value, less cancellation), and the C++/PyTorch kernels and the combination work in fp64 (the Triton kernels in
fp32), which makes them ~10× closer to the exact fp64 result than the fp32 reference (whose own error reaches
~1.5e-6 relative); the results are fp32. Any input dtype is upcast; the gradient goes back in the input's
dtype (the LM-head form accumulates the hidden's gradient in fp32).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hybridrl.ops.kernels import Kernels, kernels_for

Group = Any  # a torch.distributed ProcessGroup or None (no TP)


def _rank_world(group: Group) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _block_target(target_N: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Target as a column of the block [start, stop), -1 when the block does not hold it."""
    inside = (target_N >= start) & (target_N < stop)
    return torch.where(inside, target_N - start, torch.full_like(target_N, -1))


def combine(stats_KN4: torch.Tensor, group: Group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log Z, H, zy)`` per row, in fp64, from the K local blocks' statistics and the other TP ranks'."""
    m_KN, S_KN, zy_KN, T_KN = stats_KN4.double().unbind(-1)
    M_N = m_KN.max(dim=0).values
    _, world = _rank_world(group)
    if world > 1:
        dist.all_reduce(M_N, op=dist.ReduceOp.MAX, group=group)
    a_KN = torch.exp(m_KN - M_N)  # 0 for a block with no valid column (m = -inf)
    has_KN = S_KN > 0
    sums_3N = torch.stack([torch.where(has_KN, S_KN * a_KN, 0.0).sum(0),
                           torch.where(has_KN, a_KN * (T_KN + (m_KN - M_N) * S_KN), 0.0).sum(0),
                           zy_KN.sum(0)])
    if world > 1:
        dist.all_reduce(sums_3N, group=group)
    log_S_N = sums_3N[0].log()
    return M_N + log_S_N, log_S_N - sums_3N[1] / sums_3N[0], sums_3N[2]


def _shard(n_cols: int, vocab_size: int, group: Group) -> tuple[int, int]:
    """This rank's first global column and how many of its columns are real (not vocab padding)."""
    rank, _ = _rank_world(group)
    start = rank * n_cols
    return start, min(max(vocab_size - start, 0), n_cols)


def _zeros_if_none(g: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if g is None else g.to(like.dtype)


class _LogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits_Nv: torch.Tensor, target_N: torch.Tensor, vocab_size: int, temperature: float,
                group: Group, kernels: Kernels, consume: bool) -> tuple[torch.Tensor, torch.Tensor]:
        logits_Nv = logits_Nv if logits_Nv.stride(-1) == 1 else logits_Nv.contiguous()
        start, valid = _shard(logits_Nv.shape[-1], vocab_size, group)
        t_N = _block_target(target_N, start, start + logits_Nv.shape[-1])
        log_z_N, ent_N, zy_N = combine(kernels.row_stats(logits_Nv, t_N, valid, temperature)[None], group)
        ctx.save_for_backward(logits_Nv, t_N, log_z_N, ent_N)
        ctx.args = (valid, temperature, kernels, consume)
        return (zy_N - log_z_N).float(), ent_N.float()

    @staticmethod
    def backward(ctx: Any, g_lp_N: torch.Tensor | None, g_ent_N: torch.Tensor | None) -> tuple[Any, ...]:
        logits_Nv, t_N, log_z_N, ent_N = ctx.saved_tensors
        valid, temperature, kernels, consume = ctx.args
        # consume: each gradient element overwrites the logit it is computed from (the kernels read z_j, then
        # write ∂/∂z_j); the in-place write bumps the logits' version, so any other saved use of them fails
        # loudly at its backward instead of reading gradients
        grad_Nv = logits_Nv if consume else torch.empty_like(logits_Nv)
        kernels.row_grad(logits_Nv, t_N, valid, temperature, log_z_N, ent_N, _zeros_if_none(g_lp_N, log_z_N),
                         _zeros_if_none(g_ent_N, log_z_N), grad_Nv)
        if consume:  # the kernels write through the data pointer, which autograd does not see: say so
            torch.autograd.graph.increment_version(logits_Nv)
        return grad_Nv, None, None, None, None, None, None


def _chunks(valid: int, chunk: int) -> list[tuple[int, int]]:
    return [(c, min(c + chunk, valid)) for c in range(0, valid, chunk)]


class _LMHeadLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden_Nh: torch.Tensor, weight_vh: torch.Tensor, target_N: torch.Tensor,
                vocab_size: int, temperature: float, group: Group, chunk: int,
                kernels: Kernels) -> tuple[torch.Tensor, torch.Tensor]:
        start, valid = _shard(weight_vh.shape[0], vocab_size, group)
        t_N = _block_target(target_N, start, start + weight_vh.shape[0])
        stats = []
        for c0, c1 in _chunks(valid, chunk):  # the vocab padding rows of the weight are never multiplied
            logits_NC = hidden_Nh @ weight_vh[c0:c1].t()
            stats.append(kernels.row_stats(logits_NC, _block_target(t_N, c0, c1), c1 - c0, temperature))
            del logits_NC
        if not stats:  # a TP rank holding only padding
            n = hidden_Nh.shape[0]
            stats.append(torch.tensor([float("-inf"), 0.0, 0.0, 0.0], device=hidden_Nh.device).expand(n, 4))
        log_z_N, ent_N, zy_N = combine(torch.stack(stats), group)
        ctx.save_for_backward(hidden_Nh, weight_vh, t_N, log_z_N, ent_N)
        ctx.args = (valid, temperature, group, chunk, kernels)
        return (zy_N - log_z_N).float(), ent_N.float()

    @staticmethod
    def backward(ctx: Any, g_lp_N: torch.Tensor | None, g_ent_N: torch.Tensor | None) -> tuple[Any, ...]:
        hidden_Nh, weight_vh, t_N, log_z_N, ent_N = ctx.saved_tensors
        valid, temperature, group, chunk, kernels = ctx.args
        g_lp_N, g_ent_N = _zeros_if_none(g_lp_N, log_z_N), _zeros_if_none(g_ent_N, log_z_N)
        grad_h_Nh = torch.zeros(hidden_Nh.shape, dtype=torch.float32, device=hidden_Nh.device)
        grad_w_vh = torch.zeros_like(weight_vh)
        for c0, c1 in _chunks(valid, chunk):
            w_Ch = weight_vh[c0:c1]
            g_NC = hidden_Nh @ w_Ch.t()  # recomputed logits, overwritten in place by their gradient
            kernels.row_grad(g_NC, _block_target(t_N, c0, c1), c1 - c0, temperature, log_z_N, ent_N, g_lp_N,
                             g_ent_N, g_NC)
            if g_NC.dtype == torch.float32:
                grad_h_Nh.addmm_(g_NC, w_Ch)
            else:
                grad_h_Nh += (g_NC @ w_Ch).float()
            torch.mm(g_NC.t(), hidden_Nh, out=grad_w_vh[c0:c1])
            del g_NC
        if _rank_world(group)[1] > 1:  # the hidden is replicated over TP: its gradient is the ranks' sum
            dist.all_reduce(grad_h_Nh, group=group)
        return grad_h_Nh.to(hidden_Nh.dtype), grad_w_vh, None, None, None, None, None, None


def logprob_entropy(logits_Nv: torch.Tensor, target_N: torch.Tensor, *, vocab_size: int, temperature: float = 1.0,
                    group: Group = None, kernels: Kernels | None = None,
                    consume_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log p(target), entropy)`` per row of TP-local logits ``[N, V_pad / TP]`` (rank r holds columns
    ``[r·v, (r+1)·v)`` of ``group``; columns ≥ ``vocab_size`` are padding), in fp32.
    ``kernels``: a block-kernel backend (default: the best one for the device, :mod:`.kernels`).
    ``consume_logits``: nothing else reads the logits after this op (the policy's case: they come straight
    out of the LM head), so the backward writes their gradient into their storage instead of a second
    ``[N, V]`` tensor; were they saved by another op too, that op's backward raises (autograd's version
    check) rather than compute with gradients."""
    return _LogProbEntropy.apply(logits_Nv, target_N, vocab_size, temperature, group,
                                 kernels or kernels_for(logits_Nv.device), consume_logits)


def default_chunk(n_rows: int) -> int:
    """Vocabulary columns per chunk: ~16M logits (64 MB in fp32) at a time, between 256 and 8192 columns."""
    return max(256, min(8192, (1 << 24) // max(n_rows, 1) // 256 * 256))


def lm_head_logprob_entropy(hidden_Nh: torch.Tensor, weight_vh: torch.Tensor, target_N: torch.Tensor, *,
                            vocab_size: int, temperature: float = 1.0, group: Group = None,
                            chunk_size: int | None = None, kernels: Kernels | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log p(target), entropy)`` of the logits ``hidden_Nh @ weight_vhᵀ`` (``weight_vh``: this TP rank's
    vocabulary shard of the LM head, ``hidden_Nh`` replicated over ``group``), computed ``chunk_size``
    vocabulary columns at a time: the ``[N, V]`` logits never exist. Gradients flow to hidden and weight."""
    if hidden_Nh.shape[-1] != weight_vh.shape[-1]:
        raise ValueError(f"hidden [N, {hidden_Nh.shape[-1]}] and weight [v, {weight_vh.shape[-1]}] disagree on h")
    chunk = chunk_size or default_chunk(hidden_Nh.shape[0])
    return _LMHeadLogProbEntropy.apply(hidden_Nh, weight_vh, target_N, vocab_size, temperature, group, chunk,
                                       kernels or kernels_for(hidden_Nh.device))
