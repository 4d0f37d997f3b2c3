"""Response tokens of a RolloutBatch as the reward managers see them."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

from hybridrl.batch import RolloutBatch

if TYPE_CHECKING:  # annotations only: static validation loads these classes without transformers
    from transformers import PreTrainedTokenizerBase


def response_tokens(batch: RolloutBatch) -> list[list[int]]:
    """Each sample's generated tokens (those under ``response_mask``), EOS included if sampled."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(batch.response_ids, batch.response_mask, strict=True)]


def last_turn_tokens(batch: RolloutBatch) -> list[list[int]]:
    """Each sample's last policy turn: its tokens from the start of the last run of ``loss_mask`` = 1 (what a
    multi-turn rollout appended before it excluded; a single-turn response is one turn: all of it)."""
    out = []
    for ids, real, mask in zip(batch.response_ids, batch.response_mask, batch.loss_mask, strict=True):
        n, m = int(real.sum()), mask.tolist()
        last = max((i for i in range(n) if m[i]), default=-1)
        start = last
        while start > 0 and m[start - 1]:
            start -= 1
        out.append(ids[max(start, 0):n].tolist() if last >= 0 else ids[:n].tolist())
    return out


def cut_at_end(tokens: list[int], end_ids: Collection[int]) -> list[int] | None:
    """The tokens before the first of ``end_ids``; ``None`` when the response never ended."""
    for i, token in enumerate(tokens):
        if token in end_ids:
            return tokens[:i]
    return None


def decode(tokenizer: PreTrainedTokenizerBase, tokens: list[int], *, skip_special_tokens: bool = False) -> str:
    text = tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)
    assert isinstance(text, str)  # one sequence in, one string out
    return text
