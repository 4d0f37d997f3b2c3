"""Collate tokenized prompts into one left-padded batch (generation appends on the right)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridrl.batch import SampleMeta
from hybridrl.data.dataset import PromptItem


@dataclass(slots=True, kw_only=True)
class PromptBatch:
    input_ids: torch.Tensor  # [B, P] long, left-padded with pad_token_id
    attention_mask: torch.Tensor  # [B, P] long, 1 on prompt tokens
    index: torch.Tensor  # [B] long, dataset index of each prompt
    meta: list[SampleMeta]  # [B]
    pad_token_id: int

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: range) -> PromptBatch:
        """The prompts at positions ``rows``, left padding trimmed to their own longest prompt."""
        width = int(self.attention_mask[rows.start:rows.stop].sum(-1).max()) if len(rows) else 0
        return PromptBatch(input_ids=self.input_ids[rows.start:rows.stop, self.input_ids.shape[1] - width:],
                           attention_mask=self.attention_mask[rows.start:rows.stop, self.input_ids.shape[1] - width:],
                           index=self.index[rows.start:rows.stop], meta=self.meta[rows.start:rows.stop],
                           pad_token_id=self.pad_token_id)

    def token_lists(self) -> list[list[int]]:
        """Each prompt's tokens without padding (the input of ``RolloutEngine.generate``)."""
        return [ids[mask.bool()].tolist() for ids, mask in zip(self.input_ids, self.attention_mask, strict=True)]


def collate_prompts(items: Sequence[PromptItem], indices: Sequence[int], *, pad_token_id: int) -> PromptBatch:
    """Left-pad ``items`` (taken from the dataset at ``indices``) to the longest prompt."""
    length = max((len(it.prompt_ids) for it in items), default=0)
    input_ids = torch.full((len(items), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(items), length), dtype=torch.long)
    for row, item in enumerate(items):
        n = len(item.prompt_ids)
        if n:
            input_ids[row, length - n :] = torch.tensor(item.prompt_ids, dtype=torch.long)
            attention_mask[row, length - n :] = 1
    return PromptBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        index=torch.tensor(list(indices), dtype=torch.long),
        meta=[it.meta for it in items],
        pad_token_id=pad_token_id,
    )
