"""The KL-in-reward coefficient: the adaptive rule over a few steps, its state, and its config checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridrl.algorithms.kl_controller import KLController, config_problems
from hybridrl.config.compose import compose_config
from hybridrl.config.errors import ConfigError
from hybridrl.config.schema import KLControlConfig
from hybridrl.config.validate import validate
from hybridrl.models.tiny import make_tiny_model

AOR = "actor_rollout_ref"


def test_adaptive_rule_over_steps() -> None:
    c = KLController(KLControlConfig(type="adaptive", kl_coef=0.1, target_kl=0.05, horizon=1000))
    c.update(0.06, n_samples=100)  # e = 0.06/0.05 - 1 = 0.2 -> β = 0.1 * (1 + 0.2 * 0.1) = 0.102
    assert c.value == pytest.approx(0.102)
    c.update(1.0, n_samples=100)  # e = 19, clipped to 0.2 -> 0.102 * 1.02 = 0.10404
    assert c.value == pytest.approx(0.10404)
    c.update(0.025, n_samples=500)  # e = -0.5, clipped to -0.2 -> 0.10404 * (1 - 0.2 * 0.5) = 0.093636
    assert c.value == pytest.approx(0.093636)
    c.update(0.05, n_samples=100)  # on target: unchanged
    assert c.value == pytest.approx(0.093636)
    c.update(float("nan"), n_samples=100)  # a non-finite step leaves β alone
    assert c.value == pytest.approx(0.093636)
    restored = KLController(KLControlConfig(type="adaptive", kl_coef=0.1, target_kl=0.05, horizon=1000))
    restored.load_state_dict(c.state_dict())
    assert restored.value == c.value


def test_fixed_never_moves() -> None:
    c = KLController(KLControlConfig(kl_coef=0.01))
    for kl in (0.0, 5.0, 100.0):
        c.update(kl, n_samples=1000)
    assert c.value == 0.01


def test_config_problems_name_the_key() -> None:
    found = config_problems(KLControlConfig(type="pid", kl_coef=-1.0))
    assert [(k, v) for k, v, _ in found] == [("algorithm.kl_ctrl.type", "pid"), ("algorithm.kl_ctrl.kl_coef", -1.0)]
    assert "fixed, adaptive" in found[0][2]
    found = config_problems(KLControlConfig(type="adaptive", kl_coef=0.0, target_kl=0.0, horizon=0))
    assert [k for k, _, _ in found] == ["algorithm.kl_ctrl.kl_coef", "algorithm.kl_ctrl.target_kl",
                                        "algorithm.kl_ctrl.horizon"]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    tmp = tmp_path_factory.mktemp("kl_ctrl")
    model = make_tiny_model(tmp / "model", hidden=32, layers=2, heads=4, kv_heads=2, max_positions=512)
    data = tmp / "train.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "ground_truth": "2"}) + "\n")
    return [f"{AOR}.model.path={model}", f"data.train_files=[{data}]", f"{AOR}.rollout.n=4",
            "data.train_batch_size=8", f"{AOR}.actor.ppo_mini_batch_size=4",
            f"{AOR}.actor.ppo_micro_batch_size_per_gpu=4", "data.max_prompt_length=32", "data.max_response_length=16",
            f"trainer.output_dir={Path(tmp) / 'out'}", "trainer.total_training_steps=2"]


def _issues(base: list[str], *overrides: str) -> list[str]:
    try:
        validate(compose_config([*base, *overrides]), world_size=1)
    except ConfigError as e:
        return [str(i) for i in e.issues]
    return []


def test_validation_of_the_new_keys(base: list[str]) -> None:
    assert _issues(base, "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive") == []
    found = _issues(base, "algorithm.kl_ctrl.type=adaptive")
    assert len(found) == 1 and "algorithm.kl_ctrl.type" in found[0] and "use_kl_in_reward" in found[0]
    found = _issues(base, "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.horizon=0",
                    "algorithm.kl_ctrl.type=adaptive")
    assert len(found) == 1 and "algorithm.kl_ctrl.horizon" in found[0]


def test_old_kl_coef_key_points_to_the_new_one(base: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        compose_config([*base, "algorithm.kl_coef=0.01"])
    assert "algorithm.kl_ctrl.kl_coef" in str(e.value)


def test_drgrpo_requires_its_aggregation(base: list[str]) -> None:
    found = _issues(base, "algorithm.adv_estimator=drgrpo")
    assert len(found) == 1, found
    assert f"{AOR}.actor.loss_agg_mode" in found[0] and "algorithm.adv_estimator='drgrpo'" in found[0]
    assert "seq-mean-token-sum-norm" in found[0]
    assert _issues(base, "algorithm.adv_estimator=drgrpo", f"{AOR}.actor.loss_agg_mode=seq-mean-token-sum-norm") == []
    assert _issues(base, "algorithm.adv_estimator=reinforce_pp_baseline", "algorithm.policy_loss=cispo") == []
