"""CISPO and the ``seq-mean-token-sum-norm`` aggregation against hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from hybridrl.algorithms.actor_objective import ActorObjective
from hybridrl.algorithms.loss_agg import aggregate, local_normalizer
from hybridrl.algorithms.policy_losses import CISPOLoss, PPOClipLoss
from hybridrl.registry import PluginConfigError, Registry


def test_cispo_hand_computed_keeps_clipped_tokens_gradient() -> None:
    # ratios e^0 = 1, e^0.5 = 1.6487 (clipped to 1.28), e^-0.5 = 0.6065 (no lower bound by default), padding
    old_BT = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    logp_BT = (old_BT + torch.tensor([[0.0, 0.5, -0.5, 0.0]])).requires_grad_(True)
    adv_BT = torch.tensor([[1.0, 1.0, -2.0, 5.0]])
    mask_BT = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, m = CISPOLoss()(logprobs_BT=logp_BT, old_logprobs_BT=old_BT, advantages_BT=adv_BT,
                          response_mask_BT=mask_BT, loss_agg_mode="token-mean")
    w = [1.0, 1.28, math.exp(-0.5)]
    lp = [-1.0, -0.5, -1.5]
    expected = -(w[0] * 1 * lp[0] + w[1] * 1 * lp[1] + w[2] * -2 * lp[2]) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    assert logp_BT.grad is not None
    # d/dlogp = -w A / 3: the clipped token (index 1) still has a gradient, padding has none
    torch.testing.assert_close(logp_BT.grad, torch.tensor([[-1 / 3, -1.28 / 3, 2 * w[2] / 3, 0.0]]))
    assert m["clipfrac"].item() == pytest.approx(1 / 3)  # only the upper-clipped weight
    assert m["ppo_kl"].item() == pytest.approx(0.0, abs=1e-7)  # (0 - 0.5 + 0.5) / 3
    assert m["pg_loss"].item() == pytest.approx(expected, rel=1e-6)


def test_cispo_on_policy_gradient_equals_ppo() -> None:
    g = torch.Generator().manual_seed(0)
    old_BT = -torch.rand(3, 5, generator=g)
    adv_BT = torch.randn(3, 5, generator=g)
    mask_BT = (torch.arange(5)[None] < torch.tensor([[5], [2], [0]])).float()  # incl. an empty response
    grads = []
    for loss_fn in (CISPOLoss(), PPOClipLoss()):
        logp_BT = old_BT.clone().requires_grad_(True)
        loss, m = loss_fn(logprobs_BT=logp_BT, old_logprobs_BT=old_BT, advantages_BT=adv_BT,
                          response_mask_BT=mask_BT, loss_agg_mode="seq-mean-token-mean")
        loss.backward()
        grads.append(logp_BT.grad)
        assert m["clipfrac"].item() == 0
    torch.testing.assert_close(grads[0], grads[1])


def test_cispo_config_errors_name_the_field() -> None:
    with pytest.raises(PluginConfigError, match="clip_ratio_low"):
        Registry("policy_losses").make_config("cispo", {"clip_ratio_low": 1.5}, key="algorithm.policy_loss_kwargs")
    with pytest.raises(PluginConfigError, match="clip_ratio_high"):
        Registry("policy_losses").make_config("cispo", {"clip_ratio_high": -0.1}, key="algorithm.policy_loss_kwargs")
    c = CISPOLoss(CISPOLoss.Config(clip_ratio=0.3, clip_ratio_low=None, clip_ratio_high=None))
    assert (c.clip_low, c.clip_high) == (0.3, 0.3)


def test_seq_mean_token_sum_norm_hand_computed() -> None:
    loss_BT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [7.0, 7.0, 7.0]])
    mask_BT = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # an empty response: not counted in N
    # sums 6 and 4; C = 3 (the width) by default: (6/3 + 4/3) / 2 = 5/3; with C = 10: (0.6 + 0.4) / 2 = 0.5
    assert aggregate(loss_BT, mask_BT, "seq-mean-token-sum-norm").item() == pytest.approx(5 / 3)
    assert aggregate(loss_BT, mask_BT, "seq-mean-token-sum-norm", norm_constant=10).item() == pytest.approx(0.5)
    assert local_normalizer(mask_BT, "seq-mean-token-sum-norm").item() == 2
    # micro-batches of different padded widths add up when C is fixed
    parts = [aggregate(loss_BT[r, :w], mask_BT[r, :w], "seq-mean-token-sum-norm", global_normalizer=2,
                       norm_constant=10) for r, w in ((slice(0, 1), 3), (slice(1, 3), 1))]
    assert sum(p.item() for p in parts) == pytest.approx(0.5)


def test_actor_objective_uses_the_constant_for_every_term() -> None:
    from types import SimpleNamespace

    obj = ActorObjective(policy_loss=PPOClipLoss(), loss_agg_mode="seq-mean-token-sum-norm", entropy_coeff=0.0,
                         use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="low_var_kl", norm_constant=8)
    old_BT = torch.tensor([[-1.0, -1.0, 0.0], [-2.0, 0.0, 0.0]])
    mb = SimpleNamespace(old_logprobs=old_BT, advantages=torch.tensor([[1.0, 1.0, 0.0], [-1.0, 0.0, 0.0]]),
                         loss_mask=torch.tensor([[1, 1, 0], [1, 0, 0]]), ref_logprobs=None)
    loss, metrics = obj(old_BT.clone(), torch.zeros(2, 3), mb, normalizer=torch.tensor(2.0))  # type: ignore[arg-type]
    # on-policy PPO per-token loss = -A: sums -2 and +1; (-2/8 + 1/8) / 2 = -1/16
    assert loss.item() == pytest.approx(-1 / 16)
    with pytest.raises(ValueError, match="norm_constant"):
        ActorObjective(policy_loss=PPOClipLoss(), loss_agg_mode="seq-mean-token-sum-norm", entropy_coeff=0.0,
                       use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="low_var_kl")
