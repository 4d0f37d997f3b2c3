"""Token layouts of the Megatron forward: a sample's prompt + response, left-aligned, in a row of its own or
packed end to end with the others.

The rollout batch keeps prompts left-padded and responses right-padded. Padded (:func:`pack_rows`): every
row is shifted so that its real tokens start at position 0 and padding only trails:
``[p_0 … p_{P_b-1} r_0 … r_{T_b-1} pad …]``. Then the plain causal mask is exact (no real token
ever attends to padding), on Megatron's local attention and on Transformer Engine's alike, and
position ids are ``arange``. The log-prob of response token ``r_t`` is read from the logits at
sequence index ``P_b - 1 + t``.

Packed (:func:`pack_sequences`, verl's ``use_remove_padding``): the samples of a micro-batch follow one another
in a single row, ``[p¹ r¹ | p² r² | …]``, each sequence ``i`` in ``[A_i, A_i + L_i)`` with ``A`` = Megatron's
``cu_seqlens_padded`` (THD, ``PackedSeqParams``): RoPE restarts at every ``A_i`` and attention stays inside each
sequence (Transformer Engine's varlen attention on GPU, :mod:`hybridrl.megatron.packed_attention` on CPU). No
position is computed for padding except the few that round a sequence up to ``multiple`` (2·CP: CP's chunks) and the
row up to ``total_multiple`` (sequence parallelism's TP split).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridrl.batch import RolloutBatch
from hybridrl.megatron.dynamic_batch import padded_len


@dataclass(slots=True, kw_only=True)
class PackedRows:
    """The model's input rows. Plain layout: row b is sample b. Shared-prompt layout
    (:mod:`prefix_grouper`): ``R`` rows, sample b's response in row ``row_B[b]`` from ``response_start_B[b]``,
    with explicit positions and attention mask."""

    tokens_BS: torch.Tensor  # [R, S] long; real tokens first, then pad (R = B in the plain layout)
    prompt_len_B: torch.Tensor  # [B] long
    response_mask_BT: torch.Tensor  # [B, T]
    row_B: torch.Tensor | None = None  # [B] long: the row holding sample b (None: row b)
    response_start_B: torch.Tensor | None = None  # [B] long: its first response token's index (None: prompt_len_B)
    position_ids_BS: torch.Tensor | None = None  # [R, S] long (None: arange(S) in every row)
    attention_mask: torch.Tensor | None = None  # [R, 1, S, S] bool, True = masked (None: plain causal)
    prompt_end_B: torch.Tensor | None = None  # [B] long: its prompt's end in its row (None: prompt_len_B)
    # packed (THD): [n + 1] int32 boundaries of the n sequences of the one row — real tokens, and with the padding
    # that rounds each up (Megatron's cu_seqlens / cu_seqlens_padded)
    cu_seqlens: torch.Tensor | None = None
    cu_seqlens_padded: torch.Tensor | None = None
    # shared-prompt groups in one row: [n, 4] long (prefix start, prefix length, own start, own length), each block's
    # own tokens attending to its prefix and causally to themselves (packed_attention.SharedPrefixParams)
    blocks: torch.Tensor | None = None

    @property
    def seq_len(self) -> int:
        return self.tokens_BS.shape[1]

    @property
    def shared_prompts(self) -> bool:
        """Samples share rows (packed or shared-prompt): read each response token at its own position."""
        return self.row_B is not None

    @property
    def packed(self) -> bool:
        return self.cu_seqlens_padded is not None

    def response_index_BT(self) -> torch.Tensor:
        """Index into the S-1 next-token predictions of sample b's row for each of its response tokens: the
        prompt's last position for the first, then the response's own previous token."""
        T = self.response_mask_BT.shape[1]
        t_1T = torch.arange(T, device=self.prompt_len_B.device)[None, :]
        start_B = self.prompt_len_B if self.response_start_B is None else self.response_start_B
        end_B = self.prompt_len_B if self.prompt_end_B is None else self.prompt_end_B
        idx_BT = torch.where(t_1T == 0, end_B[:, None] - 1, start_B[:, None] - 1 + t_1T)
        return idx_BT.clamp(max=self.seq_len - 2)

    def real_positions(self, valid_B: torch.Tensor) -> int:
        """How many of the ``R·S`` computed positions hold a real token of a ``valid_B`` sample (a filler row's are
        padding): each sample's response, and its prompt once per row (the shared-prompt layout's samples share it)."""
        valid_B = valid_B.bool()
        responses = int(self.response_mask_BT.sum(-1)[valid_B].sum())
        if self.row_B is None or self.packed:
            return responses + int(self.prompt_len_B[valid_B].sum())
        group_B = self.row_B if self.prompt_end_B is None else self.prompt_end_B  # a prompt per row, or per group
        prompts = {int(g): int(p) for g, p in zip(group_B[valid_B].tolist(), self.prompt_len_B[valid_B].tolist(),
                                                 strict=True)}
        return responses + sum(prompts.values())

    def token_index_BL(self, P: int) -> torch.Tensor:
        """``[B, P + T]``: where each position of sample b's ``prompt ‖ response`` (prompt left-padded to ``P``) sits
        among the ``R·S`` positions of the rows (row-major); -1 for padding. Not for shared-prompt rows."""
        if self.shared_prompts and not self.packed:
            raise ValueError("shared-prompt rows (actor.use_prefix_grouper) hold a prompt once for several samples")
        B, T = self.response_mask_BT.shape
        device = self.prompt_len_B.device
        j_1L = torch.arange(P + T, device=device)[None, :]
        offset_B1 = (P - self.prompt_len_B)[:, None]  # position 0 of the row = index P - p_b of prompt ‖ response
        real_BL = (j_1L >= offset_B1) & (j_1L < P + self.response_mask_BT.sum(-1)[:, None])
        first_B1 = (self.row_B * self.seq_len + self.prompt_end_B - self.prompt_len_B)[:, None] if self.packed \
            else torch.arange(B, device=device)[:, None] * self.seq_len
        return torch.where(real_BL, first_B1 + j_1L - offset_B1, -1)

    def at_responses(self, x_RS: torch.Tensor) -> torch.Tensor:
        """``[B, T, …]``: the whole rows' per-position ``x_RS`` (``[R, S, …]``) at :meth:`flat_response_index_BT`."""
        return x_RS.reshape(-1, *x_RS.shape[2:])[self.flat_response_index_BT()]

    def flat_response_index_BT(self) -> torch.Tensor:
        """:meth:`response_index_BT` into the ``R·S`` positions of all rows (row-major)."""
        row_B = self.row_B if self.row_B is not None else torch.arange(len(self.prompt_len_B),
                                                                        device=self.prompt_len_B.device)
        return row_B[:, None] * self.seq_len + self.response_index_BT()


def pack_rows(batch: RolloutBatch, *, seq_len: int, pad_token_id: int) -> PackedRows:
    """Left-align ``batch``'s rows into ``[B, seq_len]`` (``seq_len`` ≥ longest prompt + response), on the
    batch's device."""
    B, T = batch.response_ids.shape
    prompt_len_B = batch.prompt_mask.sum(-1).long()
    response_len_B = batch.response_mask.sum(-1).long()
    longest = int((prompt_len_B + response_len_B).max()) if B else 0
    if seq_len < max(longest, 2):
        raise ValueError(f"seq_len={seq_len} is shorter than the longest prompt + response ({longest})")
    # row b's real tokens sit at [P - p_b, P + r_b) of prompt ‖ response: shift them to position 0 (one
    # gather, no per-row loop: no host syncs on a GPU)
    P = batch.prompt_ids.shape[1]
    both_BL = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)
    pos_BS = torch.arange(seq_len, device=both_BL.device)[None, :].expand(B, seq_len)
    src_BS = (pos_BS + (P - prompt_len_B)[:, None]).clamp(max=both_BL.shape[1] - 1)
    real_BS = pos_BS < (prompt_len_B + response_len_B)[:, None]
    tokens_BS = torch.where(real_BS, both_BL.gather(1, src_BS), pad_token_id)
    return PackedRows(tokens_BS=tokens_BS, prompt_len_B=prompt_len_B, response_mask_BT=batch.response_mask)


def pack_sequences(batch: RolloutBatch, *, pad_token_id: int, multiple: int = 1, total_multiple: int = 1,
                   total_len: int = 0) -> PackedRows:
    """``batch``'s samples end to end in one row ``[1, N]`` (module docstring), on the batch's device: sample ``b``'s
    ``p_b + r_b`` tokens from ``A_b``, each sequence rounded up to ``multiple``, the row to ``total_multiple`` and at
    least ``total_len`` (both by lengthening the last sequence's padding)."""
    B = len(batch)
    device = batch.prompt_ids.device
    prompt_len_B = batch.prompt_mask.sum(-1).long()
    length_B = prompt_len_B + batch.response_mask.sum(-1).long()
    if B == 0 or int(length_B.min()) < 1:
        raise ValueError("pack_sequences: every sample needs at least one token")
    padded_B = -(-length_B // multiple) * multiple
    N = max(padded_len(int(padded_B.sum()), total_multiple), total_len)
    padded_B[-1] += N - int(padded_B.sum())
    zero = torch.zeros(1, dtype=torch.long, device=device)
    start_B = torch.cat([zero, padded_B.cumsum(0)[:-1]])
    rows = pack_rows(batch, seq_len=max(int(length_B.max()), 2), pad_token_id=pad_token_id)
    S = rows.seq_len
    real_BS = torch.arange(S, device=device)[None, :] < length_B[:, None]
    dest_BS = start_B[:, None] + torch.arange(S, device=device)[None, :]
    tokens_N = torch.full((N,), pad_token_id, dtype=rows.tokens_BS.dtype, device=device)
    tokens_N[dest_BS[real_BS]] = rows.tokens_BS[real_BS]
    seq_N = torch.repeat_interleave(torch.arange(B, device=device), padded_B)
    positions_N = torch.arange(N, device=device) - start_B[seq_N]
    return PackedRows(tokens_BS=tokens_N[None], prompt_len_B=prompt_len_B, response_mask_BT=batch.response_mask,
                      row_B=torch.zeros(B, dtype=torch.long, device=device), response_start_B=start_B + prompt_len_B,
                      prompt_end_B=start_B + prompt_len_B, position_ids_BS=positions_N[None],
                      cu_seqlens=torch.cat([zero, length_B.cumsum(0)]).int(),
                      cu_seqlens_padded=torch.cat([zero, padded_B.cumsum(0)]).int())


def padded_seq_len(batch: RolloutBatch, multiple: int = 8) -> int:
    """Longest prompt + response in ``batch``, rounded up to ``multiple`` (fewer distinct shapes)."""
    longest = int((batch.prompt_mask.sum(-1) + batch.response_mask.sum(-1)).max()) if len(batch) else 2
    return padded_len(longest, multiple)  # the rounding the token-budget partition plans with
