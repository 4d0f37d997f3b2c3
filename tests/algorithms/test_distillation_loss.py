"""The supervised distillation term (``actor_rollout_ref.teacher.loss``, verl's ``use_policy_gradient=false``): the
top-k forward KL is the exact forward KL when k covers the vocabulary, its gradient is the forward KL's, the
clamps act as verl's, and the actor objective trains it alone or beside the policy loss."""

from __future__ import annotations

import pytest
import torch

from hybridrl.algorithms.actor_objective import ActorObjective
from hybridrl.algorithms.distillation_loss import DistillationLossConfig, distillation_losses_BT, topk_forward_kl_BT
from hybridrl.algorithms.kl import kl_penalty
from hybridrl.algorithms.loss_agg import local_normalizer
from hybridrl.algorithms.policy_losses.ppo_clip import PPOClipLoss
from hybridrl.batch import RolloutBatch, SampleMeta

B, T, V = 3, 5, 11


def logits(seed: int) -> torch.Tensor:
    return torch.randn(B, T, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2


def test_topk_over_the_whole_vocabulary_is_the_forward_kl_and_its_gradient() -> None:
    student, teacher = logits(0).requires_grad_(True), logits(1)
    s_BTV, t_BTV = student.log_softmax(-1), teacher.log_softmax(-1)
    ids_BTK = t_BTV.argsort(-1, descending=True)  # k = V: every token
    loss_BT = topk_forward_kl_BT(s_BTV.gather(-1, ids_BTK), t_BTV.gather(-1, ids_BTK))
    exact_BT = (t_BTV.exp() * (t_BTV - s_BTV)).sum(-1)
    torch.testing.assert_close(loss_BT, exact_BT.float(), rtol=1e-5, atol=1e-6)
    loss_BT.sum().backward()  # ∂ KL(p_T ‖ softmax(z)) / ∂z = softmax(z) − p_T
    torch.testing.assert_close(student.grad, (s_BTV.exp() - t_BTV.exp()).detach(), rtol=1e-5, atol=1e-6)


def test_topk_truncation_clamps_as_verl() -> None:
    t_logits = logits(3)
    s_BTV, t_BTV = torch.cat([(t_logits * 3)[:2], logits(2)[2:]]).log_softmax(-1), t_logits.log_softmax(-1)
    top_BTK = t_BTV.topk(3, -1).indices
    s_BTK, t_BTK = s_BTV.gather(-1, top_BTK), t_BTV.gather(-1, top_BTK)
    raw_BT = (t_BTK.exp() * (t_BTK - s_BTK)).sum(-1)
    # unnormalised over the top-k: a student sharper than the teacher goes below 0 (rows 0-1), hence verl's max(0, ·)
    assert (raw_BT[:2] < 0).any() and (raw_BT > 0).any()
    torch.testing.assert_close(topk_forward_kl_BT(s_BTK, t_BTK), raw_BT.clamp_min(0).float())
    c = -1.5
    clamped_BT = (t_BTK.clamp_min(c).exp() * (t_BTK.clamp_min(c) - s_BTK.clamp_min(c))).sum(-1).clamp_min(0)
    torch.testing.assert_close(topk_forward_kl_BT(s_BTK, t_BTK, log_prob_min_clamp=c), clamped_BT.float())
    cfg = DistillationLossConfig(loss_mode="forward_kl_topk", loss_max_clamp=0.05)
    loss_BT, diag = distillation_losses_BT(cfg, logprobs_BT=s_BTK[..., 0], teacher_logprobs_BT=None,
                                           student_topk_BTK=s_BTK, teacher_topk_BTK=t_BTK)
    assert float(loss_BT.max()) == pytest.approx(0.05) and float(loss_BT.min()) >= 0
    torch.testing.assert_close(diag["teacher_mass"], t_BTK.exp().sum(-1).float())


@pytest.mark.parametrize("mode", ["k1", "k2", "k3", "low_var_kl", "abs"])
def test_estimator_losses_are_the_kl_estimators_at_the_sampled_token(mode: str) -> None:
    g = torch.Generator().manual_seed(4)
    student_BT, teacher_BT = -torch.rand(B, T, generator=g) * 3, -torch.rand(B, T, generator=g) * 3
    cfg = DistillationLossConfig(loss_mode=mode, loss_max_clamp=0.3)
    loss_BT, _ = distillation_losses_BT(cfg, logprobs_BT=student_BT, teacher_logprobs_BT=teacher_BT,
                                        student_topk_BTK=None, teacher_topk_BTK=None)
    torch.testing.assert_close(loss_BT, kl_penalty(student_BT, teacher_BT, mode).clamp(-0.3, 0.3))


def _batch(mask_BT: torch.Tensor, teacher_BT: torch.Tensor) -> RolloutBatch:
    return RolloutBatch(
        prompt_ids=torch.ones(B, 1, dtype=torch.long), prompt_mask=torch.ones(B, 1, dtype=torch.long),
        response_ids=torch.ones(B, T, dtype=torch.long), response_mask=mask_BT.long(),
        rollout_logprobs=torch.zeros(B, T), weight_version=torch.zeros(B, dtype=torch.long),
        group_index=torch.arange(B), meta=[SampleMeta() for _ in range(B)], pad_token_id=0,
        old_logprobs=torch.zeros(B, T), advantages=torch.ones(B, T), teacher_logprobs=teacher_BT)


@pytest.mark.parametrize("task", [True, False])
def test_the_actor_objective_adds_the_weighted_term_or_trains_it_alone(task: bool) -> None:
    mask_BT = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.float32)
    logp_BT = (-torch.rand(B, T, generator=torch.Generator().manual_seed(5))).requires_grad_(True)
    teacher_BT = -torch.rand(B, T, generator=torch.Generator().manual_seed(6))
    mb = _batch(mask_BT, teacher_BT)
    norm = local_normalizer(mask_BT, "token-mean")

    def objective(distillation: DistillationLossConfig | None) -> ActorObjective:
        return ActorObjective(policy_loss=PPOClipLoss(), loss_agg_mode="token-mean", entropy_coeff=0.0,
                              use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="low_var_kl",
                              distillation=distillation)
    pg, _ = objective(None)(logp_BT, torch.zeros(B, T), mb, normalizer=norm)
    cfg = DistillationLossConfig(loss_mode="k3", use_task_rewards=task, distillation_loss_coef=0.5)
    loss, metrics = objective(cfg)(logp_BT, torch.zeros(B, T), mb, normalizer=norm)
    k3 = (kl_penalty(logp_BT, teacher_BT, "k3") * mask_BT).sum() / mask_BT.sum()
    torch.testing.assert_close(loss, (pg if task else 0) + 0.5 * k3)
    torch.testing.assert_close(metrics["distill_loss_sum"], k3.detach())
    (grad,) = torch.autograd.grad(loss, logp_BT)
    assert torch.all(grad[mask_BT == 0] == 0) and torch.any(grad != 0)
