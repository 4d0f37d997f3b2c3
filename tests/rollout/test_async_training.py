"""``async_training`` and the placement keys: every silently wrong combination refused before any model, each
naming its key (``hybridrl/rollout/async_training.py``)."""

from __future__ import annotations

import json

import pytest

from hybridrl.config.compose import compose_config
from hybridrl.config.errors import ConfigError
from hybridrl.config.validate import validate
from hybridrl.models.tiny import make_tiny_model
from hybridrl.registry import Registry
from hybridrl.rollout.async_training import AsyncTrainingConfig, config_problems

AOR = "actor_rollout_ref"
CORRECTION = "algorithm.rollout_correction.rollout_is=token"
DISAGG = [f"{AOR}.rollout.placement=disaggregated", f"{AOR}.rollout.num_ranks=1"]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    tmp = tmp_path_factory.mktemp("async")
    model = make_tiny_model(tmp / "model", hidden=32, layers=2, heads=4, kv_heads=2, max_positions=128)
    data = tmp / "train.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "ground_truth": "2"}) + "\n")
    return [f"{AOR}.model.path={model}", f"data.train_files=[{data}]", f"{AOR}.rollout.n=2",
            "data.train_batch_size=4", f"{AOR}.actor.ppo_mini_batch_size=4",
            f"{AOR}.actor.ppo_micro_batch_size_per_gpu=2",
            "data.max_prompt_length=16", "data.max_response_length=8", "trainer.total_training_steps=2",
            f"trainer.output_dir={tmp / 'out'}"]


def issues(base: list[str], *overrides: str, world_size: int = 2) -> dict[str, str]:
    try:
        validate(compose_config([*base, *overrides]), world_size=world_size)
    except ConfigError as e:
        return {i.key: str(i) for i in e.issues}
    return {}


def test_off_by_default_and_the_synchronous_run_validates(base: list[str]) -> None:
    cfg = compose_config(base)
    assert (cfg.async_training.enable, cfg.actor_rollout_ref.rollout.placement) == (False, "colocated")
    assert issues(base) == {}


def test_off_policy_without_correction_on_colocated_ranks_is_refused_all_at_once(base: list[str]) -> None:
    found = issues(base, "async_training.enable=true", "async_training.staleness_threshold=1")
    assert sorted(found) == ["async_training.enable", "async_training.staleness_threshold"]
    assert "placement=disaggregated" in found["async_training.enable"]
    assert "algorithm.rollout_correction.rollout_is" in found["async_training.staleness_threshold"]


def test_placement_keys_name_what_is_valid(base: list[str]) -> None:
    assert "valid: colocated, disaggregated" in issues(base, f"{AOR}.rollout.placement=apart")[
        f"{AOR}.rollout.placement"]
    assert "at least one rank must train" in issues(base, f"{AOR}.rollout.placement=disaggregated",
                                                    f"{AOR}.rollout.num_ranks=2")[f"{AOR}.rollout.num_ranks"]
    assert "needs the number of ranks" in issues(base, f"{AOR}.rollout.placement=disaggregated")[
        f"{AOR}.rollout.num_ranks"]
    assert "only with placement=disaggregated" in issues(base, f"{AOR}.rollout.num_ranks=1")[
        f"{AOR}.rollout.num_ranks"]
    assert "multiple of" in issues(base, *DISAGG[:1], f"{AOR}.rollout.num_ranks=3", f"{AOR}.rollout.name=sglang",
                                   f"{AOR}.rollout.tensor_model_parallel_size=2", world_size=4)[
        f"{AOR}.rollout.num_ranks"]


def test_options_that_need_enable_or_partial_rollout_say_so(base: list[str]) -> None:
    found = issues(base, "async_training.staleness_threshold=2", "async_training.mask_stale_prefix=true")
    assert sorted(found) == ["async_training.mask_stale_prefix", "async_training.staleness_threshold"]
    assert all("takes effect with async_training.enable=true" in m for m in found.values())
    found = issues(base, *DISAGG, "async_training.enable=true", "async_training.mask_stale_prefix=true")
    assert "partial_rollout=true" in found["async_training.mask_stale_prefix"]
    assert "must be ≥ 0" in issues(base, "async_training.staleness_threshold=-1")["async_training.staleness_threshold"]


def test_an_unclipped_loss_is_refused_for_off_policy_samples() -> None:
    problems = config_problems(AsyncTrainingConfig(enable=True, staleness_threshold=3), placement="disaggregated",
                               num_ranks=1, world_size=2, rollout_tp=1, correction_on=True,
                               policy_loss="my_is_loss", loss_is_clipped=False)
    assert [(k, v) for k, v, _ in problems] == [("algorithm.policy_loss", "my_is_loss")]
    assert "ppo_clip, dual_clip, gspo or cispo" in problems[0][2]
    assert config_problems(AsyncTrainingConfig(enable=True, staleness_threshold=0), placement="disaggregated",
                           num_ranks=1, world_size=2, rollout_tp=1, correction_on=False, policy_loss="my_is_loss",
                           loss_is_clipped=False) == []  # S = 0, no partial rollout: on-policy, nothing to correct


@pytest.mark.parametrize("name", ["ppo_clip", "dual_clip", "gspo", "cispo"])
def test_the_built_in_losses_declare_their_trust_region(name: str) -> None:
    assert Registry("policy_losses").load(name, key="algorithm.policy_loss").trust_region is True


def test_dynamic_sampling_runs_asynchronously_and_keeps_its_own_checks(base: list[str]) -> None:
    """``algorithm.filter_groups`` with ``async_training.enable`` validates (``hybridrl/rollout/async_dynamic.py``);
    its own settings are still checked, each naming its key."""
    on = [*DISAGG, "async_training.enable=true", "async_training.staleness_threshold=1", CORRECTION]
    assert issues(base, *on) == {}
    assert issues(base, *on, "algorithm.filter_groups.enable=true", "data.gen_batch_size=8") == {}
    found = issues(base, *on, "algorithm.filter_groups.enable=true", "data.gen_batch_size=1",
                   "algorithm.filter_groups.max_num_gen_batches=2")
    assert "cannot fill a step" in found["algorithm.filter_groups.max_num_gen_batches"], found


def test_partial_rollouts_need_an_engine_that_can_be_interrupted(base: list[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    on = [*DISAGG, "async_training.enable=true", "async_training.staleness_threshold=1", CORRECTION,
          "async_training.partial_rollout=true", "async_training.mask_stale_prefix=true"]
    for name in ("hf", "sglang", "vllm"):  # every built-in engine has abort / resume
        assert Registry("rollout_engines").load(name, key="k").supports_abort is True
    assert issues(base, *on) == {}
    from hybridrl.rollout.engines.hf import HFRolloutEngine

    monkeypatch.setattr(HFRolloutEngine, "supports_abort", False)  # as an engine plugin without the capability
    found = issues(base, *on)
    assert "cannot interrupt its generations" in found[f"{AOR}.rollout.name"], found


def test_a_disaggregated_plan_trains_on_the_other_ranks_and_shows_both_groups(base: list[str]) -> None:
    """The synchronous disaggregated run validates; the trainer's layout spans only the trainer ranks."""
    cfg = compose_config([*base, f"{AOR}.rollout.placement=disaggregated", f"{AOR}.rollout.num_ranks=2"])
    plan = validate(cfg, world_size=4)
    assert (plan.trainer_world_size, plan.roles["actor"].dp) == (2, 2)
    assert [e.ranks for e in plan.engines] == [(2,), (3,)]
    assert [plan.is_engine_rank(r) for r in range(4)] == [False] * 2 + [True] * 2
    text = plan.render()
    assert "ranks 2..3 run engines only, ranks 0..1 train" in text
    assert "rank 3: cpu rollout(engine 1, leader) only" in text and "rank 1: cpu actor(tp0 pp0 cp0 dp1)" in text
    # a layout that does not divide the trainer ranks is named with why the world is smaller
    found = issues(base, *DISAGG, f"{AOR}.actor.megatron.tensor_model_parallel_size=2", world_size=4)
    assert "the 3 trainer ranks: the world size 4 less actor_rollout_ref.rollout.num_ranks=1" in found[
        f"{AOR}.actor.megatron.tensor_model_parallel_size"]
    # an engine of 2 ranks must not straddle two nodes (3 per node: engine ranks 2-3 would)
    found = issues(base, f"{AOR}.rollout.placement=disaggregated", f"{AOR}.rollout.num_ranks=4",
                   f"{AOR}.rollout.tensor_model_parallel_size=2", "trainer.nnodes=2", world_size=6)
    assert "engine of ranks 2..3 on two nodes" in found[f"{AOR}.rollout.num_ranks"]
    assert f"{AOR}.rollout.num_ranks" not in issues(  # ranks 4-5 share the second node
        base, f"{AOR}.rollout.placement=disaggregated", f"{AOR}.rollout.num_ranks=2",
        f"{AOR}.rollout.tensor_model_parallel_size=2", "trainer.nnodes=2", world_size=6)
