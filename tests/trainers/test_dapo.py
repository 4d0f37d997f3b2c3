"""DAPO: dynamic sampling (hybridrl/rollout/dynamic_sampling.py), the overlong penalty (hybridrl/rewards/overlong.py),
their validation, and recipe=dapo_tiny end to end on 2 ranks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from support.e2e import TRAIN, base_overrides, read_metrics, tiny  # noqa: F401  (tiny is a fixture)

from hybridrl.algorithms.dynamic_sampling import group_signal
from hybridrl.batch import RolloutBatch, SampleMeta
from hybridrl.config.compose import compose_config
from hybridrl.config.errors import ConfigError
from hybridrl.config.schema import RLConfig
from hybridrl.config.validate import validate
from hybridrl.interfaces import RewardOutput
from hybridrl.models.tiny import make_tiny_model
from hybridrl.rewards.overlong import overlong_penalty, overlong_penalty_B
from hybridrl.rollout.dynamic_sampling import GroupPool

AOR = "actor_rollout_ref"
PAD = 0


# ---- dynamic sampling: which groups a step keeps ----
def round_of(groups: list[int], values: list[list[float]]) -> tuple[RolloutBatch, RewardOutput, torch.Tensor]:
    """A whole round: group ``groups[g]`` (its group_index) has one sample per entry of ``values[g]``."""
    n = len(values[0])
    b = len(groups) * n
    lengths = [1 + (i % 3) for i in range(b)]  # ragged responses: cat re-pads
    response_mask = torch.tensor([[1] * k + [0] * (3 - k) for k in lengths])
    batch = RolloutBatch(prompt_ids=torch.ones(b, 2, dtype=torch.long), prompt_mask=torch.ones(b, 2, dtype=torch.long),
                         response_ids=response_mask.clone(), response_mask=response_mask,
                         rollout_logprobs=torch.zeros(b, 3), weight_version=torch.zeros(b, dtype=torch.long),
                         group_index=torch.tensor(groups).repeat_interleave(n),
                         meta=[SampleMeta(ground_truth=str(g)) for g in groups for _ in range(n)], pad_token_id=PAD)
    scores_B = torch.tensor([v for vs in values for v in vs])
    out = RewardOutput(scores_B=scores_B, correct_B=scores_B > 0.5,
                       info={"group": [g for g in groups for _ in range(n)]})
    return batch, out, scores_B


def test_group_signal_drops_groups_of_equal_values_keeps_nan() -> None:
    values_B = torch.tensor([1.0, 1, 1, 0, 1, 0, 0, 0, 0, math.nan, math.nan, math.nan, 0.5, 0.5, 0.25])
    assert group_signal(values_B, 3).tolist() == [False, True, False, True, True]


def test_pool_keeps_groups_with_signal_in_generation_order_and_trims_to_the_step() -> None:
    pool = GroupPool(want=3, n=2, refill=False)
    pool.add(*round_of([10, 11, 12], [[1, 1], [0, 1], [0, 0]]))  # only 11 has signal
    assert not pool.full
    pool.add(*round_of([20, 21, 22], [[1, 0], [0, 1], [1, 0]]))  # all three do; the step needs two more
    assert pool.full and (pool.signal_groups, pool.no_signal_groups) == (4, 2)
    batch, out, refilled = pool.take()
    assert refilled == 0 and len(batch) == 6 == len(out.scores_B)  # exactly want groups: 22 is discarded
    assert batch.group_index.tolist() == [11, 11, 20, 20, 21, 21]
    assert out.info["group"] == batch.group_index.tolist()
    assert out.scores_B.tolist() == [0, 1, 1, 0, 0, 1] and out.correct_B.tolist() == [False, True, True, False,
                                                                                       False, True]
    assert [m.ground_truth for m in batch.meta] == ["11", "11", "20", "20", "21", "21"]


def test_pool_at_the_cap_refills_with_dropped_groups_first_generated_first() -> None:
    def filled() -> list[int]:
        pool = GroupPool(want=4, n=2, refill=True)
        pool.add(*round_of([10, 11, 12], [[1, 1], [0, 1], [0, 0]]))
        pool.add(*round_of([20, 21], [[0, 0], [1, 1]]))
        assert not pool.full and pool.can_fill
        batch, out, refilled = pool.take()
        assert refilled == 3 and len(batch) == 8
        assert out.scores_B.tolist() == [0, 1, 1, 1, 0, 0, 0, 0]
        return batch.group_index.tolist()

    assert filled() == [11, 11, 10, 10, 12, 12, 20, 20] == filled()  # signal first, then dropped in order


def test_pool_without_refill_cannot_fill_a_short_step() -> None:
    pool = GroupPool(want=2, n=2, refill=False)
    pool.add(*round_of([1, 2], [[0, 0], [1, 0]]))
    assert not pool.can_fill


# ---- the overlong penalty ----
def test_overlong_penalty_at_the_buffer_edges() -> None:
    lengths = torch.tensor([0, 3, 4, 5, 6, 7, 8, 9])  # L_max = 8, L_cache = 4: ramps over lengths 5..8
    assert overlong_penalty(lengths, max_length=8, buffer=4, factor=1.0).tolist() == [
        0, 0, 0, -0.25, -0.5, -0.75, -1.0, -1.0]
    assert overlong_penalty(lengths, max_length=8, buffer=4, factor=0.5).tolist() == [
        0, 0, 0, -0.125, -0.25, -0.375, -0.5, -0.5]
    assert overlong_penalty(torch.tensor([7, 8]), max_length=8, buffer=1, factor=1.0).tolist() == [0, -1]


def test_overlong_penalty_from_config_counts_response_tokens() -> None:
    cfg = RLConfig()
    cfg.data.max_response_length = 8
    mask_BT = torch.tensor([[0] * 8, [1] * 4 + [0] * 4, [1] * 6 + [0] * 2, [1] * 8])  # a zero-length response too
    o = cfg.reward.overlong_buffer
    assert overlong_penalty_B(o, mask_BT, max_length=8).tolist() == [0, 0, 0, 0]  # off
    o.enable, o.len = True, 4
    assert overlong_penalty_B(o, mask_BT, max_length=8).tolist() == [0, 0, -0.5, -1]


# ---- validation ----
@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    tmp = tmp_path_factory.mktemp("dapo_validate")
    model = make_tiny_model(tmp / "model", hidden=32, layers=2, heads=4, kv_heads=2, max_positions=128)
    data = tmp / "train.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "ground_truth": "2"}) + "\n")
    return ["recipe=dapo_tiny", f"{AOR}.model.path={model}", f"{AOR}.model.build_if_missing=null",
            f"data.train_files=[{data}]", "data.val_files=[]", "data.build_if_missing=null", f"{AOR}.rollout.n=4",
            "data.train_batch_size=8", "data.gen_batch_size=12", f"{AOR}.actor.ppo_mini_batch_size=4",
            f"{AOR}.actor.ppo_micro_batch_size_per_gpu=4", "data.max_response_length=8"]


def issues(base: list[str], *overrides: str) -> list[str]:
    try:
        validate(compose_config([*base, *overrides]), world_size=1)
    except ConfigError as e:
        return [str(i) for i in e.issues]
    return []


def test_dapo_tiny_validates_and_plans_rounds(base: list[str]) -> None:
    plan = validate(compose_config(base), world_size=1)
    assert (plan.batch.prompts_per_step, plan.batch.prompts_per_generation) == (8, 12)
    assert "per round of 12" in plan.render()


@pytest.mark.parametrize(("overrides", "expect"), [
    ((f"{AOR}.rollout.n=1", f"{AOR}.actor.ppo_micro_batch_size_per_gpu=1", "algorithm.adv_estimator=reinforce_pp"),
     [f"{AOR}.rollout.n=1", "algorithm.filter_groups.enable=true"]),
    (("data.gen_batch_size=0",), ["data.gen_batch_size=0", "≥ 1"]),
    (("algorithm.filter_groups.max_num_gen_batches=-1",), ["max_num_gen_batches=-1", "≥ 0"]),
    (("data.gen_batch_size=2", "algorithm.filter_groups.max_num_gen_batches=3"),
     ["max_num_gen_batches=3", "at least 4"]),
    (("algorithm.filter_groups.metric=accuracy",), ["metric='accuracy'", "acc, score, seq_reward"]),
    (("algorithm.filter_groups.enable=false",), ["data.gen_batch_size=12", "filter_groups.enable=true"]),
    (("reward.overlong_buffer.len=8",), ["reward.overlong_buffer.len=8", "data.max_response_length=8"]),
    (("reward.overlong_buffer.len=0",), ["reward.overlong_buffer.len=0"]),
    (("reward.overlong_buffer.penalty_factor=-1",), ["penalty_factor=-1"]),
])
def test_dapo_config_problems_name_their_keys(base: list[str], overrides: tuple[str, ...],
                                              expect: list[str]) -> None:
    found = issues(base, *overrides)
    assert len(found) == 1, found
    assert all(e in found[0] for e in expect), found[0]


# ---- end to end ----
@pytest.mark.distributed
def test_dapo_tiny_refills_rounds_under_the_cap_on_2_ranks(torchrun, tiny: dict[str, Path]) -> None:  # noqa: F811
    out = tiny["tmp"] / "dapo"
    cap = 3
    # a random model never solves arithmetic; a keyword reward scores some samples of a prompt and not others
    args = [o.replace("recipe=grpo_tiny", "recipe=dapo_tiny") for o in base_overrides(tiny, out)] + [
        "reward.name=keyword", "+reward.kwargs.keywords=[a,e,i,o,u,t,n,s]", "+reward.kwargs.mode=any",
        "algorithm.filter_groups.metric=score", f"algorithm.filter_groups.max_num_gen_batches={cap}",
        "data.train_batch_size=4", "data.gen_batch_size=2", f"{AOR}.rollout.n=4", f"{AOR}.actor.ppo_mini_batch_size=2",
        f"{AOR}.actor.ppo_micro_batch_size_per_gpu=4", "data.val_batch_size=64", "trainer.total_training_steps=3",
        "trainer.test_freq=3", "trainer.n_gpus_per_node=2"]
    torchrun([TRAIN, *args], nproc=2)
    rows = read_metrics(out)[1:]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        rounds, kept, dropped, refilled = (int(r[f"dynamic_sampling/{k}"]) for k in
                                           ("gen_rounds", "kept_groups", "dropped_groups", "refilled_groups"))
        assert 2 <= rounds <= cap  # 2 prompts a round, 4 groups a step: never fewer than 2 rounds
        assert kept + dropped == 2 * rounds
        assert refilled == (max(4 - kept, 0) if rounds == cap else 0)
        assert all(math.isfinite(v) for v in r.values()), r
        assert abs(r["actor/ppo_kl_first_mb"]) <= 1e-6  # the step's batch is on-policy, as without filtering
        assert r["rollout/logprob_abs_diff"] <= 1e-4
    assert "eval/accuracy" in rows[-1]
    # seeded: step 1 fills in 2 rounds; step 3 reaches the cap and is topped up with dropped groups
    assert int(rows[0]["dynamic_sampling/gen_rounds"]) == 2 and int(rows[2]["dynamic_sampling/refilled_groups"]) > 0
    assert min(r["reward/mean"] for r in rows) < 0  # a random model runs to max_response_length: overlong penalty
