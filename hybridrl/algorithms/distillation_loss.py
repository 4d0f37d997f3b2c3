"""Supervised distillation on the student's own samples: a loss term the actor backpropagates directly.

The teacher (``actor_rollout_ref.teacher``) scores the sampled responses; per response token t of a sample x:

    forward_kl_topk:  ℓ_t = max(0, Σ_{i ∈ K_t} p_T(i) · (log p_T(i) − log π_θ(i)))
                      K_t: the teacher's k most likely tokens at t (``topk``), log-probs from the full softmax of each
                      model (unnormalised over K_t: hence the max(0, ·), as verl)
    k1/kl, k2/mse, k3/low_var_kl, abs:  ℓ_t = kl_est(log π_θ(x_t), log π_T(x_t)), the single-sample estimators of the
                      reverse KL at the sampled token (:func:`hybridrl.algorithms.kl.kl_penalty`), with gradient

then ``ℓ_t ← clamp(ℓ_t, −c, c)`` with c = ``loss_max_clamp`` (when set; log-probs are first clamped below at
``log_prob_min_clamp`` in the top-k loss, when set), and the actor trains on

    L = [L_pg if use_task_rewards] + distillation_loss_coef · agg(ℓ)     (agg: actor.loss_agg_mode, as every term)

Sources: Agarwal et al. 2024, "On-Policy Distillation of Language Models" (GKD: a divergence to the teacher on the
student's own samples, trained as a supervised loss; the forward KL among its choices); the top-k truncation, the
clamps and the key names are verl's ``distillation.distillation_loss`` (``use_policy_gradient=false``).

Deviations: with ``use_task_rewards=false`` only the policy-gradient term is dropped: the entropy bonus and the KL
loss to the ref stay as ``actor.entropy_coeff`` / ``actor.use_kl_loss`` say (verl drops them too; both are off by
default there). The reverse-KL *advantage* (verl's ``use_policy_gradient=true``) is the ``opd`` / ``grpo_opd``
estimators' (:mod:`hybridrl.algorithms.advantages.opd`), not this module's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridrl.algorithms.kl import KL_KINDS, kl_penalty

TOPK_MODES = ("forward_kl_topk",)
LOSS_MODES = (*TOPK_MODES, *KL_KINDS)


@dataclass(slots=True, kw_only=True)
class DistillationLossConfig:
    """``actor_rollout_ref.teacher.loss``: a supervised distillation term in the actor's loss (verl's
    ``distillation.distillation_loss`` with ``use_policy_gradient=false``); null ``loss_mode``: none (distillation,
    if any, is the advantage estimator's: ``opd``, ``grpo_opd``)."""

    loss_mode: str | None = None  # null | forward_kl_topk | k1 | kl | k2 | mse | k3 | low_var_kl | abs
    topk: int = 32  # the teacher's top-k tokens per position (forward_kl_topk); verl's default
    use_task_rewards: bool = True  # also train the policy loss on algorithm.adv_estimator's advantage
    distillation_loss_coef: float = 1.0  # the weight of the distillation term
    loss_max_clamp: float | None = None  # clamp each token's loss to ±this (null: no clamp)
    log_prob_min_clamp: float | None = None  # forward_kl_topk: clamp both models' top-k log-probs below at this

    @property
    def enabled(self) -> bool:
        return self.loss_mode is not None

    @property
    def uses_topk(self) -> bool:
        return self.loss_mode in TOPK_MODES

    def problems(self) -> list[tuple[str, object, str]]:
        """``(field, value, what is valid)`` for each bad field (the caller names the key)."""
        out: list[tuple[str, object, str]] = []
        if self.loss_mode is not None and self.loss_mode not in LOSS_MODES:
            out.append(("loss_mode", self.loss_mode, f"valid: null (no distillation loss), {', '.join(LOSS_MODES)}"))
        if isinstance(self.topk, bool) or not isinstance(self.topk, int) or self.topk < 1:
            out.append(("topk", self.topk, "an int >= 1: the teacher's most likely tokens kept per position"))
        if not self.distillation_loss_coef > 0:
            out.append(("distillation_loss_coef", self.distillation_loss_coef, "a float > 0"))
        if self.loss_max_clamp is not None and not self.loss_max_clamp > 0:
            out.append(("loss_max_clamp", self.loss_max_clamp, "null (no clamp) or a float > 0"))
        if self.log_prob_min_clamp is not None and not self.log_prob_min_clamp < 0:
            out.append(("log_prob_min_clamp", self.log_prob_min_clamp, "null (no clamp) or a float < 0"))
        return out


def topk_forward_kl_BT(student_topk_BTK: torch.Tensor, teacher_topk_BTK: torch.Tensor, *,
                       log_prob_min_clamp: float | None = None) -> torch.Tensor:
    """``[B, T]`` max(0, Σ_k p_T (log p_T − log π_θ)) over the teacher's top-k tokens (log-probs ``[B, T, K]``)."""
    s_BTK, t_BTK = student_topk_BTK.float(), teacher_topk_BTK.float()
    if log_prob_min_clamp is not None:
        s_BTK, t_BTK = s_BTK.clamp_min(log_prob_min_clamp), t_BTK.clamp_min(log_prob_min_clamp)
    return (t_BTK.exp() * (t_BTK - s_BTK)).sum(dim=-1).clamp_min(0.0)


def distillation_losses_BT(config: DistillationLossConfig, *, logprobs_BT: torch.Tensor,
                           teacher_logprobs_BT: torch.Tensor | None, student_topk_BTK: torch.Tensor | None,
                           teacher_topk_BTK: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(ℓ_BT, per-token diagnostics)``: each response token's distillation loss (module docstring), with gradient
    through the student's log-probs; diagnostics (no gradient): ``student_mass`` / ``teacher_mass``, the probability
    each model puts on the teacher's top-k (top-k mode)."""
    mode = config.loss_mode
    if mode in TOPK_MODES:
        if student_topk_BTK is None or teacher_topk_BTK is None:
            raise ValueError(f"distillation loss_mode={mode}: the batch has no teacher top-k log-probs")
        loss_BT = topk_forward_kl_BT(student_topk_BTK, teacher_topk_BTK,
                                     log_prob_min_clamp=config.log_prob_min_clamp)
        diagnostics = {"student_mass": student_topk_BTK.detach().float().exp().sum(-1),
                       "teacher_mass": teacher_topk_BTK.float().exp().sum(-1)}
    else:
        assert mode is not None
        if teacher_logprobs_BT is None:
            raise ValueError(f"distillation loss_mode={mode}: the batch has no teacher log-probs")
        loss_BT = kl_penalty(logprobs_BT.float(), teacher_logprobs_BT.float(), mode)
        diagnostics = {"abs_loss": loss_BT.detach().abs()}
    if config.loss_max_clamp is not None:
        loss_BT = loss_BT.clamp(-config.loss_max_clamp, config.loss_max_clamp)
    return loss_BT, diagnostics
