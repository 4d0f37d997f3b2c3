"""GAE advantages (PPO with a critic).

    delta_t = r_t + gamma * V_{t+1} - V_t          (V after the last response token is 0)
    A_t     = delta_t + gamma * lam * A_{t+1}
    returns_t = A_t + V_t                          (the critic's regression target)
    advantages = whiten(A) over all masked tokens of the batch

Source: Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
Estimation"; the whitening is the standard PPO-for-LLMs practice (Ouyang et al. 2022; verl, OpenRLHF).

Deviations and choices:
- Tokens outside the response mask are skipped, as in verl: their value and TD error are not used,
  the recursion carries ``V_{t+1}`` and ``A_{t+1}`` over them, and they do not count as a step.
- Whitening uses the unbiased variance over the batch passed in (a data-parallel shard's own
  statistics when computed per shard) and is not optional; returns are computed before whitening.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from hybridrl.algorithms._validate import require
from hybridrl.algorithms.masked import masked_whiten


def gae(
    token_rewards_BT: torch.Tensor, values_BT: torch.Tensor, response_mask_BT: torch.Tensor,
    *, gamma: float, lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Un-whitened GAE advantages and returns, both 0 outside the mask."""
    mask_BT = response_mask_BT.bool()
    adv_BT = torch.zeros_like(token_rewards_BT)
    next_value_B = torch.zeros_like(token_rewards_BT[:, 0])
    next_adv_B = torch.zeros_like(next_value_B)
    for t in reversed(range(token_rewards_BT.shape[1])):
        delta_B = token_rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
        adv_B = delta_B + gamma * lam * next_adv_B
        next_value_B = torch.where(mask_BT[:, t], values_BT[:, t], next_value_B)
        next_adv_B = torch.where(mask_BT[:, t], adv_B, next_adv_B)
        adv_BT[:, t] = next_adv_B
    m_BT = mask_BT.to(adv_BT.dtype)
    return adv_BT * m_BT, (adv_BT + values_BT) * m_BT


class GAEEstimator:
    """Generalized Advantage Estimation (``algorithm.adv_estimator: gae``); needs a critic."""

    @dataclass(slots=True, kw_only=True)
    class Config:
        gamma: float = 1.0
        """Discount per response token."""
        lam: float = 1.0
        """GAE lambda: 1 is the Monte-Carlo return minus V, 0 the one-step TD error."""

        def __post_init__(self) -> None:
            require(0.0 <= self.gamma <= 1.0, "gamma", self.gamma, "a float in [0, 1]")
            require(0.0 <= self.lam <= 1.0, "lam", self.lam, "a float in [0, 1]")

    needs_group: ClassVar[bool] = False
    needs_critic: ClassVar[bool] = True

    def __init__(self, config: GAEEstimator.Config | None = None) -> None:
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
        if values_BT is None:
            raise ValueError("the gae advantage estimator needs values_BT from a critic (critic.enable)")
        adv_BT, returns_BT = gae(
            token_rewards_BT, values_BT, response_mask_BT, gamma=self.config.gamma, lam=self.config.lam
        )
        return masked_whiten(adv_BT, response_mask_BT), returns_BT
