"""PPO clipped surrogate with an asymmetric clip range ("clip-higher").

    r_t = exp(logprob_t - old_logprob_t)
    l_t = max(-A_t * r_t, -A_t * clip(r_t, 1 - eps_low, 1 + eps_high))
    L   = aggregate(l, mask, loss_agg_mode)

Source: Schulman et al. 2017, "Proximal Policy Optimization Algorithms" (symmetric eps); the
separate upper bound is DAPO's clip-higher (Yu et al. 2025), which leaves more room to raise the
probability of unlikely tokens. Config keys as verl's actor: ``clip_ratio`` is the default of
both bounds, ``clip_ratio_low`` / ``clip_ratio_high`` override one side.

Deviations and choices:
- The log-ratio is clamped to [-20, 20] before ``exp`` (as verl), so one far-off token cannot
  overflow the ratio; a clamped token gets no gradient through the ratio.
- ``old_logprobs_BT`` and ``advantages_BT`` are detached: gradients flow only into ``logprobs_BT``.
- Metrics (masked token means): ``clipfrac`` = share of tokens whose clipped term is the active one
  (gradient 0), ``ppo_kl`` = mean(old_logprob - logprob), ``pg_loss`` = the loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from hybridrl.algorithms._validate import require
from hybridrl.algorithms.loss_agg import aggregate
from hybridrl.algorithms.masked import masked_mean

LOG_RATIO_CLAMP = 20.0


def clip_range(clip_ratio: float, low: float | None, high: float | None) -> tuple[float, float]:
    """Resolve (and check) the two sides of the clip range; ``None`` means "use clip_ratio"."""
    require(clip_ratio >= 0, "clip_ratio", clip_ratio, "a float >= 0")
    if low is None:
        require(clip_ratio < 1, "clip_ratio", clip_ratio,
                "a float in [0, 1) when it also sets clip_ratio_low (clip_ratio_low unset)")
        low = clip_ratio
    require(0 <= low < 1, "clip_ratio_low", low, "a float in [0, 1) (the ratio is clipped below at 1 - it)")
    high = clip_ratio if high is None else high
    require(high >= 0, "clip_ratio_high", high, "a float >= 0 (the ratio is clipped above at 1 + it)")
    return low, high


def clipped_surrogate(
    ratio_BT: torch.Tensor, advantages_BT: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO loss and a bool map of where the clipped term is the active one."""
    unclipped_BT = -advantages_BT * ratio_BT
    clipped_BT = -advantages_BT * ratio_BT.clamp(1 - low, 1 + high)
    return torch.maximum(unclipped_BT, clipped_BT), clipped_BT > unclipped_BT


class PPOClipLoss:
    """PPO-clip policy loss (``algorithm.policy_loss: ppo_clip``)."""

    trust_region: ClassVar[bool] = True  # clipped: off-policy (async) samples are allowed with it

    @dataclass(slots=True, kw_only=True)
    class Config:
        clip_ratio: float = 0.2
        """Clip range eps of both sides unless one is set below."""
        clip_ratio_low: float | None = None
        """Lower side: the ratio is clipped at 1 - clip_ratio_low; None uses clip_ratio."""
        clip_ratio_high: float | None = None
        """Upper side: the ratio is clipped at 1 + clip_ratio_high; None uses clip_ratio
        (DAPO's clip-higher uses 0.28 with clip_ratio_low 0.2)."""

        def __post_init__(self) -> None:
            clip_range(self.clip_ratio, self.clip_ratio_low, self.clip_ratio_high)

    def __init__(self, config: PPOClipLoss.Config | None = None) -> None:
        self.config = config if config is not None else self.Config()
        self.clip_low, self.clip_high = clip_range(
            self.config.clip_ratio, self.config.clip_ratio_low, self.config.clip_ratio_high
        )

    def per_token_loss(
        self, ratio_BT: torch.Tensor, advantages_BT: torch.Tensor, mask_BT: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The per-token loss and its extra metrics; subclasses change the objective here."""
        loss_BT, clipped_BT = clipped_surrogate(ratio_BT, advantages_BT, self.clip_low, self.clip_high)
        return loss_BT, {"clipfrac": masked_mean(clipped_BT.float(), mask_BT)}

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
        log_ratio_BT = logprobs_BT - old_logprobs_BT.detach()
        ratio_BT = log_ratio_BT.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
        loss_BT, metrics = self.per_token_loss(ratio_BT, advantages_BT.detach(), response_mask_BT)
        loss = aggregate(loss_BT, response_mask_BT, loss_agg_mode, global_normalizer=global_normalizer)
        metrics = {k: v.detach() for k, v in metrics.items()}
        metrics["pg_loss"] = loss.detach()
        metrics["ppo_kl"] = masked_mean(-log_ratio_BT.detach(), response_mask_BT)
        return loss, metrics
