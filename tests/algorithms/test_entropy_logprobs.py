"""Entropy and target log-probs from logits, against torch.distributions.Categorical."""

from __future__ import annotations

import torch
from torch.distributions import Categorical

from hybridrl.algorithms.entropy import entropy_from_logits, logprobs_from_logits


def test_matches_categorical() -> None:
    g = torch.Generator().manual_seed(0)
    logits_BTV = torch.randn(2, 5, 11, generator=g) * 4
    targets_BT = torch.randint(0, 11, (2, 5), generator=g)
    dist = Categorical(logits=logits_BTV)
    torch.testing.assert_close(entropy_from_logits(logits_BTV), dist.entropy())
    torch.testing.assert_close(logprobs_from_logits(logits_BTV, targets_BT), dist.log_prob(targets_BT))


def test_hand_computed_uniform_and_large_logits() -> None:
    # uniform over 4 -> H = ln 4, log p = -ln 4; shifting logits by 1000 changes nothing (stable)
    logits_BTV = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [1000.0, 1000.0, 1000.0, 1000.0]]])
    ln4 = torch.log(torch.tensor(4.0))
    torch.testing.assert_close(entropy_from_logits(logits_BTV), torch.stack([ln4, ln4])[None])
    torch.testing.assert_close(logprobs_from_logits(logits_BTV, torch.tensor([[0, 3]])), -torch.stack([ln4, ln4])[None])


def test_minus_inf_logits_give_finite_values_and_gradients() -> None:
    # two live tokens of equal logit: H = ln 2, and the -inf entries contribute 0
    logits_BTV = torch.tensor([[[0.0, 0.0, float("-inf"), float("-inf")]]], requires_grad=True)
    entropy_BT = entropy_from_logits(logits_BTV)
    torch.testing.assert_close(entropy_BT, torch.log(torch.tensor([[2.0]])))
    (entropy_BT.sum() + logprobs_from_logits(logits_BTV, torch.tensor([[1]])).sum()).backward()
    assert logits_BTV.grad is not None and torch.isfinite(logits_BTV.grad).all()


def test_bf16_logits_are_computed_in_float32() -> None:
    logits_BTV = (torch.randn(1, 3, 7, generator=torch.Generator().manual_seed(1)) * 3).bfloat16()
    dist = Categorical(logits=logits_BTV.float())
    assert entropy_from_logits(logits_BTV).dtype == torch.float32
    torch.testing.assert_close(entropy_from_logits(logits_BTV), dist.entropy())
    targets_BT = torch.tensor([[0, 3, 6]])
    torch.testing.assert_close(logprobs_from_logits(logits_BTV, targets_BT), dist.log_prob(targets_BT))


def test_entropy_gradient_matches_categorical() -> None:
    logits_a = torch.randn(3, 6, generator=torch.Generator().manual_seed(2), requires_grad=True)
    logits_b = logits_a.detach().clone().requires_grad_(True)
    entropy_from_logits(logits_a).sum().backward()
    Categorical(logits=logits_b).entropy().sum().backward()
    torch.testing.assert_close(logits_a.grad, logits_b.grad)
