"""Log-prob of the target token and entropy from vocab-parallel (TP-sharded) logits.

With logits z split over TP ranks by vocabulary (rank r holds columns [r·v, (r+1)·v)):
    m = max_j z_j (all-reduce max),  Z = Σ_j exp(z_j - m) (all-reduce sum),  p_j = exp(z_j - m) / Z
    log p(y) = z_y - m - log Z                         (z_y all-reduced from the rank that owns y)
    H = -Σ_j p_j log p_j = m + log Z - Σ_j p_j z_j     (Σ all-reduced)
Gradients (per row, local columns only — no full-vocab tensor is ever gathered):
    ∂ log p(y)/∂z_j = 1[j = y] - p_j,        ∂H/∂z_j = -p_j (log p_j + H)
Columns at or past ``vocab_size`` are Megatron's vocab padding: they are masked to -inf so the
distribution is exactly the HF model's. At TP=1 this is an ordinary fused log-softmax + gather. With ``fused`` (config
``actor_rollout_ref.actor.megatron.use_fused_kernels``) the same values come from :mod:`hybridrl.ops`
without the ``[N, V]``-sized fp32 temporaries below.

Precision: whatever the logits' dtype (bf16/fp16 under mixed precision), everything above is computed in
fp32 (the logits are upcast once); the gradient goes back to the logits in their own dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from hybridrl.ops import compiled_kernels, logprob_entropy


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits_Nv: torch.Tensor, target_N: torch.Tensor, vocab_size: int,
                temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        group = parallel_state.get_tensor_model_parallel_group()
        rank, v = parallel_state.get_tensor_model_parallel_rank(), logits_Nv.shape[-1]
        start = rank * v
        z_Nv = logits_Nv.float() / temperature
        if start + v > vocab_size:  # vocab padding lives in the last shard(s)
            z_Nv = z_Nv.clone()
            z_Nv[:, max(vocab_size - start, 0):] = float("-inf")
        m_N = z_Nv.max(dim=-1).values
        dist.all_reduce(m_N, op=dist.ReduceOp.MAX, group=group)
        e_Nv = torch.exp(z_Nv - m_N[:, None])
        Z_N = e_Nv.sum(dim=-1)
        dist.all_reduce(Z_N, group=group)
        p_Nv = e_Nv / Z_N[:, None]
        local = (target_N >= start) & (target_N < start + v)
        idx_N = (target_N - start).clamp(0, v - 1)
        zy_N = torch.where(local, z_Nv.gather(-1, idx_N[:, None]).squeeze(-1), torch.zeros_like(m_N))
        pz_N = (p_Nv * z_Nv.nan_to_num(neginf=0.0)).sum(dim=-1)
        both = torch.stack([zy_N, pz_N])
        dist.all_reduce(both, group=group)
        log_Z_N = m_N + Z_N.log()
        logp_N = both[0] - log_Z_N
        entropy_N = log_Z_N - both[1]
        ctx.save_for_backward(p_Nv, idx_N, local, entropy_N, log_Z_N, z_Nv)
        ctx.temperature, ctx.logits_dtype = temperature, logits_Nv.dtype
        return logp_N, entropy_N

    @staticmethod
    def backward(ctx: Any, g_logp_N: torch.Tensor, g_ent_N: torch.Tensor) -> tuple[Any, ...]:
        p_Nv, idx_N, local, entropy_N, log_Z_N, z_Nv = ctx.saved_tensors
        grad_Nv = torch.zeros_like(p_Nv)
        if g_logp_N is not None:
            grad_Nv -= p_Nv * g_logp_N[:, None]
            rows = local.nonzero().squeeze(-1)
            grad_Nv[rows, idx_N[rows]] += g_logp_N[rows]
        if g_ent_N is not None and bool((g_ent_N != 0).any()):
            logp_Nv = (z_Nv - log_Z_N[:, None]).nan_to_num(neginf=0.0)
            grad_Nv -= g_ent_N[:, None] * p_Nv * (logp_Nv + entropy_N[:, None])
        return (grad_Nv / ctx.temperature).to(ctx.logits_dtype), None, None, None


def vocab_parallel_is_argmax(logits_Nv: torch.Tensor, target_N: torch.Tensor, *, vocab_size: int) -> torch.Tensor:
    """``[N]``: 1.0 where ``target_N`` is the greedy (argmax) token of its row of TP-local logits ``[N, V_pad / TP]``,
    else 0.0 (a tie counts as a match; the vocabulary padding never wins). No gradient; the full vocabulary is never
    gathered: the row maximum and the target's logit are each one all-reduce (max) over the TP group."""
    group = parallel_state.get_tensor_model_parallel_group()
    start, v = parallel_state.get_tensor_model_parallel_rank() * logits_Nv.shape[-1], logits_Nv.shape[-1]
    z_Nv = logits_Nv.detach().float()
    if start + v > vocab_size:
        z_Nv = z_Nv.clone()
        z_Nv[:, max(vocab_size - start, 0):] = float("-inf")
    m_N = z_Nv.max(dim=-1).values
    dist.all_reduce(m_N, op=dist.ReduceOp.MAX, group=group)
    local = (target_N >= start) & (target_N < start + v)
    zy_N = torch.where(local, z_Nv.gather(-1, (target_N - start).clamp(0, v - 1)[:, None]).squeeze(-1),
                       torch.full_like(m_N, float("-inf")))
    dist.all_reduce(zy_N, op=dist.ReduceOp.MAX, group=group)
    return (zy_N >= m_N).float()


def use_fused_kernels(setting: bool | None, device: torch.device) -> bool:
    """``actor_rollout_ref.actor.megatron.use_fused_kernels`` resolved for ``device``: null = when the compiled
    kernels of :mod:`hybridrl.ops` build there (else warned once); true = they must; false = never."""
    if setting is False:
        return False
    if compiled_kernels(device) is not None:
        return True
    if setting:
        raise RuntimeError(f"actor_rollout_ref.actor.megatron.use_fused_kernels=true but the fused kernels are "
                           f"unavailable on {device.type} (the warning above says why); set it to null (use them "
                           f"when they build) or false")
    return False


def vocab_parallel_logprob_entropy(logits_Nv: torch.Tensor, target_N: torch.Tensor, *, vocab_size: int,
                                   temperature: float = 1.0, fused: bool | None = False, consume_logits: bool = False
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log p(target), entropy)`` per row of TP-local logits ``[N, V_pad / TP]``, in fp32. ``fused``: the
    ``use_fused_kernels`` setting (null/true/false); the fused kernels compute the same values without
    ``[N, V]``-sized temporaries (:mod:`hybridrl.ops.logprob`), and with ``consume_logits`` (nothing else reads
    the logits) write the gradient into the logits' storage."""
    if use_fused_kernels(fused, logits_Nv.device):
        return logprob_entropy(logits_Nv, target_N, vocab_size=vocab_size, temperature=temperature,
                               group=parallel_state.get_tensor_model_parallel_group(), consume_logits=consume_logits)
    return _VocabParallelLogProbEntropy.apply(logits_Nv, target_N, vocab_size, temperature)
