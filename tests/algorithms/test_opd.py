"""On-policy distillation estimators (``opd``, ``grpo_opd``) on a case worked by hand."""

from __future__ import annotations

import math

import pytest
import torch

from hybridrl.registry import PluginConfigError, Registry

KEY = "algorithm.adv_estimator_kwargs"
# 2 prompts × 2 samples; sample 1 has 2 response tokens, the others 3
MASK_BT = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]], dtype=torch.float32)
STUDENT_BT = torch.log(torch.tensor([[0.5, 0.25, 0.5], [0.5, 0.5, 0.9], [0.1, 0.2, 0.4], [1.0, 0.5, 0.5]]))
TEACHER_BT = torch.log(torch.tensor([[0.25, 0.25, 1.0], [0.5, 0.125, 0.1], [0.2, 0.2, 0.2], [0.5, 0.5, 0.25]]))
REWARDS_BT = torch.tensor([[0, 0, 1.0], [0, 0, 0], [0, 0, 0], [0, 0, 1.0]])


def _run(name: str, **kwargs: float) -> torch.Tensor:
    est = Registry("advantage_estimators").build(name, kwargs, key=KEY)
    adv_BT, ret_BT = est(token_rewards_BT=REWARDS_BT, response_mask_BT=MASK_BT,
                         group_index_B=torch.tensor([7, 7, 3, 3]), logprobs_BT=STUDENT_BT,
                         teacher_logprobs_BT=TEACHER_BT)
    assert torch.equal(adv_BT, ret_BT)
    return adv_BT


def test_opd_advantage_is_the_teachers_log_ratio_per_token() -> None:
    """A_t = −λ (log π_old − log π_T): log(teacher/student) per sampled token, 0 past the response."""
    ln2 = math.log(2)
    by_hand = torch.tensor([[-ln2, 0.0, ln2], [0.0, -2 * ln2, 0.0], [ln2, 0.0, -ln2], [-ln2, 0.0, -ln2]])
    torch.testing.assert_close(_run("opd"), by_hand, rtol=0, atol=1e-6)
    torch.testing.assert_close(_run("opd", distill_coef=0.5), 0.5 * by_hand, rtol=0, atol=1e-6)


def test_grpo_opd_adds_the_group_normalised_task_advantage() -> None:
    """Rewards 1, 0 in each group: GRPO gives ±0.5 / (std + ε), std = √0.5 (Bessel), on every response token."""
    ln2 = math.log(2)
    distill = torch.tensor([[-ln2, 0.0, ln2], [0.0, -2 * ln2, 0.0], [ln2, 0.0, -ln2], [-ln2, 0.0, -ln2]])
    task = torch.tensor([[1.0, 1, 1], [-1, -1, 0], [-1, -1, -1], [1, 1, 1]]) * 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(_run("grpo_opd", distill_coef=0.1), task + 0.1 * distill, rtol=0, atol=1e-5)


def test_both_declare_they_need_a_teacher_and_only_grpo_opd_a_group() -> None:
    reg = Registry("advantage_estimators")
    assert reg.load("opd").needs_teacher and reg.load("grpo_opd").needs_teacher
    assert not reg.load("opd").needs_group and reg.load("grpo_opd").needs_group
    assert not getattr(reg.load("grpo"), "needs_teacher", False)


@pytest.mark.parametrize("coef", [0.0, -1.0, float("nan")])
def test_distill_coef_must_be_positive(coef: float) -> None:
    with pytest.raises(PluginConfigError, match="distill_coef"):
        Registry("advantage_estimators").make_config("opd", {"distill_coef": coef}, key=KEY)
