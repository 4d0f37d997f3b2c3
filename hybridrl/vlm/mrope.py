"""Interleaved multimodal RoPE (Qwen3-VL; Bai et al. 2025, "Qwen3-VL Technical Report", §2) on Megatron.

Each position has three ids (time, height, width), as in Qwen2-VL's M-RoPE; what differs is which rotary frequency
channel each axis drives. With ``mrope_section`` = (s_t, s_h, s_w), Σ = head_dim / 2 channels:

    Qwen2.5-VL (contiguous)    channels [0, s_t) ← time, [s_t, s_t + s_h) ← height, the rest ← width
    Qwen3-VL (interleaved)     channel j ← height if j ≡ 1 (mod 3) and j < 3·s_h,
                                          width  if j ≡ 2 (mod 3) and j < 3·s_w,  else time

so every axis gets low and high frequencies alike. Megatron-core 0.16's ``MultimodalRotaryEmbedding`` knows only the
contiguous split; :class:`InterleavedMRoPE` takes its frequencies and applies the interleaved one (transformers 5's
``Qwen3VLTextRotaryEmbedding.recomposition_frequencies``). Text tokens have three equal ids, so either split is
plain RoPE on text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def channel_axes(mrope_section: Sequence[int]) -> torch.Tensor:
    """``[head_dim / 2]`` long: the axis (0 time, 1 height, 2 width) that drives each rotary frequency channel."""
    half = sum(mrope_section)
    j = torch.arange(half)
    axes = torch.zeros(half, dtype=torch.long)
    axes[(j % 3 == 1) & (j < 3 * mrope_section[1])] = 1
    axes[(j % 3 == 2) & (j < 3 * mrope_section[2])] = 2
    return axes


class InterleavedMRoPE(torch.nn.Module):
    """Megatron's ``MultimodalRotaryEmbedding`` (``base``: its inverse frequencies and CP group) with the interleaved
    channel layout; the same call and output (``[s, b, 1, head_dim]``) as the module it replaces."""

    def __init__(self, base: Any) -> None:
        super().__init__()
        self.base = base

    def forward(self, position_ids: torch.Tensor, mrope_section: list[int], cp_group: Any = None) -> torch.Tensor:
        from megatron.core.models.common.embeddings.rotary_pos_embedding import get_pos_emb_on_this_cp_rank

        base = self.base
        if base.rotary_interleaved:
            raise NotImplementedError("interleaved M-RoPE with rotary_interleaved=True (GPT-J style pairs)")
        seq = position_ids.to(device=base.inv_freq.device, dtype=torch.float32)
        if base.seq_len_interpolation_factor is not None:
            seq = seq / base.seq_len_interpolation_factor
        freqs = seq[..., None] * base.inv_freq.float()  # [3, b, s, half]
        axes = channel_axes(mrope_section).to(freqs.device)
        picked = freqs.gather(0, axes.expand(1, *freqs.shape[1:]))[0]  # [b, s, half]
        emb = torch.cat((picked, picked), dim=-1)[..., None, :].transpose(0, 1).contiguous()  # [s, b, 1, dim]
        group = cp_group if cp_group is not None else base.cp_group
        if group is not None and group.size() > 1:
            emb = get_pos_emb_on_this_cp_rank(emb, 0, group)
        return emb


def use_interleaved_mrope(model: Any) -> None:
    """Swap a ``GPTModel``'s multimodal RoPE for :class:`InterleavedMRoPE` (Qwen3-VL's language model)."""
    model.rotary_pos_emb = InterleavedMRoPE(model.rotary_pos_emb)
