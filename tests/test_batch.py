"""RolloutBatch: split/cat/index round trips, re-padding, optional fields, shape errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridrl.batch import RolloutBatch, SampleMeta

PAD = 97


def make_batch(prompt_lens: list[int], response_lens: list[int], *, first_group: int = 0,
               with_scores: bool = False) -> RolloutBatch:
    """Rows with distinct token values, left-padded prompts and right-padded responses."""
    b, p, t = len(prompt_lens), max(prompt_lens), max(response_lens)
    prompt_ids = torch.full((b, p), PAD)
    prompt_mask = torch.zeros(b, p, dtype=torch.long)
    response_ids = torch.full((b, t), PAD)
    response_mask = torch.zeros(b, t, dtype=torch.long)
    logprobs = torch.zeros(b, t)
    for i, (pl, rl) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        prompt_ids[i, p - pl:] = torch.arange(pl) + 10 * i
        prompt_mask[i, p - pl:] = 1
        response_ids[i, :rl] = torch.arange(rl) + 10 * i + 5
        response_mask[i, :rl] = 1
        logprobs[i, :rl] = -0.1 * (torch.arange(rl) + 1 + i)
    batch = RolloutBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
        response_mask=response_mask, rollout_logprobs=logprobs,
        weight_version=torch.full((b,), 3), group_index=torch.arange(b) // 2 + first_group,
        meta=[SampleMeta(ground_truth=str(first_group * 100 + i), finish_reason="stop") for i in range(b)],
        pad_token_id=PAD,
    )
    if with_scores:
        batch.token_level_scores = logprobs * -2.0
    return batch


def real_tokens(batch: RolloutBatch) -> list[tuple[list[int], list[int]]]:
    """Each row's prompt and response tokens with padding removed."""
    return [
        (batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist(),
         batch.response_ids[i][batch.response_mask[i].bool()].tolist())
        for i in range(len(batch))
    ]


def assert_same(a: RolloutBatch, b: RolloutBatch) -> None:
    for f in dataclasses.fields(RolloutBatch):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            torch.testing.assert_close(x, y, rtol=0, atol=0, msg=f.name)
        else:
            assert x == y, f.name


def test_len_and_split_cat_round_trip() -> None:
    batch = make_batch([3, 1, 2, 3, 2], [4, 2, 1, 4, 3], with_scores=True)
    assert len(batch) == 5
    parts = batch.split(2)
    assert [len(p) for p in parts] == [2, 2, 1]
    assert_same(RolloutBatch.cat(parts), batch)


def test_index_with_slice_list_and_tensors() -> None:
    batch = make_batch([3, 1, 2, 3], [4, 2, 1, 3])
    rows = real_tokens(batch)
    picked = batch.index(torch.tensor([2, 0]))
    assert real_tokens(picked) == [rows[2], rows[0]]
    assert [m.ground_truth for m in picked.meta] == ["2", "0"]
    assert_same(batch.index(torch.tensor([True, False, True, False])), batch.index([0, 2]))
    assert_same(batch.index(slice(1, 3)), batch.index([1, 2]))
    assert len(batch.index([])) == 0
    with pytest.raises(TypeError, match=r"pass \[1\] or slice\(1, 2\)"):
        batch.index(1)  # type: ignore[arg-type]


def test_index_then_cat_restores_order() -> None:
    batch = make_batch([1, 2, 3, 4], [4, 3, 2, 1], with_scores=True)
    perm = torch.tensor([3, 1, 0, 2])
    shuffled = batch.index(perm)
    restored = shuffled.index(torch.argsort(perm))
    assert_same(restored, batch)


def test_cat_repads_prompts_left_and_responses_right() -> None:
    short = make_batch([1, 2], [1, 1], first_group=0)
    long = make_batch([5, 3], [6, 2], first_group=1)
    both = RolloutBatch.cat([short, long])
    assert both.prompt_ids.shape == (4, 5) and both.response_ids.shape == (4, 6)
    assert real_tokens(both) == real_tokens(short) + real_tokens(long)
    # short prompts gained padding on the left, short responses on the right
    assert both.prompt_mask[0].tolist() == [0, 0, 0, 0, 1]
    assert both.prompt_ids[0, :4].tolist() == [PAD] * 4
    assert both.response_mask[0].tolist() == [1, 0, 0, 0, 0, 0]
    assert both.response_ids[0, 1:].tolist() == [PAD] * 5
    assert both.rollout_logprobs[0, 1:].abs().sum() == 0
    assert both.group_index.tolist() == [0, 0, 1, 1]
    assert [m.ground_truth for m in both.meta] == ["0", "1", "100", "101"]


def test_optional_fields_survive_every_operation() -> None:
    batch = make_batch([2, 3, 1], [2, 3, 3], with_scores=True)
    batch.old_logprobs = batch.rollout_logprobs.clone()
    for out in (batch.index([2, 0]), batch.split(2)[1], RolloutBatch.cat(batch.split(1))):
        assert out.token_level_scores is not None and out.old_logprobs is not None
        assert out.ref_logprobs is None and out.advantages is None
        assert out.token_level_scores.shape == out.response_ids.shape


def test_cat_rejects_partially_present_fields_and_mixed_pad_ids() -> None:
    a, b = make_batch([1], [1], with_scores=True), make_batch([1], [1])
    with pytest.raises(ValueError, match="token_level_scores"):
        RolloutBatch.cat([a, b])
    c = dataclasses.replace(b, pad_token_id=0)
    with pytest.raises(ValueError, match="pad_token_id"):
        RolloutBatch.cat([b, c])


def test_mismatched_sizes_name_the_field() -> None:
    batch = make_batch([2, 2], [3, 3])
    with pytest.raises(ValueError, match=r"group_index has shape \(3,\), expected \(2,\)"):
        dataclasses.replace(batch, group_index=torch.arange(3))
    with pytest.raises(ValueError, match=r"advantages has shape \(2, 4\), expected \(2, 3\)"):
        dataclasses.replace(batch, advantages=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="meta has 1 entries, expected B=2"):
        dataclasses.replace(batch, meta=batch.meta[:1])



def test_to_moves_every_present_tensor_once_and_keeps_the_rest() -> None:
    batch = make_batch([2, 3, 1], [2, 3, 3], with_scores=True)
    assert batch.to("cpu") is batch  # already there: no copy (train_step calls it on a moved batch)
    moved = batch.to("meta")  # a second device on a CPU-only machine
    for name, value in moved._tensors().items():
        original = getattr(batch, name)
        assert (value is None) == (original is None), name
        if value is not None:
            assert value.device.type == "meta" and value.shape == original.shape and value.dtype == original.dtype
    assert moved.meta == batch.meta and moved.pad_token_id == batch.pad_token_id
    assert batch.prompt_ids.device.type == "cpu"  # the original is untouched


# ---- loss_mask: trained tokens, a subset of the response ----
def test_loss_mask_defaults_to_a_copy_of_the_response_mask_and_travels_with_the_batch() -> None:
    batch = make_batch([2, 3], [4, 2])
    assert torch.equal(batch.loss_mask, batch.response_mask)
    assert batch.loss_mask.data_ptr() != batch.response_mask.data_ptr()  # filled in place later: not an alias
    batch.loss_mask[0, 1] = 0  # e.g. a tool's output inside sample 0's response
    other = make_batch([1], [6])
    joined = RolloutBatch.cat([batch, other])
    assert joined.loss_mask.shape == (3, 6) and joined.loss_mask[0].tolist() == [1, 0, 1, 1, 0, 0]
    assert joined.index([0]).loss_mask.tolist() == [[1, 0, 1, 1, 0, 0]]
    assert torch.equal(joined.response_mask[0], torch.tensor([1, 1, 1, 1, 0, 0]))
    with pytest.raises(ValueError, match="RolloutBatch.loss_mask has shape"):
        dataclasses.replace(batch, loss_mask=torch.ones(2, 9, dtype=torch.long))


def test_generations_with_a_loss_mask_make_the_batch_s_loss_mask() -> None:
    from hybridrl.data.collate import collate_prompts
    from hybridrl.data.dataset import PromptItem
    from hybridrl.interfaces import Generation
    from hybridrl.rollout.batching import rollout_batch_from_generations

    prompts = collate_prompts([PromptItem(prompt_ids=[5, 6], meta=SampleMeta())], [7], pad_token_id=PAD)
    gens = [Generation(prompt_index=0, token_ids=[1, 2, 3, 4], logprobs=[-0.5, 0.0, 0.0, -0.25], finish_reason="stop",
                       weight_version=2, loss_mask=[1, 0, 0, 1]),
            Generation(prompt_index=0, token_ids=[8, 9], logprobs=[-1.0, -2.0], finish_reason="length",
                       weight_version=2)]
    batch = rollout_batch_from_generations(prompts, gens, pad_token_id=PAD)
    assert batch.response_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch.loss_mask.tolist() == [[1, 0, 0, 1], [1, 1, 0, 0]]  # None: every token was sampled
    assert batch.rollout_logprobs.tolist() == [[-0.5, 0.0, 0.0, -0.25], [-1.0, -2.0, 0.0, 0.0]]
    bad = dataclasses.replace(gens[0], loss_mask=[1, 0])
    with pytest.raises(ValueError, match=r"sample 0: Generation.loss_mask must hold one 0/1 per token \(4 tokens\)"):
        rollout_batch_from_generations(prompts, [bad], pad_token_id=PAD)


def test_the_score_sits_on_the_last_trained_token() -> None:
    from hybridrl.trainers.rl import score

    batch = make_batch([2, 2, 2], [4, 3, 2])
    batch.loss_mask[0] = torch.tensor([1, 1, 0, 0])  # sample 0 ends in two untrained tokens (an observation)
    batch.loss_mask[1] = torch.tensor([0, 1, 0, 0])
    scores_B, errors = score(batch, torch.tensor([1.0, 2.0, 3.0]), 0)
    assert errors == 0 and scores_B.tolist() == [1.0, 2.0, 3.0]
    assert batch.token_level_scores is not None
    assert batch.token_level_scores.tolist() == [[0, 1.0, 0, 0], [0, 2.0, 0, 0], [0, 3.0, 0, 0]]


def test_routed_experts_follow_the_prompt_and_response_layout_through_every_operation() -> None:
    """An engine's ``routed_experts`` (prompt positions, then every token but the last) land in the left-padded
    prompt and right-padded response, -1 elsewhere; ``index``/``cat`` re-pad them with -1; a wrong shape is named."""
    from hybridrl.data.collate import collate_prompts
    from hybridrl.data.dataset import PromptItem
    from hybridrl.interfaces import Generation
    from hybridrl.rollout.batching import rollout_batch_from_generations

    prompts = collate_prompts([PromptItem(prompt_ids=[5, 6], meta=SampleMeta()),
                               PromptItem(prompt_ids=[7], meta=SampleMeta())], [0, 1], pad_token_id=PAD)
    L, k = 2, 3

    def routed(n: int, start: int) -> torch.Tensor:  # position i routes to experts start+i, …
        return (torch.arange(n)[:, None, None] + start + torch.zeros(n, L, k, dtype=torch.long)).to(torch.int16)

    gens = [Generation(prompt_index=0, token_ids=[1, 2, 3], logprobs=[0.0] * 3, finish_reason="stop",
                       weight_version=0, routed_experts=routed(2 + 3 - 1, 10)),
            Generation(prompt_index=1, token_ids=[4], logprobs=[0.0], finish_reason="stop", weight_version=0,
                       routed_experts=routed(1, 20))]
    batch = rollout_batch_from_generations(prompts, gens, pad_token_id=PAD)
    assert batch.prompt_routed_experts.shape == (2, 2, L, k) and batch.response_routed_experts.shape == (2, 3, L, k)
    assert batch.prompt_routed_experts[:, :, 0, 0].tolist() == [[10, 11], [-1, 20]]
    assert batch.response_routed_experts[:, :, 1, 2].tolist() == [[12, 13, -1], [-1, -1, -1]]
    short = dataclasses.replace(batch.index([1]), response_ids=batch.response_ids[1:, :1],
                                response_mask=batch.response_mask[1:, :1], loss_mask=batch.loss_mask[1:, :1],
                                rollout_logprobs=batch.rollout_logprobs[1:, :1],
                                response_routed_experts=batch.response_routed_experts[1:, :1])
    both = RolloutBatch.cat([short, batch.index([0])])  # the response re-padded to 3 with -1
    assert both.response_routed_experts[:, :, 0, 0].tolist() == [[-1, -1, -1], [12, 13, -1]]
    with pytest.raises(ValueError, match="only some have RolloutBatch.prompt_routed_experts"):
        RolloutBatch.cat([batch, make_batch([1], [1])])
    with pytest.raises(ValueError, match=r"sample 0: routed_experts has shape \(9, 2, 3\), expected at most \(5, 2, "):
        rollout_batch_from_generations(prompts, [dataclasses.replace(gens[0], routed_experts=routed(9, 0)), gens[1]],
                                       pad_token_id=PAD)
    with pytest.raises(ValueError, match=r"response_routed_experts has shape \(2, 2, 2, 3\), expected \(2, 3,"):
        dataclasses.replace(batch, response_routed_experts=batch.response_routed_experts[:, :2])
