"""SAPO (``algorithm.policy_loss=sapo``): the gate's value and slope against the paper's formula, the temperature by
advantage sign, the soft trust region against PPO's hard clip, and its config checks. (The plugin contract — masks,
metrics, on-policy ppo_kl 0 — is tests/algorithms/test_algorithm_plugin_contract.py's, for every installed loss.)"""

from __future__ import annotations

import math

import pytest
import torch

from hybridrl.algorithms.policy_losses import PPOClipLoss, SAPOLoss
from hybridrl.registry import PluginConfigError, Registry


def _grad(loss_fn, logp: float, old: float, adv: float) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(loss, d loss / d logprob) of one token."""
    logp_BT = torch.tensor([[logp]], dtype=torch.float64, requires_grad=True)
    loss, _ = loss_fn(logprobs_BT=logp_BT, old_logprobs_BT=torch.tensor([[old]], dtype=torch.float64),
                      advantages_BT=torch.tensor([[adv]], dtype=torch.float64),
                      response_mask_BT=torch.ones(1, 1), loss_agg_mode="token-mean")
    loss.backward()
    return float(loss), float(logp_BT.grad)


def test_the_gate_is_the_papers() -> None:
    sapo = SAPOLoss(SAPOLoss.Config(tau_pos=1.0, tau_neg=2.0))
    for log_ratio, adv in ((0.3, 1.5), (-0.4, 1.5), (0.3, -0.7), (-0.4, -0.7)):
        r, tau = math.exp(log_ratio), 1.0 if adv > 0 else 2.0
        sig = 1 / (1 + math.exp(-tau * (r - 1)))
        loss, grad = _grad(sapo, log_ratio - 1.0, -1.0, adv)
        assert loss == pytest.approx(-(4 / tau) * sig * adv, rel=1e-12)
        # d/d logp of -(4/τ) σ(τ(r-1)) A, with dr/dlogp = r
        assert grad == pytest.approx(-4 * sig * (1 - sig) * r * adv, rel=1e-12)


def test_on_policy_it_is_the_policy_gradient_and_off_policy_it_decays_softly() -> None:
    sapo, ppo = SAPOLoss(), PPOClipLoss(PPOClipLoss.Config(clip_ratio=0.2))
    assert _grad(sapo, -1.0, -1.0, 2.0)[1] == pytest.approx(-2.0)  # slope 1: -A, as PPO's on-policy gradient
    assert _grad(ppo, -1.0, -1.0, 2.0)[1] == pytest.approx(-2.0)
    far = -1.0 + math.log(1.5)  # r = 1.5, A > 0: PPO's clip zeroes the gradient, SAPO's gate shrinks it
    assert _grad(ppo, far, -1.0, 2.0)[1] == 0.0
    sapo_far = _grad(sapo, far, -1.0, 2.0)[1]
    assert -2.0 * 1.5 < sapo_far < 0  # still a push, smaller than the unclipped r·A (slope < 1)
    # a hotter negative gate (τ_neg > τ_pos, the paper's choice) damps a negative token's off-policy push more
    hot = SAPOLoss(SAPOLoss.Config(tau_pos=1.0, tau_neg=5.0))
    assert abs(_grad(hot, far, -1.0, -2.0)[1]) < abs(_grad(hot, far, -1.0, 2.0)[1])


def test_metrics_count_the_tokens_the_gate_has_halved() -> None:
    sapo = SAPOLoss(SAPOLoss.Config(tau_pos=4.0, tau_neg=4.0))
    log_ratio = torch.tensor([[0.0, 0.05, 0.8, -1.5]])  # slopes 1, ~0.96, ~0.1, ~0.04 at τ = 4
    _, m = sapo(logprobs_BT=log_ratio, old_logprobs_BT=torch.zeros(1, 4), advantages_BT=torch.ones(1, 4),
                response_mask_BT=torch.ones(1, 4), loss_agg_mode="token-mean")
    assert float(m["clipfrac"]) == pytest.approx(0.5) and float(m["ppo_kl"]) == pytest.approx(float(-log_ratio.mean()))


def test_temperatures_must_be_positive_naming_the_key() -> None:
    with pytest.raises(PluginConfigError, match=r"tau_neg"):
        Registry("policy_losses").make_config("sapo", {"tau_neg": 0.0}, key="algorithm.policy_loss_kwargs")
    config = Registry("policy_losses").make_config("sapo", {"clip_ratio": 0.2, "clip_ratio_c": 3.0},
                                                   key="algorithm.policy_loss_kwargs")
    assert (config.tau_pos, config.tau_neg) == (1.0, 1.05)  # verl's defaults; its clip keys accepted
