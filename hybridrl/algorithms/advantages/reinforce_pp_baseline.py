"""REINFORCE++-baseline advantages: group-mean baseline, then whitening over the whole batch.

    r_i = sum_t token_reward_{i,t}                           (outcome reward of sample i)
    a_i = r_i - mean_{j in G(i)} r_j                         (group-mean baseline, no std division)
    A_{i,t} = (a_i - mean(a)) / sqrt(var(a) + 1e-8)          mean/var over all response tokens of the
                                                             batch (a_i broadcast over i's tokens)

Source: Hu et al. 2025, "REINFORCE++: ..." (v2 of the paper, "REINFORCE++-baseline"): the group mean
removes the prompt's difficulty, the global normalisation (instead of GRPO's per-group std) keeps the
advantage scale stable; as verl's ``reinforce_plus_plus_baseline``. ``returns = advantages``.

Deviations and choices:
- A group of one sample has no baseline: its advantage is 0 and its tokens do not enter the
  batch statistics (verl takes mean 0 there, so the raw reward enters the whitening). This matches
  ``grpo`` and ``rloo`` here.
- The batch statistics are token-level (each sample weighted by its response length) with unbiased
  variance, as verl's ``masked_whiten``; with fewer than two such tokens the advantages are 0.
- "Batch" is the tensors passed in: on a data-parallel shard, the shard (see ``reinforce_pp``).
- Outcome reward only (no discounting): the per-token KL penalty, if configured, enters through
  the summed token rewards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from hybridrl.algorithms.advantages._outcome import group_stats, outcome_scores
from hybridrl.algorithms.masked import masked_whiten


class ReinforcePlusPlusBaselineEstimator:
    """REINFORCE++-baseline advantages (``algorithm.adv_estimator: reinforce_pp_baseline``)."""

    @dataclass(slots=True, kw_only=True)
    class Config:
        pass

    needs_group: ClassVar[bool] = True
    needs_critic: ClassVar[bool] = False

    def __init__(self, config: ReinforcePlusPlusBaselineEstimator.Config | None = None) -> None:
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
        baselined_B = scores_B - stats.mean_B
        mask_BT = response_mask_BT.to(scores_B.dtype) * (stats.size_B > 1).to(scores_B.dtype)[:, None]
        adv_BT = masked_whiten(baselined_B[:, None].expand_as(mask_BT), mask_BT)
        return adv_BT, adv_BT.clone()
