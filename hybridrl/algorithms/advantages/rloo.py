"""RLOO advantages: outcome reward minus the mean reward of the *other* samples of the prompt.

    r_i = sum_t token_reward_{i,t}
    A_{i,t} = r_i - (1 / (n - 1)) * sum_{j in G(i), j != i} r_j  =  n / (n - 1) * (r_i - mean_{G(i)} r)

broadcast over the response tokens; n = |G(i)|. Source: Ahmadian et al. 2024, "Back to Basics:
Revisiting REINFORCE Style Optimization for Learning from Human Feedback in LLMs" (after Kool et al.
2019). ``returns = advantages``.

Deviations and choices:
- A group of one sample has no leave-one-out baseline and gets advantage 0 (verl passes the raw
  reward through there).
- No normalisation by std and no whitening, as in the paper.
- Groups are the ones present in the tensors passed in (see ``grpo``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from hybridrl.algorithms.advantages._outcome import group_stats, outcome_scores


class RLOOEstimator:
    """REINFORCE Leave-One-Out advantages (``algorithm.adv_estimator: rloo``)."""

    @dataclass(slots=True, kw_only=True)
    class Config:
        pass

    needs_group: ClassVar[bool] = True
    needs_critic: ClassVar[bool] = False

    def __init__(self, config: RLOOEstimator.Config | None = None) -> None:
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
        others_B = stats.size_B - 1
        baseline_B = (stats.sum_B - scores_B) / others_B.clamp_min(1)
        adv_B = torch.where(others_B > 0, scores_B - baseline_B, torch.zeros_like(scores_B))
        adv_BT = adv_B[:, None] * response_mask_BT.to(adv_B.dtype)
        return adv_BT, adv_BT.clone()
