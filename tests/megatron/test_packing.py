"""Packed rows (``actor_rollout_ref.actor.megatron.use_remove_padding``, on by default): the layout, its token-sum
micro-batches, the forward against transformers for a dense, an MoE and a multi-latent-attention model, and the
upstream refusal the local attention works around. That a whole RL step packed equals the padded one and the single
rank at TP=2, PP=2, CP=2, VPP, DP=2 and with token budgets is tests/parallel/test_rl_step_layouts.py (every layout
packs by default; ``-pad`` layouts do not)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hybridrl.batch import RolloutBatch, SampleMeta
from hybridrl.megatron.config import MicroBatching
from hybridrl.megatron.dynamic_batch import token_sum_partition
from hybridrl.megatron.sequences import pack_rows, pack_sequences

WORKER = str(Path(__file__).parent / "workers" / "packed_rows.py")
PAD = 0


def _batch(prompts: list[list[int]], responses: list[list[int]]) -> RolloutBatch:
    B, P, T = len(responses), max(map(len, prompts)), max(map(len, responses))
    prompt_ids, prompt_mask = torch.full((B, P), PAD), torch.zeros(B, P, dtype=torch.long)
    response_ids, response_mask = torch.full((B, T), PAD), torch.zeros(B, T, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        prompt_ids[b, P - len(p):], prompt_mask[b, P - len(p):] = torch.tensor(p), 1
        response_ids[b, :len(r)], response_mask[b, :len(r)] = torch.tensor(r), 1
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                        response_mask=response_mask, rollout_logprobs=torch.zeros(B, T),
                        weight_version=torch.zeros(B, dtype=torch.long), group_index=torch.arange(B),
                        meta=[SampleMeta() for _ in range(B)], pad_token_id=PAD)


def test_layout_boundaries_and_response_index() -> None:
    batch = _batch([[11, 12, 13], [21], [31, 32]], [[41, 42], [51, 52, 53], [61]])
    rows = pack_sequences(batch, pad_token_id=PAD)
    assert rows.tokens_BS.tolist() == [[11, 12, 13, 41, 42, 21, 51, 52, 53, 31, 32, 61]]
    assert rows.position_ids_BS.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]]
    assert rows.cu_seqlens.tolist() == rows.cu_seqlens_padded.tolist() == [0, 5, 9, 12]
    idx = rows.flat_response_index_BT()  # the position that predicts each response token, in the one row
    assert idx[0, :2].tolist() == [2, 3] and idx[1, :3].tolist() == [5, 6, 7] and idx[2, :1].tolist() == [10]
    assert rows.real_positions(torch.ones(3, dtype=torch.bool)) == 12
    # CP = 2 rounds each sequence to 4 tokens; sequence parallelism the row to 8 (the last sequence takes it)
    cp = pack_sequences(batch, pad_token_id=PAD, multiple=4, total_multiple=8)
    assert cp.cu_seqlens.tolist() == [0, 5, 9, 12] and cp.cu_seqlens_padded.tolist() == [0, 8, 12, 16]
    assert cp.tokens_BS.tolist() == [[11, 12, 13, 41, 42, 0, 0, 0, 21, 51, 52, 53, 31, 32, 61, 0]]
    assert cp.flat_response_index_BT()[1, :3].tolist() == [8, 9, 10]
    assert cp.real_positions(torch.tensor([True, True, False])) == 9  # a filler's tokens are padding
    # every real token's place among the row's positions (router replay reads the engine's routing through it)
    where = cp.token_index_BL(3)
    assert where[1].tolist() == [-1, -1, 8, 9, 10, 11] and where[2].tolist() == [-1, 12, 13, 14, -1, -1]
    # the padded layout's map is the row-per-sample one
    plain = pack_rows(batch, seq_len=6, pad_token_id=PAD)
    assert plain.token_index_BL(3)[1].tolist() == [-1, -1, 6, 7, 8, 9]


def test_shared_prompt_groups_in_one_row() -> None:
    """use_prefix_grouper with packing: each group's prompt once, its responses after it, the groups end to end;
    a response's first token is predicted at its prompt's last position."""
    from hybridrl.megatron.prefix_grouper import pack_groups_in_one_row

    batch = _batch([[11, 12, 13], [11, 12, 13], [21, 22]], [[31, 32], [41], [51, 52, 53]])
    rows = pack_groups_in_one_row(batch, [2, 1], pad_token_id=PAD)
    assert rows.tokens_BS.tolist() == [[11, 12, 13, 31, 32, 41, 21, 22, 51, 52, 53]]
    assert rows.position_ids_BS.tolist() == [[0, 1, 2, 3, 4, 3, 0, 1, 2, 3, 4]]
    # (prefix start, prefix length, own start, own length): prompt, response, response; prompt, response
    assert rows.blocks.tolist() == [[0, 0, 0, 3], [0, 3, 3, 2], [0, 3, 5, 1], [6, 0, 6, 2], [6, 2, 8, 3]]
    idx = rows.flat_response_index_BT()
    assert idx[0, :2].tolist() == [2, 3] and idx[1, :1].tolist() == [2] and idx[2, :3].tolist() == [7, 8, 9]
    assert rows.real_positions(torch.ones(3, dtype=torch.bool)) == 11  # each prompt once


def test_token_sum_bins_hold_the_budget_and_every_sample() -> None:
    lengths = [37, 5, 12, 30, 8, 8, 3, 25, 1, 19]
    bins = token_sum_partition(lengths, max_tokens=40)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 40 for b in bins) and all(b == sorted(b) for b in bins)
    assert len(bins) == -(-sum(lengths) // 40)  # first-fit decreasing reaches the bound here (148 tokens, 4 bins)
    assert all(sum(-(-lengths[i] // 4) * 4 for i in b) <= 40 for b in token_sum_partition(lengths, max_tokens=40,
                                                                                          multiple=4))
    with pytest.raises(ValueError, match="a sample of 37 tokens does not fit the token budget of 36"):
        token_sum_partition(lengths, max_tokens=36)
    assert str(MicroBatching(micro_batch_size=4, max_tokens=64, packed=True)) == "≤ 64 tokens, packed"


@pytest.fixture(scope="module")
def packed_rows(torchrun, tmp_path_factory: pytest.TempPathFactory, discriminate: Callable[[Path, int], Path]) -> dict:
    from hybridrl.models.tiny import make_tiny_model

    tmp = tmp_path_factory.mktemp("packed_rows")
    shape = dict(hidden=48, layers=2, heads=4, kv_heads=2, max_positions=64, tie=False)
    moe = make_tiny_model(tmp / "moe", arch="qwen3_moe", moe=dict(moe_intermediate_size=16), seed=2, **shape)
    mla = make_tiny_model(tmp / "mla", arch="deepseek_v3", moe=dict(moe_intermediate_size=16), seed=3,
                          **(shape | dict(kv_heads=4)))
    dense = make_tiny_model(tmp / "dense", arch="qwen2", seed=1, **shape)
    dirs = [str(discriminate(path, seed)) for seed, path in enumerate((moe, mla, dense))]
    torchrun([WORKER, str(tmp / "out.json"), *dirs], nproc=1)
    return json.loads((tmp / "out.json").read_text())


@pytest.mark.distributed
def test_packed_rows_give_each_sample_alone(packed_rows: dict) -> None:
    """Every response token's logits in one packed row = transformers on its sample alone (a leak across sequences
    or a RoPE that did not restart would move them by far more)."""
    # 5 sequences of 7, 8, 8, 11, 7 tokens, each rounded to 4: 8 + 8 + 8 + 12 + 8 = 44, the row to 32: 64
    assert packed_rows["row_shape"] == [1, 64]
    # two shared-prompt groups in one row: prompts of 4 and 7 tokens once, responses 3 + 6 + 2 and 1 + 5
    assert packed_rows["shared_shape"] == [1, 4 + 3 + 6 + 2 + 7 + 1 + 5]
    for name in ("dense", "moe", "mla"):
        assert packed_rows[name] < 1e-5, (name, packed_rows[name])
    for name in ("dense", "moe"):  # shared-prompt rows are refused with multi-latent attention (validation)
        assert packed_rows[f"{name}_shared"] < 1e-5, (name, packed_rows[f"{name}_shared"])


@pytest.mark.distributed
def test_megatron_local_attention_still_refuses_packed_sequences(packed_rows: dict) -> None:
    """Upstream: the local DotProductAttention asserts packed_seq_params is None (packed_attention.py works around it);
    this fails once it takes them."""
    assert packed_rows["upstream_refuses"] is True
