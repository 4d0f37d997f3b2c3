"""Which positions of a row each context-parallel (CP) rank holds: Megatron's load-balanced chunks.

A sequence of S tokens is cut into 2·CP chunks of S/(2·CP); CP rank r holds chunks r and 2·CP−1−r
(``utils.get_batch_on_this_cp_rank``; ``GPTModel`` slices its RoPE table the same way), which balances the causal
attention's work. A packed row (THD) is split sequence by sequence, as Transformer Engine's
``thd_get_partitioned_indices`` and Megatron's THD RoPE do. Pure index arithmetic: no process groups.
"""

from __future__ import annotations

import torch


def cp_positions(seq_len: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Global positions held by ``cp_rank``: chunks r and 2·CP−1−r of ``seq_len // (2·CP)`` tokens."""
    if seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} must be a multiple of 2 × context_parallel_size "
                         f"= {2 * cp_size}")
    chunk = seq_len // (2 * cp_size)
    first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def held_positions(seq_len: int, cp_rank: int, cp_size: int, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Positions of a row of ``seq_len`` held by ``cp_rank``: :func:`cp_positions`, or with packed sequences
    (``cu_seqlens``: their ``[n + 1]`` padded boundaries) those of every sequence, offset by its start."""
    if cu_seqlens is None:
        return cp_positions(seq_len, cp_rank, cp_size)
    bounds = cu_seqlens.tolist()
    return torch.cat([start + cp_positions(end - start, cp_rank, cp_size)
                      for start, end in zip(bounds[:-1], bounds[1:], strict=True)])
