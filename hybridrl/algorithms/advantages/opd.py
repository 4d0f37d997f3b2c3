"""On-policy distillation: the teacher's per-token log-probs as the advantage (reverse KL to the teacher).

The student π_θ samples x ~ π_θ(·|prompt); a frozen teacher π_T scores every sampled token. The objective is the
per-token reverse KL  KL(π_θ ‖ π_T) = E_{x~π_θ}[ Σ_t log π_θ(x_t|x_<t) − log π_T(x_t|x_<t) ], whose policy gradient
treats the negated per-token log-ratio as a (discount-0) reward:

    d_{i,t} = log π_old(x_{i,t}) − log π_T(x_{i,t})           (per-token reverse KL estimate, sampled token)
    A^opd_{i,t}      = −λ · d_{i,t}                              (``opd``)
    A^grpo_opd_{i,t} = A^grpo_{i,t} − λ · d_{i,t}                (``grpo_opd``: the task reward's GRPO advantage too)

with λ = ``distill_coef``. Sources: Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes" (GKD; reverse KL on student samples); Thinking Machines, "On-Policy Distillation" (2025:
the per-token −(log π_θ − log π_T) as the advantage, discount 0, trained with the usual clipped RL loss); the mix
with a task reward as in slime's OPD (A_t − λ·KL_t on top of any estimator).

Deviations and choices:
- log π_old is the actor's own log-prob of the token under the weights that sampled it (the old-log-prob pass,
  which the loop always runs for these estimators), not the engine's: both sides of d come from the same Megatron
  forward, so an engine/trainer numerics gap does not enter the advantage.
- The single-sample estimate of the KL at the sampled token only (no sum over the vocabulary, as GKD's full
  token-level KL would need the teacher's whole distribution); no discounting over later tokens (γ = 0), as
  Thinking Machines. No clamp on d: the clipped policy loss bounds each update.
- ``returns = advantages`` (there is no critic). Tokens outside the response mask get 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from hybridrl.algorithms._validate import require
from hybridrl.algorithms.advantages.grpo import GRPOEstimator


def reverse_kl_BT(logprobs_BT: torch.Tensor, teacher_logprobs_BT: torch.Tensor,
                  response_mask_BT: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` d = log π_old − log π_T per sampled token, 0 outside ``response_mask_BT``."""
    mask_BT = response_mask_BT.to(logprobs_BT.dtype)
    return (logprobs_BT.float() - teacher_logprobs_BT.float()) * mask_BT


def _check_coef(coef: float) -> None:
    require(math.isfinite(coef) and coef > 0, "distill_coef", coef, "a finite float > 0 (the weight λ of the "
            "reverse-KL advantage)")


class OPDEstimator:
    """``algorithm.adv_estimator: opd``: the advantage is the negated per-token reverse KL to the teacher alone
    (the task reward is logged, not trained on)."""

    @dataclass(slots=True, kw_only=True)
    class Config:
        distill_coef: float = 1.0
        """λ: the weight of −(log π_old − log π_teacher) per token."""

        def __post_init__(self) -> None:
            _check_coef(self.distill_coef)

    needs_group: ClassVar[bool] = False
    needs_critic: ClassVar[bool] = False
    needs_teacher: ClassVar[bool] = True  # called with logprobs_BT and teacher_logprobs_BT too

    def __init__(self, config: OPDEstimator.Config | None = None) -> None:
        self.config = config if config is not None else self.Config()

    @torch.no_grad()
    def __call__(self, *, token_rewards_BT: torch.Tensor, response_mask_BT: torch.Tensor,
                 group_index_B: torch.Tensor, values_BT: torch.Tensor | None = None,
                 logprobs_BT: torch.Tensor, teacher_logprobs_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        adv_BT = -self.config.distill_coef * reverse_kl_BT(logprobs_BT, teacher_logprobs_BT, response_mask_BT)
        return adv_BT, adv_BT.clone()


class GRPOOPDEstimator:
    """``algorithm.adv_estimator: grpo_opd``: GRPO's group-normalised task advantage minus λ · the per-token reverse
    KL to the teacher."""

    @dataclass(slots=True, kw_only=True)
    class Config(GRPOEstimator.Config):
        distill_coef: float = 1.0
        """λ: the weight of −(log π_old − log π_teacher) per token, added to the GRPO advantage."""

        def __post_init__(self) -> None:
            GRPOEstimator.Config.__post_init__(self)
            _check_coef(self.distill_coef)

    needs_group: ClassVar[bool] = True
    needs_critic: ClassVar[bool] = False
    needs_teacher: ClassVar[bool] = True

    def __init__(self, config: GRPOOPDEstimator.Config | None = None) -> None:
        self.config = config if config is not None else self.Config()
        c = self.config
        self.grpo = GRPOEstimator(GRPOEstimator.Config(norm_adv_by_std_in_grpo=c.norm_adv_by_std_in_grpo,
                                                       epsilon=c.epsilon))

    @torch.no_grad()
    def __call__(self, *, token_rewards_BT: torch.Tensor, response_mask_BT: torch.Tensor,
                 group_index_B: torch.Tensor, values_BT: torch.Tensor | None = None,
                 logprobs_BT: torch.Tensor, teacher_logprobs_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        task_BT, _ = self.grpo(token_rewards_BT=token_rewards_BT, response_mask_BT=response_mask_BT,
                               group_index_B=group_index_B)
        adv_BT = task_BT - self.config.distill_coef * reverse_kl_BT(logprobs_BT, teacher_logprobs_BT,
                                                                    response_mask_BT)
        return adv_BT, adv_BT.clone()
