"""Token-budget micro-batches (``use_dynamic_bsz``): the partition (every sample once, within budget,
fewer padded tokens than fixed-size) and its config checks. That an RL step gives the same result with
them as with fixed micro-batches, under PP and DP, is tests/parallel/test_rl_step_layouts.py ("dyn")."""

import random
from pathlib import Path

import pytest

from hybridrl.config.compose import compose_config
from hybridrl.config.errors import ConfigError
from hybridrl.config.validate import validate
from hybridrl.megatron.dynamic_batch import partition_cost, split_to_count, token_budget_partition

A = "actor_rollout_ref"


def _check(lengths: list[int], parts: list[list[int]], max_tokens: int, multiple: int) -> None:
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    assert all(p and p == sorted(p) for p in parts)
    for p in parts:
        assert partition_cost(lengths, [p], multiple) <= max_tokens


def test_groups_by_length_within_budget() -> None:
    lengths = [10, 3, 9, 4, 2, 11]
    parts = token_budget_partition(lengths, max_tokens=24, multiple=1)
    _check(lengths, parts, 24, 1)
    # longest first: {11, 10} (2 × 11 = 22), {9, 4} (2 × 9 = 18 ≤ 24; a third row would be 27), {3, 2}
    assert parts == [[0, 5], [2, 3], [1, 4]]


def test_skewed_lengths_cost_less_than_fixed_micro_batches() -> None:
    rng = random.Random(0)
    lengths = [rng.choice([12, 16, 20]) for _ in range(60)] + [200, 190, 180, 170]
    parts = token_budget_partition(lengths, max_tokens=512, multiple=8)
    _check(lengths, parts, 512, 8)
    fixed = [list(range(i, i + 4)) for i in range(0, len(lengths), 4)]  # padded to the batch's longest
    fixed_cost = len(lengths) * 200
    assert partition_cost(lengths, parts, 8) < 0.4 * fixed_cost
    assert len(parts) <= len(fixed)


def test_sample_longer_than_budget_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="does not fit the token budget of 16.*at least"):
        token_budget_partition([4, 17], max_tokens=16, multiple=1)
    with pytest.raises(ValueError, match="padded to 24"):  # 17 rounds up to 24 with multiple=8
        token_budget_partition([17], max_tokens=20, multiple=8)


def _validate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *overrides: str, world: int = 1) -> str:
    monkeypatch.setenv("HYBRIDRL_CACHE_DIR", str(tmp_path))  # nothing built: model/data checks are pending
    return validate(compose_config(["recipe=grpo_tiny", *overrides]), world_size=world, before_bootstrap=True).render()


def test_config_budget_must_hold_the_longest_sample(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # grpo_tiny: prompts ≤ 16 tokens, responses ≤ 8 → 24
    with pytest.raises(ConfigError) as e:
        _validate(tmp_path, monkeypatch, f"{A}.actor.use_dynamic_bsz=true", f"{A}.actor.ppo_max_token_len_per_gpu=20",
                  f"{A}.ref.log_prob_max_token_len_per_gpu=23")
    msg = str(e.value)
    assert f"{A}.actor.ppo_max_token_len_per_gpu=20" in msg and "= 24 or more" in msg
    assert f"{A}.ref.log_prob_max_token_len_per_gpu=23" in msg
    # the rollout's log-prob pass inherits the actor's budget (20): reported under its own key
    assert f"{A}.rollout.log_prob_max_token_len_per_gpu=20" in msg


def test_config_dynamic_bsz_frees_the_micro_batch_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    odd_micro = f"{A}.actor.ppo_micro_batch_size_per_gpu=7"  # does not divide 32 prompts × 8 samples
    with pytest.raises(ConfigError, match="ppo_micro_batch_size_per_gpu"):
        _validate(tmp_path, monkeypatch, odd_micro)
    plan = _validate(tmp_path, monkeypatch, odd_micro, f"{A}.actor.use_dynamic_bsz=true",
                     f"{A}.actor.ppo_max_token_len_per_gpu=4096")
    assert "micro-batches of ≤ 4096 tokens, shared-prompt rows, packed (use_dynamic_bsz) per optimizer step" in plan
    padded = _validate(tmp_path, monkeypatch, odd_micro, f"{A}.actor.use_dynamic_bsz=true",
                       f"{A}.actor.ppo_max_token_len_per_gpu=4096", f"{A}.actor.megatron.use_remove_padding=false")
    assert "micro-batches of ≤ 4096 padded tokens (use_dynamic_bsz) per optimizer step" in padded


def test_config_rejects_padded_dynamic_bsz_with_the_interleaved_schedule_on_cpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packed rows run there (a pass's rows share one length on gloo: tests/parallel, ``tp1pp2cp1vpp2``)."""
    vpp = [f"{A}.{role}.megatron.{k}=2" for role in ("actor", "ref")
           for k in ("pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size")]
    dynamic = (f"{A}.actor.use_dynamic_bsz=true", f"{A}.rollout.log_prob_use_dynamic_bsz=false")
    assert "packed" in _validate(tmp_path, monkeypatch, *vpp, *dynamic, world=2)
    with pytest.raises(ConfigError) as e:
        _validate(tmp_path, monkeypatch, *vpp, *dynamic, f"{A}.actor.megatron.use_remove_padding=false", world=2)
    msg = str(e.value)
    assert f"{A}.actor.megatron.virtual_pipeline_model_parallel_size=2" in msg
    assert "on for: actor, ref;" in msg and "use fixed micro-batches" in msg


def test_a_partition_splits_up_to_the_count_the_expert_ranks_agree_on() -> None:
    """EP > 1 (and VPP's groups of PP): a rank with fewer token-budget micro-batches halves its largest until it has
    the agreed count, then adds empty ones (filled with masked rows by the runner); nothing is lost or repeated."""
    assert split_to_count([[0, 1, 2, 3], [4]], 4) == [[0], [1], [2, 3], [4]]
    assert split_to_count([[0], [1]], 4) == [[0], [1], [], []]
    assert split_to_count([[0, 1, 2]], 1) == [[0, 1, 2]]
    parts = split_to_count([[5, 7, 9], [1, 2], [3]], 6)
    assert len(parts) == 6 and sorted(i for p in parts for i in p) == [1, 2, 3, 5, 7, 9]
