"""Dr. GRPO and REINFORCE++-baseline against hand-computed small cases (arithmetic in the comments)."""

from __future__ import annotations

import math

import torch

from hybridrl.algorithms.advantages import DrGRPOEstimator, GRPOEstimator, ReinforcePlusPlusBaselineEstimator

ATOL = 1e-5


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """6 samples, T=3, unequal groups, a group of one, identical rewards, an empty response.

    group 7: rewards 1, 0, 2    (sample 0's reward split 0.5 + 0.5; sample 2's response is empty: r = 0)
    group 3: rewards 2, 2       (identical)
    group 5: reward 3           (a group of one)
    """
    mask_BT = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]])
    rewards_BT = torch.tensor([
        [0.5, 0.5, 9.0],  # group 7, r = 1 (9.0 outside the mask, ignored)
        [2.0, 0.0, 0.0],  # group 3, r = 2
        [5.0, 0.0, 0.0],  # group 7, empty response: r = 0
        [0.0, 0.0, 2.0],  # group 3, r = 2
        [0.0, 3.0, 0.0],  # group 5, r = 3
        [0.0, 0.0, 2.0],  # group 7, r = 2
    ])
    group_B = torch.tensor([7, 3, 7, 3, 5, 7])
    return rewards_BT, mask_BT, group_B


def _run(est, rewards_BT, mask_BT, group_B):  # noqa: ANN001, ANN202
    return est(token_rewards_BT=rewards_BT, response_mask_BT=mask_BT.float(), group_index_B=group_B)


def test_drgrpo_is_mean_baseline_without_std() -> None:
    rewards_BT, mask_BT, group_B = _batch()
    adv_BT, ret_BT = _run(DrGRPOEstimator(), rewards_BT, mask_BT, group_B)
    # group 7: mean (1 + 0 + 2) / 3 = 1 -> 0, -1, 1; group 3: 0, 0; group 5 (one sample): 0
    per_sample = torch.tensor([0.0, 0.0, -1.0, 0.0, 0.0, 1.0])
    torch.testing.assert_close(adv_BT, per_sample[:, None] * mask_BT.float(), atol=ATOL, rtol=0)
    torch.testing.assert_close(ret_BT, adv_BT)
    assert (adv_BT[2] == 0).all()  # the empty response gets nothing
    plain = _run(GRPOEstimator(GRPOEstimator.Config(norm_adv_by_std_in_grpo=False)), rewards_BT, mask_BT, group_B)
    torch.testing.assert_close(adv_BT, plain[0])  # exactly GRPO with the std division off
    assert DrGRPOEstimator.needs_group and not DrGRPOEstimator.needs_critic
    assert DrGRPOEstimator.loss_agg_mode == "seq-mean-token-sum-norm"


def test_reinforce_pp_baseline_hand_computed() -> None:
    rewards_BT, mask_BT, group_B = _batch()
    adv_BT, ret_BT = _run(ReinforcePlusPlusBaselineEstimator(), rewards_BT, mask_BT, group_B)
    # baselined a: group 7 -> [0, -, -1, -, -, 1]; group 3 -> 0, 0; group 5 excluded (a group of one).
    # tokens entering the statistics: sample 0: 2 tokens of 0; sample 1: 1 of 0; sample 2: none (empty);
    # sample 3: 3 of 0; sample 5: 3 of +1  -> 9 tokens, sum 3, mean 1/3
    # unbiased var = (6 * (1/3)^2 + 3 * (2/3)^2) / 8 = (2/3 + 4/3) / 8 = 0.25 -> std 0.5
    std = math.sqrt(0.25 + 1e-8)
    zero, one = (0 - 1 / 3) / std, (1 - 1 / 3) / std
    expected_B = torch.tensor([zero, zero, 0.0, zero, 0.0, one])
    torch.testing.assert_close(adv_BT, expected_B[:, None] * mask_BT.float(), atol=ATOL, rtol=0)
    torch.testing.assert_close(ret_BT, adv_BT)
    assert (adv_BT[4] == 0).all()  # the group of one: no baseline, no signal


def test_reinforce_pp_baseline_whitens_globally_not_per_group() -> None:
    mask_BT = torch.ones(4, 1)
    rewards_BT = torch.tensor([[1.0], [0.0], [10.0], [0.0]])  # group 0: ±0.5, group 1: ±5
    adv_BT, _ = _run(ReinforcePlusPlusBaselineEstimator(), rewards_BT, mask_BT, torch.tensor([0, 0, 1, 1]))
    # a = [0.5, -0.5, 5, -5], mean 0, unbiased var = (0.25 + 0.25 + 25 + 25) / 3 = 50.5 / 3
    std = math.sqrt(50.5 / 3 + 1e-8)
    torch.testing.assert_close(adv_BT[:, 0], torch.tensor([0.5, -0.5, 5.0, -5.0]) / std, atol=ATOL, rtol=0)


def test_all_equal_rewards_and_single_samples_give_zero() -> None:
    mask_BT = torch.tensor([[1, 1], [1, 0], [1, 1], [0, 0]])
    rewards_BT = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])  # every r = 1 (last: empty, 0)
    for est in (DrGRPOEstimator(), ReinforcePlusPlusBaselineEstimator()):
        adv_BT, _ = _run(est, rewards_BT, mask_BT, torch.tensor([0, 0, 0, 1]))
        assert torch.isfinite(adv_BT).all()
        assert (adv_BT[:3] == 0).all() and (adv_BT[3] == 0).all()  # group 1 is one empty sample
        adv_BT, _ = _run(est, rewards_BT, mask_BT, torch.tensor([0, 1, 2, 3]))  # all groups of one
        assert (adv_BT == 0).all()
