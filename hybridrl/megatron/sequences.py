"""Token layout of the Megatron forward: each sample's prompt + response, left-aligned.

The rollout batch keeps prompts left-padded and responses right-padded. For the actor forward every
row is shifted so that its real tokens start at position 0 and padding only trails:
``[p_0 … p_{P_b-1} r_0 … r_{T_b-1} pad …]``. Then the plain causal mask is exact (no real token
ever attends to padding), on Megatron's local attention and on Transformer Engine's alike, and
position ids are ``arange``. The log-prob of response token ``r_t`` is read from the logits at
sequence index ``P_b - 1 + t``.
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

    @property
    def seq_len(self) -> int:
        return self.tokens_BS.shape[1]

    @property
    def shared_prompts(self) -> bool:
        return self.row_B is not None

    def response_index_BT(self) -> torch.Tensor:
        """Index into the S-1 next-token predictions of sample b's row for each of its response tokens: the
        prompt's last position for the first, then the response's own previous token."""
        T = self.response_mask_BT.shape[1]
        t_1T = torch.arange(T, device=self.prompt_len_B.device)[None, :]
        start_B = self.prompt_len_B if self.response_start_B is None else self.response_start_B
        idx_BT = torch.where(t_1T == 0, self.prompt_len_B[:, None] - 1, start_B[:, None] - 1 + t_1T)
        return idx_BT.clamp(max=self.seq_len - 2)

    def real_positions(self, valid_B: torch.Tensor) -> int:
        """How many of the ``R·S`` computed positions hold a real token of a ``valid_B`` sample (a filler row's are
        padding): each sample's response, and its prompt once per row (the shared-prompt layout's samples share it)."""
        valid_B = valid_B.bool()
        responses = int(self.response_mask_BT.sum(-1)[valid_B].sum())
        if self.row_B is None:
            return responses + int(self.prompt_len_B[valid_B].sum())
        rows = {int(r): int(p) for r, p in zip(self.row_B[valid_B].tolist(), self.prompt_len_B[valid_B].tolist(),
                                              strict=True)}
        return responses + sum(rows.values())

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


def padded_seq_len(batch: RolloutBatch, multiple: int = 8) -> int:
    """Longest prompt + response in ``batch``, rounded up to ``multiple`` (fewer distinct shapes)."""
    longest = int((batch.prompt_mask.sum(-1) + batch.response_mask.sum(-1)).max()) if len(batch) else 2
    return padded_len(longest, multiple)  # the rounding the token-budget partition plans with
