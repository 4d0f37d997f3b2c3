"""Advantage estimators against hand-computed small cases (arithmetic in the comments)."""

from __future__ import annotations

import pytest
import torch

from hybridrl.algorithms.advantages import (
    GAEEstimator,
    GRPOEstimator,
    ReinforcePlusPlusEstimator,
    RLOOEstimator,
)

ATOL = 1e-5


def _outcome_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """8 samples, T=3; group ids are not contiguous and not 0..G-1.

    group 7: rewards 1, 0        (sample 0 has its reward split 0.5 + 0.5 over two tokens)
    group 3: rewards 2, 2, 2     (identical)
    group 5: reward 3            (a group of one)
    group 9: rewards 0, 4
    """
    mask_BT = torch.tensor(
        [[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]]
    )
    rewards_BT = torch.tensor(
        [
            [0.5, 0.5, 9.0],  # group 7, r = 1 (the 9.0 is outside the mask and ignored)
            [0.0, 0.0, 2.0],  # group 3, r = 2
            [0.0, 0.0, 0.0],  # group 7, r = 0
            [0.0, 0.0, 2.0],  # group 3, r = 2
            [0.0, 3.0, 0.0],  # group 5, r = 3
            [0.0, 0.0, 0.0],  # group 9, r = 0
            [2.0, 0.0, 0.0],  # group 3, r = 2
            [0.0, 0.0, 4.0],  # group 9, r = 4
        ]
    )
    group_B = torch.tensor([7, 3, 7, 3, 5, 9, 3, 9])
    return rewards_BT, mask_BT, group_B


def test_grpo_with_std_norm() -> None:
    rewards_BT, mask_BT, group_B = _outcome_batch()
    adv_BT, ret_BT = GRPOEstimator()(token_rewards_BT=rewards_BT, response_mask_BT=mask_BT, group_index_B=group_B)
    # group 7: r = (1, 0), mean 0.5, unbiased std = sqrt((0.25 + 0.25) / 1) = 0.707107
    #          A = +-0.5 / 0.707107 = +-0.707106
    # group 3: identical rewards -> A = 0 / (0 + eps) = 0
    # group 5: one sample -> A = 0
    # group 9: r = (0, 4), mean 2, std = sqrt((4 + 4) / 1) = 2.828427, A = +-2 / 2.828427 = +-0.707107
    expected_B = torch.tensor([0.707106, 0.0, -0.707106, 0.0, 0.0, -0.707106, 0.0, 0.707106])
    torch.testing.assert_close(adv_BT, expected_B[:, None] * mask_BT, atol=ATOL, rtol=0)
    torch.testing.assert_close(ret_BT, adv_BT)


def test_grpo_without_std_norm() -> None:
    rewards_BT, mask_BT, group_B = _outcome_batch()
    est = GRPOEstimator(GRPOEstimator.Config(norm_adv_by_std_in_grpo=False))
    adv_BT, _ = est(token_rewards_BT=rewards_BT, response_mask_BT=mask_BT, group_index_B=group_B)
    # r - group mean: group 7: 1 - 0.5, 0 - 0.5; group 3: 0; group 5 (size 1): 0; group 9: 0 - 2, 4 - 2
    expected_B = torch.tensor([0.5, 0.0, -0.5, 0.0, 0.0, -2.0, 0.0, 2.0])
    torch.testing.assert_close(adv_BT, expected_B[:, None] * mask_BT, atol=ATOL, rtol=0)


def test_grpo_three_sample_group_uses_unbiased_std() -> None:
    rewards_BT = torch.tensor([[0.0], [2.0], [4.0]])
    mask_BT = torch.ones(3, 1)
    adv_BT, _ = GRPOEstimator(GRPOEstimator.Config(epsilon=0.0))(
        token_rewards_BT=rewards_BT, response_mask_BT=mask_BT, group_index_B=torch.zeros(3, dtype=torch.long)
    )
    # mean 2, unbiased var = (4 + 0 + 4) / 2 = 4 -> std 2 (the biased std would be 1.632993)
    torch.testing.assert_close(adv_BT, torch.tensor([[-1.0], [0.0], [1.0]]))


def test_rloo() -> None:
    rewards_BT = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 2.0], [4.0, 0.0], [5.0, 0.0]])
    mask_BT = torch.tensor([[1, 0], [1, 1], [1, 1], [1, 1], [1, 0], [1, 0]])
    group_B = torch.tensor([0, 0, 0, 1, 1, 2])
    adv_BT, ret_BT = RLOOEstimator()(token_rewards_BT=rewards_BT, response_mask_BT=mask_BT, group_index_B=group_B)
    # group 0: r = (1, 0, 0): A_0 = 1 - (0 + 0)/2 = 1; A_1 = 0 - (1 + 0)/2 = -0.5; A_2 = -0.5
    # group 1: r = (2, 4): A = 2 - 4 = -2, 4 - 2 = 2
    # group 2: one sample -> 0
    expected_B = torch.tensor([1.0, -0.5, -0.5, -2.0, 2.0, 0.0])
    torch.testing.assert_close(adv_BT, expected_B[:, None] * mask_BT, atol=ATOL, rtol=0)
    torch.testing.assert_close(ret_BT, adv_BT)


def test_reinforce_pp_discounted_returns_and_whitening() -> None:
    rewards_BT = torch.tensor([[0.0, 0.0, 1.0, 7.0], [1.0, 0.0, 0.0, 2.0]])
    mask_BT = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    adv_BT, ret_BT = ReinforcePlusPlusEstimator(ReinforcePlusPlusEstimator.Config(gamma=0.5))(
        token_rewards_BT=rewards_BT, response_mask_BT=mask_BT, group_index_B=torch.arange(2)
    )
    # sample 0 (7.0 is padding): G2 = 1, G1 = 0 + 0.5 * 1 = 0.5, G0 = 0 + 0.5 * 0.5 = 0.25
    # sample 1: G3 = 2, G2 = 0 + 0.5 * 2 = 1, G1 = 0 + 0.5 * 1 = 0.5, G0 = 1 + 0.5 * 0.5 = 1.25
    torch.testing.assert_close(ret_BT, torch.tensor([[0.25, 0.5, 1.0, 0.0], [1.25, 0.5, 1.0, 2.0]]))
    # whitening over the 7 response tokens (0.25, 0.5, 1, 1.25, 0.5, 1, 2):
    # mean = 6.5 / 7 = 0.928571; unbiased var = 2.0892857 / 6 = 0.348214; std = 0.590097
    # A = (G - 0.928571) / 0.590097
    expected_BT = torch.tensor(
        [[-1.149932, -0.726273, 0.121046, 0.0], [0.544705, -0.726273, 0.121046, 1.815683]]
    )
    torch.testing.assert_close(adv_BT, expected_BT, atol=ATOL, rtol=0)


def test_reinforce_pp_skips_masked_tokens_inside_a_response() -> None:
    # a multi-turn response: token 1 is a tool observation (masked out); its 5.0 is not a reward
    rewards_BT = torch.tensor([[0.0, 5.0, 1.0], [0.0, 0.0, 1.0]])
    mask_BT = torch.tensor([[1, 0, 1], [1, 1, 1]])
    _, ret_BT = ReinforcePlusPlusEstimator(ReinforcePlusPlusEstimator.Config(gamma=0.5))(
        token_rewards_BT=rewards_BT, response_mask_BT=mask_BT, group_index_B=torch.arange(2)
    )
    # sample 0: G2 = 1, token 1 skipped (no discount step), G0 = 0 + 0.5 * 1 = 0.5
    # sample 1: G2 = 1, G1 = 0.5, G0 = 0.25
    torch.testing.assert_close(ret_BT, torch.tensor([[0.5, 0.0, 1.0], [0.25, 0.5, 1.0]]))


def test_gae_against_hand_unrolled_recursion() -> None:
    gamma, lam = 0.9, 0.8  # gamma * lam = 0.72
    rewards_BT = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    values_BT = torch.tensor([[0.5, 0.4, 0.3], [1.0, 0.5, 9.0]])  # 9.0: padding, must be ignored
    mask_BT = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv_BT, ret_BT = GAEEstimator(GAEEstimator.Config(gamma=gamma, lam=lam))(
        token_rewards_BT=rewards_BT, response_mask_BT=mask_BT, group_index_B=torch.arange(2),
        values_BT=values_BT,
    )
    # sample 0:
    #   t2: delta = 1 + 0.9 * 0   - 0.3 = 0.7;    A2 = 0.7
    #   t1: delta = 0 + 0.9 * 0.3 - 0.4 = -0.13;  A1 = -0.13 + 0.72 * 0.7   = 0.374
    #   t0: delta = 0 + 0.9 * 0.4 - 0.5 = -0.14;  A0 = -0.14 + 0.72 * 0.374 = 0.12928
    #   returns = A + V = 0.62928, 0.774, 1.0
    # sample 1 (t2 is padding):
    #   t1: delta = 2 + 0.9 * 0   - 0.5 = 1.5;    A1 = 1.5
    #   t0: delta = 0 + 0.9 * 0.5 - 1.0 = -0.55;  A0 = -0.55 + 0.72 * 1.5 = 0.53
    #   returns = 1.53, 2.0, (0)
    torch.testing.assert_close(ret_BT, torch.tensor([[0.62928, 0.774, 1.0], [1.53, 2.0, 0.0]]), atol=ATOL, rtol=0)
    # whitening over (0.12928, 0.374, 0.7, 0.53, 1.5): mean = 3.23328 / 5 = 0.646656,
    # unbiased var = 1.0866694 / 4 = 0.271667, std = 0.521217
    expected_BT = torch.tensor([[-0.992630, -0.523114, 0.102345], [-0.223815, 1.637214, 0.0]])
    torch.testing.assert_close(adv_BT, expected_BT, atol=ATOL, rtol=0)


def test_gae_needs_values() -> None:
    with pytest.raises(ValueError, match="values_BT"):
        GAEEstimator()(token_rewards_BT=torch.zeros(1, 2), response_mask_BT=torch.ones(1, 2),
                       group_index_B=torch.zeros(1))
