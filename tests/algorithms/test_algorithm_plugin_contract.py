"""Contract tests run against every *installed* advantage estimator and policy loss.

They go through ``Registry`` exactly as the loop does, so a third-party plugin installed in the
environment is checked by the same tests: it loads by name, has a kw-only ``Config`` dataclass
whose defaults construct, satisfies its Protocol, and runs on a small random batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from hybridrl.algorithms.loss_agg import LOSS_AGG_MODES
from hybridrl.interfaces import AdvantageEstimator, PolicyLoss
from hybridrl.registry import PluginConfigError, Registry

ESTIMATORS = Registry("advantage_estimators").names()
LOSSES = Registry("policy_losses").names()


def _mask_BT(lengths: list[int], t: int) -> torch.Tensor:
    return (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).float()


def _check_config(group: str, name: str, key: str) -> None:
    cls: Any = Registry(group).load(name, key=key)  # a plugin class: its attributes are checked here
    config_cls = cls.Config
    assert isinstance(config_cls, type) and dataclasses.is_dataclass(config_cls)
    assert all(f.kw_only for f in dataclasses.fields(config_cls)), f"{name}.Config fields must be kw-only"
    config_cls()  # defaults construct
    Registry(group).make_config(name, {}, key=key)


@pytest.mark.parametrize("name", ESTIMATORS)
def test_advantage_estimator_contract(name: str) -> None:
    key = "algorithm.adv_estimator_kwargs"
    _check_config("advantage_estimators", name, key)
    cls: Any = Registry("advantage_estimators").load(name)
    # read by the static validation before anything is built: class attributes, plain bools
    assert isinstance(cls.needs_group, bool) and isinstance(cls.needs_critic, bool)
    est = Registry("advantage_estimators").build(name, {}, key=key)
    assert isinstance(est, AdvantageEstimator)

    g = torch.Generator().manual_seed(0)
    mask_BT = _mask_BT([5, 2, 4, 1, 3, 5], 5)  # 3 prompts x 2 samples, ragged lengths
    rewards_BT = torch.randn(6, 5, generator=g) * mask_BT
    values_BT = torch.randn(6, 5, generator=g) if cls.needs_critic else None
    teacher = {}
    if getattr(cls, "needs_teacher", False):  # a distillation estimator: the student's and the teacher's log-probs
        teacher = {"logprobs_BT": -torch.rand(6, 5, generator=g) * mask_BT,
                   "teacher_logprobs_BT": -torch.rand(6, 5, generator=g) * mask_BT}
    adv_BT, ret_BT = est(token_rewards_BT=rewards_BT, response_mask_BT=mask_BT,
                         group_index_B=torch.tensor([0, 0, 1, 1, 2, 2]), values_BT=values_BT, **teacher)
    for out in (adv_BT, ret_BT):
        assert out.shape == (6, 5) and out.dtype == rewards_BT.dtype
        assert torch.isfinite(out).all()
        assert (out[mask_BT == 0] == 0).all(), f"{name}: non-zero outside the response mask"
    assert adv_BT.abs().sum() > 0


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
def test_policy_loss_contract(name: str, loss_agg_mode: str) -> None:
    key = "algorithm.policy_loss_kwargs"
    _check_config("policy_losses", name, key)
    loss_fn = Registry("policy_losses").build(name, {}, key=key)
    assert isinstance(loss_fn, PolicyLoss)

    g = torch.Generator().manual_seed(0)
    mask_BT = _mask_BT([4, 1, 3], 4)
    old_BT = -torch.rand(3, 4, generator=g) * 3
    logp_BT = (old_BT + torch.randn(3, 4, generator=g) * 0.05).requires_grad_(True)
    adv_BT = torch.randn(3, 4, generator=g) * mask_BT
    loss, metrics = loss_fn(logprobs_BT=logp_BT, old_logprobs_BT=old_BT, advantages_BT=adv_BT,
                            response_mask_BT=mask_BT, loss_agg_mode=loss_agg_mode)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert {"pg_loss", "clipfrac", "ppo_kl"} <= metrics.keys()
    for metric_name, value in metrics.items():
        assert isinstance(value, torch.Tensor) and value.dim() == 0, metric_name
        assert not value.requires_grad and torch.isfinite(value), metric_name
    loss.backward()
    assert logp_BT.grad is not None and torch.isfinite(logp_BT.grad).all()
    assert (logp_BT.grad[mask_BT == 0] == 0).all(), f"{name}: gradient on padding tokens"

    # on-policy (logprobs == old): the design requires actor/ppo_kl == 0 on the first mini-batch
    _, metrics = loss_fn(logprobs_BT=old_BT.clone(), old_logprobs_BT=old_BT, advantages_BT=adv_BT,
                         response_mask_BT=mask_BT, loss_agg_mode=loss_agg_mode)
    assert metrics["ppo_kl"].item() == 0.0 and metrics["clipfrac"].item() == 0.0


@pytest.mark.parametrize(
    ("group", "name", "kwargs", "key", "field"),
    [
        ("policy_losses", "ppo_clip", {"clip_ratio_low": -0.1}, "algorithm.policy_loss_kwargs", "clip_ratio_low"),
        ("policy_losses", "ppo_clip", {"clip_ratio_high": -0.5}, "algorithm.policy_loss_kwargs", "clip_ratio_high"),
        ("policy_losses", "ppo_clip", {"clip_ratio": 1.5}, "algorithm.policy_loss_kwargs", "clip_ratio"),
        ("policy_losses", "dual_clip", {"clip_ratio_c": 0.5}, "algorithm.policy_loss_kwargs", "clip_ratio_c"),
        ("policy_losses", "dual_clip", {"clip_ratio_low": 1.0}, "algorithm.policy_loss_kwargs", "clip_ratio_low"),
        ("policy_losses", "gspo", {"clip_ratio_high": -1e-4}, "algorithm.policy_loss_kwargs", "clip_ratio_high"),
        ("advantage_estimators", "grpo", {"epsilon": -1e-6}, "algorithm.adv_estimator_kwargs", "epsilon"),
        ("advantage_estimators", "reinforce_pp", {"gamma": 1.5}, "algorithm.adv_estimator_kwargs", "gamma"),
        ("advantage_estimators", "gae", {"lam": float("nan")}, "algorithm.adv_estimator_kwargs", "lam"),
    ],
)
def test_bad_config_value_names_the_field(group: str, name: str, kwargs: dict[str, float], key: str,
                                          field: str) -> None:
    with pytest.raises(PluginConfigError) as err:
        Registry(group).make_config(name, kwargs, key=key)
    msg = str(err.value)
    assert f"{field}=" in msg and key in msg and "valid:" in msg, msg


def test_unknown_key_lists_valid_keys() -> None:
    with pytest.raises(PluginConfigError, match="clip_ratio_high"):
        Registry("policy_losses").make_config("ppo_clip", {"clip_high": 0.28}, key="algorithm.policy_loss_kwargs")


def test_asymmetric_clip_config_resolves() -> None:
    cfg = Registry("policy_losses").make_config(
        "ppo_clip", {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}, key="algorithm.policy_loss_kwargs"
    )
    loss_fn = Registry("policy_losses").load("ppo_clip")(cfg)
    assert (loss_fn.clip_low, loss_fn.clip_high) == (0.2, 0.28)
