"""GRPO advantages: group-normalised outcome reward, broadcast over the response.

    r_i = sum_t token_reward_{i,t}                      (outcome reward of sample i)
    A_{i,t} = (r_i - mean_{j in G(i)} r_j) / (std_{j in G(i)} r_j + epsilon)   for every response token t

where G(i) is the group of samples drawn for the same prompt. Source: Shao et al. 2024,
"DeepSeekMath" (GRPO, outcome supervision). ``returns = advantages`` (there is no critic).

Deviations and choices:
- ``std`` is the unbiased (Bessel-corrected) standard deviation, as ``torch.std`` and verl
  (``compute_grpo_outcome_advantage``); the paper does not say which. For a group of n the biased
  std is ``sqrt((n-1)/n)`` times this one, so advantages here are slightly smaller in magnitude.
- ``norm_adv_by_std_in_grpo=False`` drops the division by std (Dr. GRPO, Liu et al. 2025,
  "Understanding R1-Zero-Like Training"); Dr. GRPO's other change, no per-response length
  normalisation, is the loss aggregation (``loss_agg_mode``), not this estimator; the estimator
  ``drgrpo`` is this setting under its own name, checked against the aggregation.
- A group of identical rewards has std 0 and gets advantage 0 (numerator is 0).
- A group of one sample gets advantage 0: it has no baseline to compare against. verl instead uses
  mean 0 and std 1 there, i.e. passes the raw reward through.
- The groups are the ones present in the tensors passed in: when advantages are computed on a
  data-parallel shard, all samples of a prompt must be on the same shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from hybridrl.algorithms._validate import require
from hybridrl.algorithms.advantages._outcome import group_stats, outcome_scores


class GRPOEstimator:
    """Group Relative Policy Optimization advantages (``algorithm.adv_estimator: grpo``)."""

    @dataclass(slots=True, kw_only=True)
    class Config:
        norm_adv_by_std_in_grpo: bool = True
        """Divide by the group's reward std (GRPO); False gives Dr. GRPO's mean-only baseline."""
        epsilon: float = 1e-6
        """Added to the group std before dividing."""

        def __post_init__(self) -> None:
            require(self.epsilon >= 0 and math.isfinite(self.epsilon), "epsilon", self.epsilon,
                    "a finite float >= 0")

    needs_group: ClassVar[bool] = True
    needs_critic: ClassVar[bool] = False

    def __init__(self, config: GRPOEstimator.Config | None = None) -> None:
        self.config = config if config is not None else self.Config()

    @torch.no_grad()
    def __call__(
        self,
        *,
        token_rewards_BT: torch.Tensor,
        response_mask_BT: torch.Tensor,
        group_index_B: torch.Tensor,
        values_BT: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scores_B = outcome_scores(token_rewards_BT, response_mask_BT)
        stats = group_stats(scores_B, group_index_B)
        adv_B = scores_B - stats.mean_B
        if self.config.norm_adv_by_std_in_grpo:
            adv_B = adv_B / (stats.std_B + self.config.epsilon)
        adv_B = torch.where(stats.size_B > 1, adv_B, torch.zeros_like(adv_B))
        adv_BT = adv_B[:, None] * response_mask_BT.to(adv_B.dtype)
        return adv_BT, adv_BT.clone()
