"""SAPO: PPO's hard clip replaced by a smooth gate on the importance ratio, with a temperature per advantage sign.

    r_t  = exp(logprob_t - old_logprob_t)
    τ_t  = τ_pos if A_t > 0 else τ_neg
    f(r) = (4 / τ) · σ(τ · (r − 1))
    l_t  = −f(r_t) · A_t
    L    = aggregate(l, mask, loss_agg_mode)

Source: Gao et al. 2025 (Qwen), "Soft Adaptive Policy Optimization", arXiv:2511.20347, the token-level gate of its
objective. The gate's slope is f'(r) = 4 · σ(x)(1 − σ(x)) with x = τ(r − 1): 1 on-policy (r = 1), so the
on-policy gradient is the plain policy gradient A ∇log π, and it decays smoothly as the ratio leaves 1 — a soft
trust region in place of the zero gradient PPO gives a token past 1 ± ε. A larger τ narrows it; the paper (and
verl) take τ_neg > τ_pos because tokens of negative advantage are the ones whose off-policy updates destabilise.

Deviations and choices:
- Defaults are verl's ``actor.tau_pos`` = 1.0 and ``actor.tau_neg`` = 1.05 (verl's names, mapped here).
- The loss is aggregated with the ``loss_agg_mode`` passed in; the paper averages each sequence's tokens, then the
  sequences (``seq-mean-token-mean``).
- The log-ratio is clamped to [−20, 20] before ``exp`` (as ``ppo_clip``).
- ``clipfrac`` has no hard clip to count: it is the share of tokens whose gate slope fell below 1/2 (the gate has
  more than halved their on-policy gradient; 0 on-policy). ``ppo_kl`` = mean(old_logprob − logprob).
- verl's clip keys (``clip_ratio``, ``_low``, ``_high``, ``_c``) are accepted and unused, so a script written for
  the vanilla loss runs with ``loss_mode=sapo``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from hybridrl.algorithms._validate import require
from hybridrl.algorithms.loss_agg import aggregate
from hybridrl.algorithms.masked import masked_mean
from hybridrl.algorithms.policy_losses.ppo_clip import LOG_RATIO_CLAMP


class SAPOLoss:
    """Soft Adaptive Policy Optimization loss (``algorithm.policy_loss: sapo``)."""

    trust_region: ClassVar[bool] = True  # a soft trust region: off-policy (async) samples are allowed with it

    @dataclass(slots=True, kw_only=True)
    class Config:
        tau_pos: float = 1.0
        """Gate temperature of tokens with a positive advantage (verl's ``actor.tau_pos``)."""
        tau_neg: float = 1.05
        """Gate temperature of tokens with a zero or negative advantage (verl's ``actor.tau_neg``)."""
        clip_ratio: float = 0.2
        """verl's actor key, accepted and unused (SAPO has no hard clip)."""
        clip_ratio_low: float | None = None
        """As clip_ratio."""
        clip_ratio_high: float | None = None
        """As clip_ratio."""
        clip_ratio_c: float = 3.0
        """As clip_ratio."""

        def __post_init__(self) -> None:
            require(self.tau_pos > 0, "tau_pos", self.tau_pos, "a float > 0 (the gate's temperature for A > 0)")
            require(self.tau_neg > 0, "tau_neg", self.tau_neg, "a float > 0 (the gate's temperature for A ≤ 0)")

    def __init__(self, config: SAPOLoss.Config | None = None) -> None:
        self.config = config if config is not None else self.Config()

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
        adv_BT = advantages_BT.detach()
        log_ratio_BT = (logprobs_BT - old_logprobs_BT.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        tau_BT = torch.where(adv_BT > 0, self.config.tau_pos, self.config.tau_neg).to(logprobs_BT.dtype)
        gate_BT = torch.sigmoid(tau_BT * (log_ratio_BT.exp() - 1))
        loss_BT = -(4 / tau_BT) * gate_BT * adv_BT
        loss = aggregate(loss_BT, response_mask_BT, loss_agg_mode, global_normalizer=global_normalizer)
        slope_BT = 4 * gate_BT.detach() * (1 - gate_BT.detach())
        return loss, {
            "pg_loss": loss.detach(),
            "clipfrac": masked_mean((slope_BT < 0.5).float(), response_mask_BT),
            "ppo_kl": masked_mean(-log_ratio_BT.detach(), response_mask_BT),
        }
