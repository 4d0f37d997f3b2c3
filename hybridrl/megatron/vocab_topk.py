"""Top-k log-probs from vocab-parallel (TP-sharded) logits, and log-probs at given token ids with their gradient.

Both serve the top-k forward-KL distillation loss (:mod:`hybridrl.algorithms.distillation_loss`): the teacher's k most
likely tokens and their log-probs at every position (no gradient), then the student's log-probs of those same ids
(with gradient). With logits z split over TP ranks by vocabulary (rank r holds columns [r·v, (r+1)·v)):

    log Z = m + log Σ_j exp(z_j − m),  m = max_j z_j           (all-reduce max, then sum)
    top-k: each rank's own k best columns, all-gathered, the k best of those
    log p(i) = z_i − log Z,   z_i all-reduced from the rank that owns i
    ∂ Σ_k g_k log p(i_k) / ∂z_j = Σ_k g_k 1[j = i_k] − p_j Σ_k g_k          (local columns only)

The vocabulary is never gathered whole; columns at or past ``vocab_size`` (Megatron's vocab padding) are -inf, so
the distribution is the HF model's. Computed in fp32 whatever the logits' dtype, divided by ``temperature`` as the
sampled-token log-probs are (:mod:`vocab_parallel`); the gradient returns in the logits' dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state


def _local(logits_Nv: torch.Tensor, vocab_size: int, temperature: float) -> tuple[torch.Tensor, int, Any]:
    """``(z_Nv, start, group)``: this rank's tempered fp32 logits (padding -inf) and its first column."""
    group = parallel_state.get_tensor_model_parallel_group()
    v = logits_Nv.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * v
    z_Nv = logits_Nv.float() / temperature  # a new tensor: the logits themselves are never written
    if start + v > vocab_size:
        z_Nv[:, max(vocab_size - start, 0):] = float("-inf")
    return z_Nv, start, group


def _log_z(z_Nv: torch.Tensor, group: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(m_N, Z_N, e_Nv)``: the row maximum, Σ exp(z − m) over the whole vocabulary, and this rank's exp(z − m)."""
    m_N = z_Nv.max(dim=-1).values
    dist.all_reduce(m_N, op=dist.ReduceOp.MAX, group=group)
    e_Nv = torch.exp(z_Nv - m_N[:, None])
    Z_N = e_Nv.sum(dim=-1)
    dist.all_reduce(Z_N, group=group)
    return m_N, Z_N, e_Nv


@torch.no_grad()
def vocab_parallel_topk(logits_Nv: torch.Tensor, k: int, *, vocab_size: int,
                        temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp_Nk, ids_Nk)``: each row's ``k`` most likely tokens (global ids, most likely first) and their log-probs,
    the same on every rank of the TP group. ``k`` may exceed one rank's columns (each offers all it has)."""
    if k > vocab_size:
        raise ValueError(f"top-{k} of a vocabulary of {vocab_size} tokens: k must be at most the vocabulary size")
    z_Nv, start, group = _local(logits_Nv.detach(), vocab_size, temperature)
    m_N, Z_N, _ = _log_z(z_Nv, group)
    kk = min(k, z_Nv.shape[-1])
    vals_Nk, idx_Nk = z_Nv.topk(kk, dim=-1, sorted=True)
    ids_Nk = idx_Nk + start
    tp = dist.get_world_size(group)
    if tp > 1:
        vals = [torch.empty_like(vals_Nk) for _ in range(tp)]
        ids = [torch.empty_like(ids_Nk) for _ in range(tp)]
        dist.all_gather(vals, vals_Nk.contiguous(), group=group)
        dist.all_gather(ids, ids_Nk.contiguous(), group=group)
        vals_Nk, ids_Nk = torch.cat(vals, dim=-1), torch.cat(ids, dim=-1)
        order = vals_Nk.argsort(dim=-1, descending=True, stable=True)[:, :k]
        vals_Nk, ids_Nk = vals_Nk.gather(-1, order), ids_Nk.gather(-1, order)
    return vals_Nk - (m_N + Z_N.log())[:, None], ids_Nk


class _LogProbsAt(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits_Nv: torch.Tensor, ids_Nk: torch.Tensor, vocab_size: int,
                temperature: float) -> torch.Tensor:
        z_Nv, start, group = _local(logits_Nv, vocab_size, temperature)
        m_N, Z_N, e_Nv = _log_z(z_Nv, group)
        v = z_Nv.shape[-1]
        local_Nk = (ids_Nk >= start) & (ids_Nk < start + v)
        idx_Nk = (ids_Nk - start).clamp(0, v - 1)
        z_Nk = torch.where(local_Nk, z_Nv.gather(-1, idx_Nk), torch.zeros_like(idx_Nk, dtype=z_Nv.dtype))
        dist.all_reduce(z_Nk, group=group)
        ctx.save_for_backward(e_Nv / Z_N[:, None], idx_Nk, local_Nk)
        ctx.temperature, ctx.logits_dtype = temperature, logits_Nv.dtype
        return z_Nk - (m_N + Z_N.log())[:, None]

    @staticmethod
    def backward(ctx: Any, g_Nk: torch.Tensor) -> tuple[Any, ...]:
        p_Nv, idx_Nk, local_Nk = ctx.saved_tensors
        grad_Nv = -p_Nv * g_Nk.sum(dim=-1, keepdim=True)
        grad_Nv.scatter_add_(-1, idx_Nk, torch.where(local_Nk, g_Nk, torch.zeros_like(g_Nk)))
        return (grad_Nv / ctx.temperature).to(ctx.logits_dtype), None, None, None


def vocab_parallel_logprobs_at(logits_Nv: torch.Tensor, ids_Nk: torch.Tensor, *, vocab_size: int,
                               temperature: float = 1.0) -> torch.Tensor:
    """``[N, k]`` fp32: log p of the global token ids ``ids_Nk`` under each row of TP-local logits ``[N, V_pad / TP]``,
    differentiable. Saves one ``[N, v]`` fp32 tensor (the probabilities) for the backward; never the logits, so the
    sampled-token path may consume them (:mod:`hybridrl.ops`)."""
    return _LogProbsAt.apply(logits_Nv, ids_Nk, vocab_size, temperature)
