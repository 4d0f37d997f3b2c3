"""DPO / cDPO / IPO losses against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from hybridrl.algorithms.dpo_loss import dpo_loss

# two pairs: sequence log-probs of the policy and the reference
POLICY_CHOSEN, POLICY_REJECTED = torch.tensor([-3.0, -5.0]), torch.tensor([-6.0, -4.0])
REF_CHOSEN, REF_REJECTED = torch.tensor([-4.0, -5.0]), torch.tensor([-5.0, -5.0])
# h = (πc − refc) − (πr − refr): pair 0: 1 − (−1) = 2; pair 1: 0 − 1 = −1


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def test_sigmoid_loss_and_rewards_by_hand() -> None:
    t = dpo_loss(POLICY_CHOSEN, POLICY_REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.5)
    # L = −log σ(β h): β h = 1.0 and −0.5
    expected = [-_log_sigmoid(1.0), -_log_sigmoid(-0.5)]
    assert t.loss_N.tolist() == pytest.approx(expected, abs=1e-6)
    assert expected == pytest.approx([0.3132617, 0.9740770], abs=1e-6)
    assert t.chosen_reward_N.tolist() == pytest.approx([0.5, 0.0])  # β (πc − refc)
    assert t.rejected_reward_N.tolist() == pytest.approx([-0.5, 0.5])
    sums = t.metric_sums()
    assert float(sums["dpo/loss"]) == pytest.approx(sum(expected), abs=1e-6)
    assert float(sums["rewards/margin"]) == pytest.approx(1.0 - 0.5)
    assert float(sums["rewards/accuracy"]) == 1.0  # pair 0 only
    assert float(sums["rewards/chosen"]) == pytest.approx(0.5) and float(sums["rewards/rejected"]) == 0.0


def test_label_smoothing_is_cdpo() -> None:
    eps = 0.1
    t = dpo_loss(POLICY_CHOSEN, POLICY_REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.5, label_smoothing=eps)
    expected = [-(1 - eps) * _log_sigmoid(z) - eps * _log_sigmoid(-z) for z in (1.0, -0.5)]
    assert t.loss_N.tolist() == pytest.approx(expected, abs=1e-6)
    assert expected == pytest.approx([0.4132617, 0.9240770], abs=1e-6)


def test_ipo_regresses_h_onto_half_inverse_beta() -> None:
    t = dpo_loss(POLICY_CHOSEN, POLICY_REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.5, loss_type="ipo")
    assert t.loss_N.tolist() == pytest.approx([(2 - 1) ** 2, (-1 - 1) ** 2])  # (h − 1/(2β))², 1/(2β) = 1


def test_gradient_pushes_chosen_up_and_rejected_down() -> None:
    """dL/d log π(y_w) = −β σ(−β h) (1 − ε) + β ε σ(β h); the opposite sign for y_l."""
    chosen, rejected = POLICY_CHOSEN.clone().requires_grad_(), POLICY_REJECTED.clone().requires_grad_()
    dpo_loss(chosen, rejected, REF_CHOSEN, REF_REJECTED, beta=0.5).loss_N.sum().backward()
    sig = torch.sigmoid(-0.5 * torch.tensor([2.0, -1.0]))
    assert chosen.grad is not None and rejected.grad is not None
    assert torch.allclose(chosen.grad, -0.5 * sig) and torch.allclose(rejected.grad, 0.5 * sig)


def test_policy_equal_to_reference_gives_log_two() -> None:
    t = dpo_loss(POLICY_CHOSEN, POLICY_REJECTED, POLICY_CHOSEN, POLICY_REJECTED, beta=0.1)
    assert t.loss_N.tolist() == pytest.approx([math.log(2)] * 2)
    assert float(t.metric_sums()["rewards/accuracy"]) == 0.0  # a tie is not a win


def test_unknown_loss_type_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"algorithm.loss_type='hinge' is invalid; valid: sigmoid, ipo"):
        dpo_loss(POLICY_CHOSEN, POLICY_REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.1, loss_type="hinge")
