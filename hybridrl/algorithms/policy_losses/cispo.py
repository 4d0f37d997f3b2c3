"""CISPO: policy gradient weighted by a clipped, stopped-gradient importance ratio.

    r_t = exp(logprob_t - old_logprob_t)
    w_t = sg(clip(r_t, 1 - eps_low, 1 + eps_high))
    l_t = -w_t * A_t * logprob_t                   (gradient: -w_t * A_t * grad log pi(y_t))
    L   = aggregate(l, mask, loss_agg_mode)

Source: MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention"
(Clipped IS-weight Policy Optimization). Unlike PPO-clip, which zeroes the gradient of a token whose
ratio left the trust region (often the rare "fork" tokens of long reasoning), CISPO clips only the
weight: every token keeps its gradient, at most (1 + eps_high) times its on-policy size.

Deviations and choices:
- The paper sets no lower bound on the weight (eps_low "large"): the default ``clip_ratio_low=1``
  clips below at 0, i.e. not at all; the paper gives no eps_high, the default 0.28 is verl's
  ``clip_ratio_high``. Keys as ``ppo_clip``: ``clip_ratio`` is the default of both sides; verl's ``clip_ratio_c``
  is accepted and unused, as in verl's CISPO.
- The paper normalises by the batch's token count (``token-mean``); here the ``loss_agg_mode``
  passed in applies.
- The loss *value* is -w A log pi (the paper's objective), not a surrogate that equals 0 on-policy:
  ``pg_loss`` is not comparable with ``ppo_clip``'s; the gradient on-policy equals PPO's.
- The log-ratio is clamped to [-20, 20] before ``exp``, as ``ppo_clip`` (the weight has no gradient).
- Metrics (masked token means): ``clipfrac`` = share of tokens whose weight was clipped (they still
  get a gradient), ``ppo_kl`` = mean(old_logprob - logprob), ``pg_loss`` = the loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from hybridrl.algorithms._validate import require
from hybridrl.algorithms.loss_agg import aggregate
from hybridrl.algorithms.masked import masked_mean
from hybridrl.algorithms.policy_losses.ppo_clip import LOG_RATIO_CLAMP


class CISPOLoss:
    """CISPO policy loss (``algorithm.policy_loss: cispo``)."""

    trust_region: ClassVar[bool] = True  # clipped: off-policy (async) samples are allowed with it

    @dataclass(slots=True, kw_only=True)
    class Config:
        clip_ratio: float = 0.2
        """Clip range of both sides of the weight unless one is set below."""
        clip_ratio_low: float | None = 1.0
        """The weight is clipped below at 1 - clip_ratio_low; 1 (default, the paper's): no lower bound;
        None uses clip_ratio."""
        clip_ratio_high: float | None = 0.28
        """The weight is clipped above at 1 + clip_ratio_high; None uses clip_ratio."""
        clip_ratio_c: float = 3.0
        """verl's actor key, accepted and unused: CISPO has no dual clip (as verl's CISPO)."""

        def __post_init__(self) -> None:
            require(self.clip_ratio >= 0, "clip_ratio", self.clip_ratio, "a float >= 0")
            low, high = self.bounds()
            require(0 <= low <= 1, "clip_ratio_low", low,
                    "a float in [0, 1] (the weight is clipped below at 1 - it; 1: no lower bound)")
            require(high >= 0, "clip_ratio_high", high, "a float >= 0 (the weight is clipped above at 1 + it)")

        def bounds(self) -> tuple[float, float]:
            """(eps_low, eps_high), ``None`` resolved to ``clip_ratio``."""
            low = self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low
            high = self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high
            return low, high

    def __init__(self, config: CISPOLoss.Config | None = None) -> None:
        self.config = config if config is not None else self.Config()
        self.clip_low, self.clip_high = self.config.bounds()

    def __call__(
        self,
        *,
        logprobs_BT: torch.Tensor,
        old_logprobs_BT: torch.Tensor,
        advantages_BT: torch.Tensor,
        response_mask_BT: torch.Tensor,
        loss_agg_mode: str,
        global_normalizer: float | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        log_ratio_BT = (logprobs_BT - old_logprobs_BT).detach()
        ratio_BT = log_ratio_BT.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
        weight_BT = ratio_BT.clamp(1 - self.clip_low, 1 + self.clip_high)
        loss_BT = -weight_BT * advantages_BT.detach() * logprobs_BT
        loss = aggregate(loss_BT, response_mask_BT, loss_agg_mode, global_normalizer=global_normalizer)
        return loss, {
            "pg_loss": loss.detach(),
            "clipfrac": masked_mean((weight_BT != ratio_BT).float(), response_mask_BT),
            "ppo_kl": masked_mean(-log_ratio_BT, response_mask_BT),
        }
