"""REINFORCE++ advantages: discounted return-to-go, whitened over the whole batch.

    G_{i,t} = sum_{s >= t} gamma^(s - t) * token_reward_{i,s}       (over response tokens only)
    A_{i,t} = (G_{i,t} - mean(G)) / sqrt(var(G) + 1e-8)            mean/var over all masked tokens
                                                                    of the batch ("global" whitening)

Source: Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models".
``returns`` are the un-whitened G.

Deviations and choices:
- The paper folds a per-token KL penalty into the reward; here it is whatever the loop put in
  ``token_rewards_BT`` (the loop adds the KL-in-reward term, if configured, before this estimator).
- Tokens outside the response mask (right padding, or tool/observation tokens inside a multi-turn
  response) are skipped: they neither receive a return nor count as a discount step. verl instead
  resets the running return to 0 at a masked token, which cuts later turns' rewards off from earlier
  turns; for right-padded single-turn responses the two agree.
- "Global" means over the batch passed in; on a data-parallel shard the statistics are the shard's.
- Variance is unbiased (Bessel-corrected), as verl's ``masked_whiten``; with fewer than two response
  tokens in the batch the advantages are 0.
- The REINFORCE++-baseline variant (group-mean subtraction first) is ``reinforce_pp_baseline``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from hybridrl.algorithms._validate import require
from hybridrl.algorithms.masked import masked_whiten


def discounted_returns(
    token_rewards_BT: torch.Tensor, response_mask_BT: torch.Tensor, gamma: float
) -> torch.Tensor:
    """Return-to-go over response tokens, skipping masked-out tokens; 0 outside the mask."""
    mask_BT = response_mask_BT.bool()
    returns_BT = torch.zeros_like(token_rewards_BT)
    running_B = torch.zeros_like(token_rewards_BT[:, 0])
    for t in reversed(range(token_rewards_BT.shape[1])):
        running_B = torch.where(mask_BT[:, t], token_rewards_BT[:, t] + gamma * running_B, running_B)
        returns_BT[:, t] = running_B
    return returns_BT * mask_BT.to(returns_BT.dtype)


class ReinforcePlusPlusEstimator:
    """REINFORCE++ advantages (``algorithm.adv_estimator: reinforce_pp``)."""

    @dataclass(slots=True, kw_only=True)
    class Config:
        gamma: float = 1.0
        """Discount per response token."""

        def __post_init__(self) -> None:
            require(0.0 <= self.gamma <= 1.0, "gamma", self.gamma, "a float in [0, 1]")

    needs_group: ClassVar[bool] = False
    needs_critic: ClassVar[bool] = False

    def __init__(self, config: ReinforcePlusPlusEstimator.Config | None = None) -> None:
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
        returns_BT = discounted_returns(token_rewards_BT, response_mask_BT, self.config.gamma)
        return masked_whiten(returns_BT, response_mask_BT), returns_BT
