"""Policy losses against hand-computed small cases; ratios are set as logprob = log(ratio), old = 0."""

from __future__ import annotations

import math

import pytest
import torch

from hybridrl.algorithms.policy_losses import CISPOLoss, DualClipLoss, GSPOLoss, PPOClipLoss

ATOL = 1e-5


def _ratios(*ratios: float) -> torch.Tensor:
    return torch.log(torch.tensor([list(ratios)])).requires_grad_(True)


def test_ppo_clip_asymmetric_both_sides() -> None:
    loss_fn = PPOClipLoss(PPOClipLoss.Config(clip_ratio_low=0.2, clip_ratio_high=0.28))  # r in [0.8, 1.28]
    logp_BT = _ratios(1.5, 0.5, 0.5, 1.5, 1.25, 1.0)
    adv_BT = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0, 2.0]])
    loss, metrics = loss_fn(logprobs_BT=logp_BT, old_logprobs_BT=torch.zeros(1, 6), advantages_BT=adv_BT,
                            response_mask_BT=torch.ones(1, 6), loss_agg_mode="token-mean")
    # per token: max(-A r, -A clip(r, 0.8, 1.28))
    #   A=+1 r=1.5 : max(-1.5, -1.28) = -1.28   clipped (upper)
    #   A=+1 r=0.5 : max(-0.5, -0.8)  = -0.5    not clipped (the unclipped term is pessimistic)
    #   A=-1 r=0.5 : max( 0.5,  0.8)  =  0.8    clipped (lower)
    #   A=-1 r=1.5 : max( 1.5,  1.28) =  1.5    not clipped
    #   A=+1 r=1.25: -1.25, inside [0.8, 1.28] (a symmetric 0.2 range would have clipped it)
    #   A=+2 r=1   : -2
    # token-mean = (-1.28 - 0.5 + 0.8 + 1.5 - 1.25 - 2) / 6 = -2.73 / 6 = -0.455
    torch.testing.assert_close(loss, torch.tensor(-0.455))
    torch.testing.assert_close(metrics["pg_loss"], torch.tensor(-0.455))
    torch.testing.assert_close(metrics["clipfrac"], torch.tensor(2 / 6))
    # ppo_kl = mean(old - new) = -(ln 1.5 + ln 0.5 + ln 0.5 + ln 1.5 + ln 1.25 + 0) / 6 = 0.058703
    torch.testing.assert_close(metrics["ppo_kl"], torch.tensor(0.058703), atol=ATOL, rtol=0)
    loss.backward()
    # d/d logp of -A r is -A r (clipped tokens: 0), divided by 6 tokens
    assert logp_BT.grad is not None
    expected_grad = torch.tensor([[0.0, -0.5, 0.0, 1.5, -1.25, -2.0]]) / 6
    torch.testing.assert_close(logp_BT.grad, expected_grad)


def test_ppo_clip_symmetric_default_clips_1_25() -> None:
    logp_BT = _ratios(1.25)
    loss, metrics = PPOClipLoss()(logprobs_BT=logp_BT, old_logprobs_BT=torch.zeros(1, 1),
                                  advantages_BT=torch.ones(1, 1), response_mask_BT=torch.ones(1, 1),
                                  loss_agg_mode="token-mean")
    # clip_ratio 0.2: max(-1.25, -1.2) = -1.2, clipped
    torch.testing.assert_close(loss, torch.tensor(-1.2))
    assert metrics["clipfrac"].item() == 1.0


def test_dual_clip_bounds_negative_advantages() -> None:
    loss_fn = DualClipLoss(DualClipLoss.Config(clip_ratio=0.2, clip_ratio_c=3.0))
    logp_BT = _ratios(5.0, 2.0, 5.0, 0.5)
    adv_BT = torch.tensor([[-1.0, -1.0, 1.0, -2.0]])
    loss, metrics = loss_fn(logprobs_BT=logp_BT, old_logprobs_BT=torch.zeros(1, 4), advantages_BT=adv_BT,
                            response_mask_BT=torch.ones(1, 4), loss_agg_mode="token-mean")
    # A=-1 r=5  : PPO max(5, 1.2) = 5, dual min(5, -A*c = 3) = 3        dual bound active
    # A=-1 r=2  : PPO max(2, 1.2) = 2, min(2, 3) = 2                    no clipping
    # A=+1 r=5  : PPO max(-5, -1.2) = -1.2 (clipped); dual clip only applies to A < 0
    # A=-2 r=0.5: PPO max(1, 1.6) = 1.6 (clipped), min(1.6, 6) = 1.6
    # token-mean = (3 + 2 - 1.2 + 1.6) / 4 = 1.35
    torch.testing.assert_close(loss, torch.tensor(1.35))
    torch.testing.assert_close(metrics["clipfrac_lower"], torch.tensor(0.25))
    torch.testing.assert_close(metrics["clipfrac"], torch.tensor(0.5))  # tokens 3 and 4 (PPO clip)
    loss.backward()
    # only token 2 (unclipped, -A r = 2) has a gradient: 2 / 4
    assert logp_BT.grad is not None
    torch.testing.assert_close(logp_BT.grad, torch.tensor([[0.0, 0.5, 0.0, 0.0]]))


def test_gspo_sequence_ratio_and_clipping() -> None:
    loss_fn = GSPOLoss(GSPOLoss.Config(clip_ratio_low=0.05, clip_ratio_high=0.05))  # s in [0.95, 1.05]
    logp_BT = torch.tensor([[0.2, 0.0, 5.0], [-0.3, 0.0, 0.0]], requires_grad=True)
    mask_BT = torch.tensor([[1, 1, 0], [1, 1, 1]])  # 5.0 is padding: it must not enter the ratio
    loss, metrics = loss_fn(logprobs_BT=logp_BT, old_logprobs_BT=torch.zeros(2, 3),
                            advantages_BT=torch.ones(2, 3), response_mask_BT=mask_BT,
                            loss_agg_mode="seq-mean-token-mean")
    # seq 0: s = exp((0.2 + 0) / 2) = exp(0.1) = 1.105171 -> clipped to 1.05, loss -1.05, no gradient
    # seq 1: s = exp((-0.3 + 0 + 0) / 3) = exp(-0.1) = 0.904837; A > 0 so the lower clip is not
    #        active: loss -0.904837 (a token-level PPO would see r = exp(-0.3) = 0.741 on token 0)
    # seq-mean-token-mean = (-1.05 - 0.904837) / 2 = -0.977419
    torch.testing.assert_close(loss, torch.tensor(-0.977419), atol=ATOL, rtol=0)
    torch.testing.assert_close(metrics["clipfrac"], torch.tensor(2 / 5))  # 2 of 5 tokens in seq 0
    # ppo_kl = -(0.2 + 0 - 0.3 + 0 + 0) / 5 = 0.02
    torch.testing.assert_close(metrics["ppo_kl"], torch.tensor(0.02))
    loss.backward()
    # seq 1 token gradient: d(-A s_i,t)/d logp_t = -s_1 = -0.904837, / 3 tokens / 2 sequences
    assert logp_BT.grad is not None
    torch.testing.assert_close(
        logp_BT.grad, torch.tensor([[0.0, 0.0, 0.0], [-0.150806] * 3]), atol=ATOL, rtol=0
    )


def test_gspo_and_cispo_take_verls_actor_keys_as_verl_does() -> None:
    """verl's actor keys reach whichever loss is chosen: clip_ratio fills a null side, clip_ratio_c (the vanilla loss's
    dual clip) is accepted and unused by GSPO and CISPO, as in verl."""
    inputs = dict(logprobs_BT=torch.tensor([[0.2, 0.0], [-0.3, 0.0]]), old_logprobs_BT=torch.zeros(2, 2),
                  advantages_BT=torch.tensor([[1.0, 1.0], [-1.0, -1.0]]), response_mask_BT=torch.ones(2, 2),
                  loss_agg_mode="seq-mean-token-mean")
    plain, _ = GSPOLoss(GSPOLoss.Config(clip_ratio_low=0.05, clip_ratio_high=0.05))(**inputs)
    verl, _ = GSPOLoss(GSPOLoss.Config(clip_ratio=0.05, clip_ratio_low=None, clip_ratio_high=None,
                                       clip_ratio_c=10.0))(**inputs)
    torch.testing.assert_close(verl, plain)
    assert CISPOLoss.Config(clip_ratio_c=10.0).bounds() == CISPOLoss.Config().bounds()


def test_gspo_gradient_is_the_sequence_ratio_gradient() -> None:
    # with a constant advantage, seq-mean-token-mean of GSPO-token is -A * s_i per sequence, whose
    # gradient is -A * s_i * (1/|y|) * grad(sum_t logp_t): compare with autograd of -A * s_i
    logp_BT = torch.tensor([[0.01, -0.02, 0.005, 0.0]], requires_grad=True)
    mask_BT = torch.tensor([[1, 1, 1, 0]])
    loss, _ = GSPOLoss()(logprobs_BT=logp_BT, old_logprobs_BT=torch.zeros(1, 4),
                         advantages_BT=torch.full((1, 4), 2.0), response_mask_BT=mask_BT,
                         loss_agg_mode="seq-mean-token-mean")
    loss.backward()
    ref_BT = logp_BT.detach().clone().requires_grad_(True)
    s = torch.exp((ref_BT * mask_BT).sum() / 3)  # exp(-0.005 / 3) = 0.998335 < 1 - 3e-4 ...
    assert s.item() < 1 - 3e-4  # ... and A > 0, so the unclipped term -A s is the active one
    (-2.0 * s).backward()
    torch.testing.assert_close(logp_BT.grad, ref_BT.grad)
    torch.testing.assert_close(loss, (-2.0 * s).detach())


@pytest.mark.parametrize("loss_cls", [PPOClipLoss, DualClipLoss, GSPOLoss])
def test_gradients_flow_only_through_logprobs(loss_cls: type) -> None:
    g = torch.Generator().manual_seed(0)
    logp_BT = (torch.randn(3, 4, generator=g) * 0.1).requires_grad_(True)
    old_BT = (torch.randn(3, 4, generator=g) * 0.1).requires_grad_(True)
    adv_BT = torch.randn(3, 4, generator=g).requires_grad_(True)
    loss, metrics = loss_cls()(logprobs_BT=logp_BT, old_logprobs_BT=old_BT, advantages_BT=adv_BT,
                               response_mask_BT=torch.ones(3, 4), loss_agg_mode="token-mean")
    loss.backward()
    assert logp_BT.grad is not None and logp_BT.grad.abs().sum() > 0
    assert old_BT.grad is None and adv_BT.grad is None
    assert all(not m.requires_grad for m in metrics.values())


def test_on_policy_ratio_is_one() -> None:
    # logprobs == old: ratio 1, loss = token-mean(-A) = -(1 + 2 + 3) / 3 = -2, nothing clipped, kl 0
    for loss_cls in (PPOClipLoss, DualClipLoss, GSPOLoss):
        logp_BT = torch.tensor([[-0.5, -1.0, -2.0]])
        loss, metrics = loss_cls()(logprobs_BT=logp_BT, old_logprobs_BT=logp_BT.clone(),
                                   advantages_BT=torch.tensor([[1.0, 2.0, 3.0]]),
                                   response_mask_BT=torch.ones(1, 3), loss_agg_mode="token-mean")
        torch.testing.assert_close(loss, torch.tensor(-2.0))
        assert metrics["clipfrac"].item() == 0.0 and metrics["ppo_kl"].item() == 0.0
        assert math.isfinite(metrics["pg_loss"].item())


@pytest.mark.parametrize("name", ["ppo_clip", "dual_clip", "gspo"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batch_losses_add_up_to_the_mini_batch_loss(name: str, mode: str) -> None:
    """With the mini-batch's normaliser, gradient accumulation over micro-batches is exact."""
    from hybridrl.algorithms.loss_agg import local_normalizer
    from hybridrl.registry import Registry

    loss_fn = Registry("policy_losses").build(name, {}, key="algorithm.policy_loss_kwargs")
    g = torch.Generator().manual_seed(0)
    old_BT = -torch.rand(6, 5, generator=g)
    new_BT = old_BT + 0.1 * torch.randn(6, 5, generator=g)
    adv_BT = torch.randn(6, 5, generator=g)
    mask_BT = (torch.rand(6, 5, generator=g) > 0.3).float()
    kw = dict(loss_agg_mode=mode)
    full, _ = loss_fn(logprobs_BT=new_BT, old_logprobs_BT=old_BT, advantages_BT=adv_BT, response_mask_BT=mask_BT, **kw)
    norm = local_normalizer(mask_BT, mode)
    parts = [loss_fn(logprobs_BT=new_BT[s], old_logprobs_BT=old_BT[s], advantages_BT=adv_BT[s],
                     response_mask_BT=mask_BT[s], global_normalizer=norm, **kw)[0]
             for s in (slice(0, 2), slice(2, 5), slice(5, 6))]
    assert torch.allclose(sum(parts), full, atol=1e-6)
