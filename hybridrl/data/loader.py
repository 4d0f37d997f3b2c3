"""The prompt loader of one DP rank: dataset + sampler + collate, resumable through the sampler.

Iterated in-process (no worker processes), so ``state_dict()`` is exactly the position of the
batches handed out so far; there is no prefetch to account for.
"""

from __future__ import annotations

from collections.abc import Iterator

from hybridrl.data.collate import PromptBatch, collate_prompts
from hybridrl.data.dataset import PromptDataset
from hybridrl.data.sampler import DistributedPromptSampler, SamplerConfig


class PromptLoader:
    """This rank's :class:`PromptBatch` of every global batch; one epoch per ``iter()``."""

    def __init__(self, dataset: PromptDataset, *, sampler: SamplerConfig, dp_rank: int, dp_size: int) -> None:
        pad_token_id = dataset.tokenizer.pad_token_id
        if pad_token_id is None:
            raise ValueError("the tokenizer has no pad token; prompts are left-padded with it")
        self.dataset = dataset
        self.pad_token_id: int = pad_token_id
        self.sampler = DistributedPromptSampler(len(dataset), config=sampler, dp_rank=dp_rank, dp_size=dp_size)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[PromptBatch]:
        for indices in self.sampler:
            yield collate_prompts([self.dataset[i] for i in indices], indices, pad_token_id=self.pad_token_id)

    def forever(self) -> Iterator[PromptBatch]:
        """Batch after batch, epoch after epoch (nothing is drawn before the first ``next``)."""
        while True:
            yield from self

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.load_state_dict(state)
