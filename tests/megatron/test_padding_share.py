"""``perf/padding_share/<pass>`` counts, per micro-batch, the computed positions (rows × their length) that hold no
real token: each sample's prompt and response are real, a filler row is all padding, and in shared-prompt rows the
prompt is one row's once (``PackedRows.real_positions``)."""

from __future__ import annotations

import torch

from hybridrl.batch import RolloutBatch, SampleMeta
from hybridrl.megatron.prefix_grouper import pack_groups
from hybridrl.megatron.sequences import pack_rows

PAD = 0


def _batch(prompts: list[list[int]], responses: list[list[int]]) -> RolloutBatch:
    B, P, T = len(prompts), max(map(len, prompts)), max(map(len, responses))
    prompt_ids, prompt_mask = torch.full((B, P), PAD), torch.zeros(B, P, dtype=torch.long)
    response_ids, response_mask = torch.full((B, T), PAD), torch.zeros(B, T, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        prompt_ids[b, P - len(p):], prompt_mask[b, P - len(p):] = torch.tensor(p), 1
        response_ids[b, :len(r)], response_mask[b, :len(r)] = torch.tensor(r), 1
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                        response_mask=response_mask, rollout_logprobs=torch.zeros(B, T),
                        weight_version=torch.zeros(B, dtype=torch.long), group_index=torch.arange(B),
                        meta=[SampleMeta() for _ in range(B)], pad_token_id=PAD)


def test_real_positions_of_plain_rows_and_of_filler_rows() -> None:
    batch = _batch([[5, 6, 7], [8]], [[1, 2], [3, 4, 5, 6]])
    rows = pack_rows(batch, seq_len=8, pad_token_id=PAD)
    assert rows.tokens_BS.numel() == 16
    assert rows.real_positions(torch.tensor([True, True])) == 3 + 2 + 1 + 4  # padding share 6/16
    assert rows.real_positions(torch.tensor([True, False])) == 5  # the second row a filler


def test_a_shared_prompt_counts_once_per_row() -> None:
    batch = _batch([[5, 6, 7]] * 3, [[1, 2], [3], [4, 5, 6]])
    rows = pack_groups(batch, [3], pad_token_id=PAD)
    assert rows.real_positions(torch.ones(3, dtype=torch.bool)) == 3 + 2 + 1 + 3
    assert rows.tokens_BS.numel() >= 9
