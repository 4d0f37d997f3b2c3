"""Context parallelism (CP) without Transformer Engine: the sequence split and a CP core attention.

Megatron's layout (``utils.get_batch_on_this_cp_rank``; ``GPTModel`` slices its RoPE table the same
way): a sequence of S tokens is cut into 2·CP chunks of S/(2·CP), and CP rank r holds chunks r and
2·CP−1−r, which balances the causal-attention work. Every per-token op of the model is local to a
rank; only attention mixes positions, and Megatron implements CP only inside TE's attention (a K/V
ring). :class:`ContextParallelAttention` is the local-spec stand-in:

    K, V = all-gather over the CP group (then reordered by global position)
    softmax(Q Kᵀ · scale, masked where key position > query position) V      (per rank: its own Q)

Its backward sums the K/V gradients over the CP group and keeps this rank's positions. Memory per
rank: the whole sequence's K/V and an [S/CP, S] score matrix per head (TE's ring holds one K/V chunk
at a time) — the CPU/debug path, not a long-context kernel.

:func:`shard_sequence` / :func:`gather_sequence` do the same split and its inverse on [B, S] tensors
(tokens in, per-token log-probs out) for the policy. Packed rows (THD, :func:`~hybridrl.megatron.sequences.
pack_sequences`) are split sequence by sequence (``cu_seqlens``: each sequence's chunks r and 2·CP−1−r, in order,
as Transformer Engine's ``thd_get_partitioned_indices`` and Megatron's THD RoPE do), and the attention then
gathers K/V the same way (:mod:`hybridrl.megatron.packed_attention`).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from hybridrl.megatron.cp_layout import cp_positions, held_positions
from hybridrl.megatron.packed_attention import packed_attention


def _cp() -> tuple[dist.ProcessGroup, int, int]:
    group = parallel_state.get_context_parallel_group()
    return group, parallel_state.get_context_parallel_rank(), parallel_state.get_context_parallel_world_size()


def shard_sequence(x: torch.Tensor, dim: int = 1, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """This CP rank's positions of ``x`` along ``dim`` (``x`` itself when CP = 1); ``cu_seqlens``: ``x`` is a packed
    row with these padded sequence boundaries."""
    _, rank, size = _cp()
    if size == 1:
        return x
    return x.index_select(dim, held_positions(x.shape[dim], rank, size, cu_seqlens).to(x.device))


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, sum_grads: bool, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        group, rank, size = _cp()
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        seq_len = x.shape[dim] * size
        held = torch.cat([held_positions(seq_len, r, size, cu_seqlens) for r in range(size)])  # of each gathered row
        ctx.dim, ctx.sum_grads = dim, sum_grads
        ctx.own = held_positions(seq_len, rank, size, cu_seqlens).to(x.device)
        return torch.cat(parts, dim).index_select(dim, held.argsort().to(x.device))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        if ctx.sum_grads:
            grad = grad.clone(memory_format=torch.contiguous_format)  # reduced in place
            dist.all_reduce(grad, group=_cp()[0])
        return grad.index_select(ctx.dim, ctx.own), None, None, None


def gather_sequence(x: torch.Tensor, dim: int = 1, *, sum_grads: bool = False,
                    cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """The whole sequence from every CP rank's positions of ``x`` (inverse of :func:`shard_sequence`).

    Backward: ``sum_grads=False`` when every CP rank computes the same function of the gathered
    tensor (a loss over the whole sequence): each rank keeps the gradient of its own positions.
    ``sum_grads=True`` when each rank computes a different function of it (attention of its own
    queries over all keys): the gradients are summed over the CP group first.
    """
    if parallel_state.get_context_parallel_world_size() == 1:
        return x
    return _GatherSequence.apply(x, dim, sum_grads, cu_seqlens)


class ContextParallelAttention(MegatronModule):
    """Causal core attention over CP-split sequences; replaces the local spec's ``DotProductAttention``.

    Same inputs and output as Megatron's: query ``[s, b, np, hn]``, key/value ``[s, b, ng, hn]``
    (this rank's s = S/CP positions, TP-local heads), output ``[s, b, np·hn]``. The causal mask is
    built from global positions; the ``attention_mask`` argument (a causal mask over local
    positions, if any) is not used. Supports what the hybridrl model build uses: causal self
    attention, GQA, softmax scale, attention dropout, packed sequences; not attention bias.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None) -> None:
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal or config.apply_query_key_layer_scaling or \
                config.window_size is not None or config.softmax_type != "vanilla":
            raise NotImplementedError("ContextParallelAttention supports plain causal softmax attention only "
                                      f"(got attn_mask_type={attn_mask_type}, window_size={config.window_size}, "
                                      f"softmax_type={config.softmax_type!r})")
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.heads = config.num_attention_heads // tp
        self.groups = (config.num_query_groups or config.num_attention_heads) // tp
        assert config.kv_channels is not None
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None) -> torch.Tensor:
        assert attention_bias is None, "not supported by ContextParallelAttention"
        if packed_seq_params is not None:  # packed sequences: each sequence's K/V, attended inside it
            cu = packed_seq_params.cu_seqlens_q_padded
            _, rank, size = _cp()
            dropout = self.dropout if self.training else 0.0
            with tensor_parallel.get_cuda_rng_tracker().fork() if dropout else contextlib.nullcontext():
                return packed_attention(query, gather_sequence(key, dim=0, sum_grads=True, cu_seqlens=cu),
                                        gather_sequence(value, dim=0, sum_grads=True, cu_seqlens=cu), cu,
                                        scale=self.scale, dropout=dropout, cp_rank=rank, cp_size=size)
        s, b = query.shape[:2]
        k_Sbgh = gather_sequence(key, dim=0, sum_grads=True)
        v_Sbgh = gather_sequence(value, dim=0, sum_grads=True)
        if self.heads > self.groups:
            k_Sbgh = k_Sbgh.repeat_interleave(self.heads // self.groups, dim=2)
            v_Sbgh = v_Sbgh.repeat_interleave(self.heads // self.groups, dim=2)
        _, rank, size = _cp()
        S = k_Sbgh.shape[0]
        q_pos_s = cp_positions(S, rank, size).to(query.device)
        masked_sS = torch.arange(S, device=query.device)[None, :] > q_pos_s[:, None]
        scores_bnsS = torch.einsum("sbnh,Sbnh->bnsS", query.float(), k_Sbgh.float()) * self.scale
        probs_bnsS = scores_bnsS.masked_fill(masked_sS, float("-inf")).softmax(-1).to(query.dtype)
        if self.training and self.dropout > 0:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs_bnsS = torch.nn.functional.dropout(probs_bnsS, self.dropout)
        context_sbnh = torch.einsum("bnsS,Sbnh->sbnh", probs_bnsS, v_Sbgh)
        return context_sbnh.reshape(s, b, -1)
