"""Hand-made RolloutBatches of decoded responses for the reward tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from hybridrl.batch import RolloutBatch, SampleMeta
from hybridrl.models.char_tokenizer import make_char_tokenizer

MakeBatch = Callable[..., RolloutBatch]


@pytest.fixture(scope="session")
def tok() -> PreTrainedTokenizerBase:
    return make_char_tokenizer(model_max_length=64)


@pytest.fixture
def make_batch(tok: PreTrainedTokenizerBase) -> MakeBatch:
    """``make_batch(["46<eos>", "12"], ["46", "13"])``: responses with the literal ``<eos>`` replaced
    by the tokenizer's EOS token, right-padded; prompts are a single token."""

    def make(responses: list[str], ground_truths: list[str | None] | None = None) -> RolloutBatch:
        eos = tok.eos_token
        rows = [tok(r.replace("<eos>", eos), add_special_tokens=False)["input_ids"] for r in responses]
        b, t = len(rows), max(1, *(len(r) for r in rows))
        response_ids = torch.full((b, t), tok.pad_token_id)
        response_mask = torch.zeros(b, t, dtype=torch.long)
        for i, r in enumerate(rows):
            response_ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            response_mask[i, : len(r)] = 1
        truths = ground_truths if ground_truths is not None else [None] * b
        return RolloutBatch(
            prompt_ids=torch.zeros(b, 1, dtype=torch.long), prompt_mask=torch.ones(b, 1, dtype=torch.long),
            response_ids=response_ids, response_mask=response_mask, rollout_logprobs=torch.zeros(b, t),
            weight_version=torch.zeros(b, dtype=torch.long), group_index=torch.arange(b),
            meta=[SampleMeta(ground_truth=g) for g in truths], pad_token_id=tok.pad_token_id,
        )

    return make
