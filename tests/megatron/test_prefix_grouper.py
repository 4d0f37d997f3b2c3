"""Shared-prompt rows (``actor_rollout_ref.actor.use_prefix_grouper``): the layout, its micro-batches, the
RoPE workaround and its config checks. That a whole RL step (old/ref log-probs, two mini-batches, Adam and
SGD) gives the single-rank plain layout's answer with them at TP=2, PP=2 (token budget) and DP=2 is
tests/parallel/test_rl_step_layouts.py ("prefix")."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from hybridrl.batch import RolloutBatch, SampleMeta
from hybridrl.config.compose import compose_config
from hybridrl.config.errors import ConfigError
from hybridrl.config.validate import validate
from hybridrl.megatron.prefix_grouper import group_rows, pack_groups, partition_rows, prompt_groups
from hybridrl.megatron.sequences import pack_rows
from hybridrl.models.tiny import make_tiny_model

A = "actor_rollout_ref"
WORKER = str(Path(__file__).parent / "workers" / "prefix_rows.py")
PAD = 0


def _batch(prompts: list[list[int]], responses: list[list[int]], owner: list[int]) -> RolloutBatch:
    """Sample b answers ``prompts[owner[b]]`` with ``responses[b]``; left-padded prompts, right-padded responses."""
    B, P, T = len(responses), max(map(len, prompts)), max(map(len, responses))
    prompt_ids, prompt_mask = torch.full((B, P), PAD), torch.zeros(B, P, dtype=torch.long)
    response_ids, response_mask = torch.full((B, T), PAD), torch.zeros(B, T, dtype=torch.long)
    for b, (o, r) in enumerate(zip(owner, responses, strict=True)):
        p = prompts[o]
        prompt_ids[b, P - len(p):], prompt_mask[b, P - len(p):] = torch.tensor(p), 1
        response_ids[b, :len(r)], response_mask[b, :len(r)] = torch.tensor(r), 1
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                        response_mask=response_mask, rollout_logprobs=torch.zeros(B, T),
                        weight_version=torch.zeros(B, dtype=torch.long), group_index=torch.tensor(owner),
                        meta=[SampleMeta() for _ in range(B)], pad_token_id=PAD)


def test_layout_tokens_positions_mask_and_response_index() -> None:
    batch = _batch([[11, 12, 13], [21, 22]], [[31, 32], [41], [51, 52, 53]], owner=[0, 1, 0])
    assert prompt_groups(batch) == [[0, 2], [1]]
    part = batch.index([0, 2, 1])
    rows = pack_groups(part, [2, 1], pad_token_id=PAD)
    assert rows.tokens_BS.tolist() == [[11, 12, 13, 31, 32, 51, 52, 53], [21, 22, 41, 0, 0, 0, 0, 0]]
    assert rows.position_ids_BS.tolist() == [[0, 1, 2, 3, 4, 3, 4, 5], [0, 1, 2, 0, 0, 0, 0, 0]]
    allowed = (~rows.attention_mask[:, 0]).int()
    # row 0: the prompt (0-2) is causal; response 1 (3-4) sees prompt + itself; response 2 (5-7) likewise
    assert allowed[0].tolist() == [[1, 0, 0, 0, 0, 0, 0, 0],
                                   [1, 1, 0, 0, 0, 0, 0, 0],
                                   [1, 1, 1, 0, 0, 0, 0, 0],
                                   [1, 1, 1, 1, 0, 0, 0, 0],
                                   [1, 1, 1, 1, 1, 0, 0, 0],
                                   [1, 1, 1, 0, 0, 1, 0, 0],
                                   [1, 1, 1, 0, 0, 1, 1, 0],
                                   [1, 1, 1, 0, 0, 1, 1, 1]]
    # padding never is a key of a real token
    assert not allowed[1, :3, 3:].any()
    # the first response token is predicted at the prompt's last position; later ones at their predecessor
    idx = rows.response_index_BT()
    assert idx[0, :2].tolist() == [2, 3] and idx[1, :3].tolist() == [2, 5, 6] and idx[2, :1].tolist() == [1]
    flat = rows.flat_response_index_BT()
    assert flat[2, 0].item() == 1 * rows.seq_len + 1  # sample 2 of this part lives in row 1


def test_plain_rows_keep_their_response_index() -> None:
    """The generalised index is the plain layout's ``prompt_len - 1 + t`` when every row is one sample."""
    batch = _batch([[11, 12, 13], [21, 22]], [[31, 32], [41], [51, 52, 53]], owner=[0, 1, 0])
    rows = pack_rows(batch, seq_len=6, pad_token_id=PAD)
    T = batch.response_ids.shape[1]
    want = (batch.prompt_mask.sum(-1)[:, None] - 1 + torch.arange(T)[None]).clamp(max=4)
    assert torch.equal(rows.response_index_BT(), want)
    assert torch.equal(rows.flat_response_index_BT(), want + torch.arange(3)[:, None] * 6)


def test_rows_cut_to_the_budget_and_partitioned() -> None:
    # one prompt of 4 tokens, 5 samples of 3 tokens: 4 + 15 = 19 tokens in one row
    batch = _batch([[1, 2, 3, 4]], [[5, 6, 7]] * 5, owner=[0] * 5)
    assert group_rows(batch, max_tokens=None) == [[0, 1, 2, 3, 4]]
    assert group_rows(batch, max_tokens=13) == [[0, 1, 2], [3, 4]]  # 4 + 9 = 13, then 4 + 6
    parts = partition_rows(batch, max_tokens=13)
    assert sorted(i for part in parts for row in part for i in row) == list(range(5))
    assert all(len(part) * max(4 + 3 * len(row) for row in part) <= 13 for part in parts)
    with pytest.raises(ValueError, match="does not fit the token budget of 6"):
        group_rows(batch, max_tokens=6)
    # a sample too long even alone, after a row was already started: the same error, naming its 24 tokens
    uneven = _batch([[1, 2, 3, 4]], [[5, 6, 7], [8] * 20], owner=[0, 0])
    with pytest.raises(ValueError, match="a sample of 24 tokens .* token budget of 13"):
        partition_rows(uneven, max_tokens=13)


def test_fewer_tokens_than_one_row_per_sample() -> None:
    """grpo_tiny's shape: 6-token prompts, 8 samples of ~3 tokens each → 2.4× fewer tokens."""
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    batch = _batch(prompts, [[13, 14, 15]] * 16, owner=[b // 8 for b in range(16)])
    plain = pack_rows(batch, seq_len=9, pad_token_id=PAD).tokens_BS.numel()
    shared = pack_groups(batch, [8, 8], pad_token_id=PAD).tokens_BS.numel()
    assert (plain, shared) == (16 * 9, 2 * 30)


@pytest.fixture(scope="module")
def prefix_rows(torchrun, tmp_path_factory: pytest.TempPathFactory, discriminate) -> dict:
    tmp = tmp_path_factory.mktemp("prefix_rows")
    model = discriminate(make_tiny_model(tmp / "model", arch="qwen2", tie=True, seed=7), 7)
    torchrun([WORKER, str(model), str(tmp / "out.json")], nproc=1)
    return json.loads((tmp / "out.json").read_text())


@pytest.mark.distributed
def test_megatron_still_ignores_position_ids_for_rope(prefix_rows: dict) -> None:
    """Upstream: GPTModel's RoPE uses arange(S) whatever position_ids say (hybridrl/megatron/rope_positions.py
    works around it); this fails once Megatron applies them itself."""
    assert prefix_rows["ignored"] == 0.0


@pytest.mark.distributed
def test_positioned_rope_and_shared_rows_match_transformers(prefix_rows: dict) -> None:
    assert prefix_rows["rope_vs_plain"] > 1e-2  # the positions really moved the logits
    assert prefix_rows["rope_vs_hf"] < 1e-5  # … to transformers' logits at those positions
    assert prefix_rows["after_context"] == 0.0  # and the model is itself again afterwards
    assert prefix_rows["groups"] == [[0, 2, 4], [1, 3, 5]] and prefix_rows["row_shape"] == [2, 18]
    assert prefix_rows["rows_vs_hf"] < 1e-5  # every response token's logits = the sample alone in transformers


def _validate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *overrides: str, world: int = 1) -> str:
    monkeypatch.setenv("HYBRIDRL_CACHE_DIR", str(tmp_path))  # nothing built: model/data checks are pending
    return validate(compose_config(["recipe=grpo_tiny", f"{A}.actor.use_prefix_grouper=true", *overrides]),
                    world_size=world, before_bootstrap=True).render()


def test_config_accepts_it_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert "shared-prompt rows" in _validate(tmp_path, monkeypatch)


@pytest.mark.parametrize(("overrides", "world", "says"), [
    ([f"{A}.{r}.megatron.context_parallel_size=2" for r in ("actor", "ref")], 2, "context_parallel_size=2"),
    ([f"{A}.{r}.megatron.{k}=2" for r in ("actor", "ref")
      for k in ("pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size")], 2,
     "virtual_pipeline_model_parallel_size=2"),
])
def test_config_refuses_what_it_cannot_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: list[str],
                                           world: int, says: str) -> None:
    with pytest.raises(ConfigError) as e:
        _validate(tmp_path, monkeypatch, *overrides, world=world)
    assert f"{A}.actor.use_prefix_grouper=True" in str(e.value) and says in str(e.value)


def test_config_refuses_transformer_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TE cannot be installed on this CPU machine: its presence is the one thing faked here."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "transformer_engine"
                        else real(name, *a))
    with pytest.raises(ConfigError, match="Transformer Engine"):
        _validate(tmp_path, monkeypatch)


def test_real_positions_count_what_perf_padding_share_reads() -> None:
    """``perf/padding_share/<pass>``: of a micro-batch's computed positions, the real ones are each sample's prompt
    and response (a filler row's none); in shared-prompt rows the prompt counts once per row."""
    from hybridrl.megatron.sequences import pack_rows

    plain = _batch([[5, 6, 7], [8]], [[1, 2], [3, 4, 5, 6]], owner=[0, 1])
    rows = pack_rows(plain, seq_len=8, pad_token_id=PAD)
    assert rows.tokens_BS.numel() == 16
    assert rows.real_positions(torch.tensor([True, True])) == 3 + 2 + 1 + 4
    assert rows.real_positions(torch.tensor([True, False])) == 5  # the second row a filler
    shared = _batch([[5, 6, 7]], [[1, 2], [3], [4, 5, 6]], owner=[0, 0, 0])
    assert pack_groups(shared, [3], pad_token_id=PAD).real_positions(torch.ones(3, dtype=torch.bool)) == 3 + 6
