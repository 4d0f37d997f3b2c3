"""Packed sequences (THD) through Megatron's local core attention: attention confined to each sequence.

A packed row (:func:`~hybridrl.megatron.sequences.pack_sequences`) holds ``n`` sequences, sequence ``i`` at
``[A_i, A_i + L_i)`` (``cu_seqlens_padded``). Attention must stay inside each one:

    out_q = softmax(q Kᵢᵀ · scale, masked where key position > query position) Vᵢ      for q in sequence i

— exactly what each sample computes in a padded row of its own (trailing padding is never attended by a real token),
so hidden states, log-probs and gradients equal the padded layout's up to the order of floating-point sums.
Transformer Engine does this on GPU from ``PackedSeqParams``; megatron-core 0.16.1's local
``DotProductAttention.forward`` refuses it (``assert packed_seq_params is None``: "Packed sequence is not supported
by DotProductAttention. Please use TEDotProductAttention instead"), so the local spec (CPU) gets
:class:`PackedDotProductAttention`: Megatron's own attention for padded rows, :func:`packed_attention` for packed
ones. ``tests/megatron/test_packing.py`` fails once the local attention takes packed sequences itself.

Cost: sequences are attended in buckets of similar length (sorted, a new bucket when a sequence is shorter than
``BUCKET_RATIO`` of its bucket's longest), each bucket one batched ``scaled_dot_product_attention`` over its
sequences padded to its longest — the linear layers never see that padding, and the attention's share of it is
bounded by the ratio. With CP > 1 the query positions are this rank's chunks of each sequence and K/V the whole
sequence (gathered by :class:`~hybridrl.megatron.context_parallel.ContextParallelAttention`).

Shared-prompt groups packed in one row (``use_prefix_grouper`` with packing; :class:`SharedPrefixParams`) are blocks:
a prompt attends causally to itself, each response to its prompt and causally to itself (:func:`block_attention`) —
the mask of :mod:`~hybridrl.megatron.prefix_grouper`, without computing the masked scores of a dense row.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention

from hybridrl.megatron.cp_layout import cp_positions

BUCKET_RATIO = 0.75  # a sequence shorter than this share of its bucket's longest starts a new bucket


def _buckets(lengths: list[int]) -> list[list[int]]:
    """Sequence indices grouped by similar length (longest first)."""
    out: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if out and lengths[i] >= BUCKET_RATIO * lengths[out[-1][0]]:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def packed_attention(query_tnh: torch.Tensor, key_Ngh: torch.Tensor, value_Ngh: torch.Tensor,
                     cu_seqlens_padded: torch.Tensor, *, scale: float, dropout: float = 0.0, cp_rank: int = 0,
                     cp_size: int = 1) -> torch.Tensor:
    """Causal attention inside each packed sequence: ``query`` ``[t, n, h]`` (this CP rank's positions, ``t`` =
    ``N / CP``), ``key``/``value`` ``[N, g, h_k]``/``[N, g, h_v]`` (the whole row; GQA: ``g`` divides ``n``) →
    ``[t, n·h_v]``. ``dropout`` > 0 drops attention probabilities (in the caller's RNG state)."""
    t, n = query_tnh.shape[:2]
    g, hv = value_Ngh.shape[1:]
    bounds = cu_seqlens_padded.tolist()
    starts, lengths = bounds[:-1], [e - s for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
    device = query_tnh.device
    out_tnh = query_tnh.new_zeros(t, n, hv)
    for bucket in _buckets(lengths):
        Lk = lengths[bucket[0]]
        lq = Lk // cp_size
        k_ar, q_ar = torch.arange(Lk, device=device), torch.arange(lq, device=device)
        start_b = torch.tensor([starts[i] for i in bucket], device=device)
        length_b = torch.tensor([lengths[i] for i in bucket], device=device)
        k_idx_bL = (start_b[:, None] + k_ar[None, :]).minimum(start_b[:, None] + length_b[:, None] - 1)
        q_valid_bl = q_ar[None, :] < (length_b // cp_size)[:, None]
        q_idx_bl = (start_b // cp_size)[:, None] + q_ar[None, :].minimum((length_b // cp_size)[:, None] - 1)
        q = query_tnh[q_idx_bl].transpose(1, 2)  # [b, n, lq, h]
        k, v = key_Ngh[k_idx_bL].transpose(1, 2), value_Ngh[k_idx_bL].transpose(1, 2)  # [b, g, Lk, h]
        if cp_size == 1:
            ctx = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scale,
                                                 enable_gqa=n > g)
        else:  # this rank's chunks of each sequence (padded query rows see key 0 only; dropped below)
            q_pos_bl = torch.stack([F.pad(cp_positions(lengths[i], cp_rank, cp_size), (0, lq - lengths[i] // cp_size))
                                    for i in bucket]).to(device)
            keep_b1lL = (k_ar[None, None, :] <= q_pos_bl[:, :, None])[:, None]
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=keep_b1lL, dropout_p=dropout, scale=scale,
                                                 enable_gqa=n > g)
        out_tnh = out_tnh.index_put((q_idx_bl[q_valid_bl],), ctx.transpose(1, 2)[q_valid_bl])
    return out_tnh.reshape(t, n * hv)


@dataclass
class SharedPrefixParams(PackedSeqParams):
    """A row of shared-prompt groups end to end (:func:`~hybridrl.megatron.prefix_grouper.pack_groups_in_one_row`):
    ``blocks`` ``[n, 4]`` (prefix start, prefix length, own start, own length). Megatron carries it to the core
    attention like THD's parameters; its ``qkv_format`` is ``sbhd``, so RoPE and the layers treat the row as one
    sequence of explicit positions (:mod:`~hybridrl.megatron.rope_positions`)."""

    blocks: torch.Tensor | None = None


@dataclass
class _Bucket:
    q_idx_bl: torch.Tensor  # [b, lq] the own queries' positions (clamped)
    q_valid_bl: torch.Tensor  # [b, lq] which are real
    k_idx_bL: torch.Tensor  # [b, Lk] prefix then own keys' positions (clamped)
    keep_b1lL: torch.Tensor  # [b, 1, lq, Lk] allowed (query, key) pairs


_PLANS: dict[int, tuple[torch.Tensor, list[_Bucket]]] = {}  # the last blocks' buckets (every layer reads them)


def _block_buckets(blocks: torch.Tensor, device: torch.device) -> list[_Bucket]:
    """The buckets of :func:`block_attention` for ``blocks``, computed once per forward: every layer passes the same
    tensor."""
    cached = _PLANS.get(id(blocks))
    if cached is not None and cached[0] is blocks:
        return cached[1]
    rows = blocks.tolist()
    out = []
    for bucket in _buckets([pre + own for _, pre, _, own in rows]):
        pstart_b, pre_b, ostart_b, own_b = blocks[bucket].to(device).T
        Lk, lq = int((pre_b + own_b).max()), int(own_b.max())
        j_1L, i_1l = torch.arange(Lk, device=device)[None, :], torch.arange(lq, device=device)[None, :]
        in_prefix_bL = j_1L < pre_b[:, None]
        own_j_bL = (j_1L - pre_b[:, None]).clamp(min=0).minimum(own_b[:, None] - 1)
        out.append(_Bucket(
            q_idx_bl=ostart_b[:, None] + i_1l.minimum(own_b[:, None] - 1), q_valid_bl=i_1l < own_b[:, None],
            k_idx_bL=torch.where(in_prefix_bL, pstart_b[:, None] + j_1L, ostart_b[:, None] + own_j_bL),
            keep_b1lL=(in_prefix_bL[:, None, :] | ((j_1L - pre_b[:, None])[:, None, :] <= i_1l[:, :, None]))[:, None]))
    _PLANS.clear()
    _PLANS[id(blocks)] = (blocks, out)
    return out


def block_attention(query_Snh: torch.Tensor, key_Sgh: torch.Tensor, value_Sgh: torch.Tensor, blocks: torch.Tensor,
                    *, scale: float, dropout: float = 0.0) -> torch.Tensor:
    """Each block's own queries over its prefix's keys (all) and its own (causally): ``[S, n, h]`` → ``[S, n·h_v]``.
    A prompt is a block without a prefix; each response a block whose prefix is its prompt. Buckets of similar key
    length, one batched ``scaled_dot_product_attention`` each (as :func:`packed_attention`)."""
    S, n = query_Snh.shape[:2]
    g, hv = value_Sgh.shape[1:]
    out_Snh = query_Snh.new_zeros(S, n, hv)
    for b in _block_buckets(blocks, query_Snh.device):
        q = query_Snh[b.q_idx_bl].transpose(1, 2)
        k, v = key_Sgh[b.k_idx_bL].transpose(1, 2), value_Sgh[b.k_idx_bL].transpose(1, 2)
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=b.keep_b1lL, dropout_p=dropout, scale=scale,
                                             enable_gqa=n > g)
        out_Snh = out_Snh.index_put((b.q_idx_bl[b.q_valid_bl],), ctx.transpose(1, 2)[b.q_valid_bl])
    return out_Snh.reshape(S, n * hv)


class PackedDotProductAttention(DotProductAttention):
    """Megatron's local core attention, and :func:`packed_attention` for packed (THD) sequences (module docstring)."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)
        if attention_bias is not None or self.config.window_size is not None or \
                self.config.softmax_type != "vanilla":
            raise NotImplementedError("packed sequences on the local attention take plain causal softmax attention "
                                      "only; set actor_rollout_ref.actor.megatron.use_remove_padding=false")
        # DotProductAttention divides its scale by the layer number under apply_query_key_layer_scaling (its
        # softmax multiplies it back)
        scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)
        dropout = self.attention_dropout.p if self.training else 0.0
        with tensor_parallel.get_cuda_rng_tracker().fork() if dropout else contextlib.nullcontext():
            if isinstance(packed_seq_params, SharedPrefixParams):  # [S, 1, heads, dim]: one row, explicit blocks
                assert packed_seq_params.blocks is not None
                return block_attention(query[:, 0], key[:, 0], value[:, 0], packed_seq_params.blocks, scale=scale,
                                       dropout=dropout)[:, None]
            return packed_attention(query, key, value, packed_seq_params.cu_seqlens_q_padded, scale=scale,
                                    dropout=dropout)

