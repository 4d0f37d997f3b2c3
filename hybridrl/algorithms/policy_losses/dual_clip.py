"""Dual-clip PPO: PPO-clip plus a lower bound on the loss of negative-advantage tokens.

    l_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high))      (PPO-clip, see ppo_clip)
    l_t = min(l_t, -A_t * c)                                             where A_t < 0

With A < 0 and a ratio far above 1 (an action the policy now likes much more than when sampled),
PPO-clip's loss -A r grows without bound; dual clip caps it at -A c and zeroes its gradient.
Source: Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement Learning"
(c = 3 there). Config key ``clip_ratio_c`` as verl.

Deviations and choices: as ppo_clip. Extra metric ``clipfrac_lower`` = share of masked tokens where
the dual bound is the active one (verl's ``pg_clipfrac_lower``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridrl.algorithms._validate import require
from hybridrl.algorithms.masked import masked_mean
from hybridrl.algorithms.policy_losses.ppo_clip import PPOClipLoss, clipped_surrogate


class DualClipLoss(PPOClipLoss):
    """Dual-clip PPO policy loss (``algorithm.policy_loss: dual_clip``)."""

    @dataclass(slots=True, kw_only=True)
    class Config(PPOClipLoss.Config):
        clip_ratio_c: float = 3.0
        """Cap on the ratio's effect for negative advantages: loss <= -A * clip_ratio_c."""

        def __post_init__(self) -> None:
            PPOClipLoss.Config.__post_init__(self)
            require(self.clip_ratio_c >= 1.0, "clip_ratio_c", self.clip_ratio_c, "a float >= 1")

    config: Config

    def per_token_loss(
        self, ratio_BT: torch.Tensor, advantages_BT: torch.Tensor, mask_BT: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ppo_BT, clipped_BT = clipped_surrogate(ratio_BT, advantages_BT, self.clip_low, self.clip_high)
        bound_BT = -advantages_BT * self.config.clip_ratio_c
        negative_BT = advantages_BT < 0
        loss_BT = torch.where(negative_BT, torch.minimum(ppo_BT, bound_BT), ppo_BT)
        lower_BT = negative_BT & (ppo_BT > bound_BT)
        return loss_BT, {
            "clipfrac": masked_mean(clipped_BT.float(), mask_BT),
            "clipfrac_lower": masked_mean(lower_BT.float(), mask_BT),
        }
