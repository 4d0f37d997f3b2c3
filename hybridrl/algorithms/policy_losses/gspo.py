"""GSPO: PPO-style clipping on a sequence-level importance ratio.

    s_i   = exp( (1/|y_i|) sum_t (logprob_{i,t} - old_logprob_{i,t}) )    geometric mean of token ratios
    l_i,t = max(-A_{i,t} s_{i,t}, -A_{i,t} clip(s_{i,t}, 1 - eps_low, 1 + eps_high))
    s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]        (value s_i; gradient s_i * grad log pi(y_t))

Source: Zheng et al. 2025, "Group Sequence Policy Optimization"; this is the paper's GSPO-token
form, which equals GSPO when the advantage is constant over a response (GRPO/RLOO) and allows
per-token advantages otherwise. Defaults are the paper's clip range (3e-4, 4e-4): the ratio is a
per-sequence average, so it stays far closer to 1 than token ratios.

Deviations and choices:
- The loss is aggregated with the ``loss_agg_mode`` passed in. The paper's objective is
  ``seq-mean-token-mean`` (1/G sum_i of the sequence loss), and verl's GSPO forces that mode; here
  ``token-mean`` etc. give length-weighted variants, so GSPO recipes should set
  ``seq-mean-token-mean``.
- The sequence log-ratio is clamped to [-20, 20] (value only; the gradient path is unaffected).
- ``clipfrac`` is a masked token mean (every token of a clipped sequence counts), as verl.
- verl's actor keys apply as in verl's GSPO: ``clip_ratio`` is the side a null ``clip_ratio_low`` /
  ``clip_ratio_high`` takes, and ``clip_ratio_c`` (the dual clip of verl's vanilla loss) is accepted and unused, so
  a script written for the vanilla loss runs with ``loss_mode=gspo``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from hybridrl.algorithms.loss_agg import aggregate
from hybridrl.algorithms.masked import masked_mean
from hybridrl.algorithms.policy_losses.ppo_clip import LOG_RATIO_CLAMP, clip_range, clipped_surrogate


class GSPOLoss:
    """Group Sequence Policy Optimization loss (``algorithm.policy_loss: gspo``)."""

    trust_region: ClassVar[bool] = True  # clipped: off-policy (async) samples are allowed with it

    @dataclass(slots=True, kw_only=True)
    class Config:
        clip_ratio_low: float | None = 3e-4
        """The sequence ratio is clipped below at 1 - clip_ratio_low; None uses clip_ratio."""
        clip_ratio_high: float | None = 4e-4
        """The sequence ratio is clipped above at 1 + clip_ratio_high; None uses clip_ratio."""
        clip_ratio: float = 0.2
        """verl's actor key: the clip range of a side set to None."""
        clip_ratio_c: float = 3.0
        """verl's actor key, accepted and unused: GSPO has no dual clip (as verl's GSPO)."""

        def __post_init__(self) -> None:
            clip_range(self.clip_ratio, self.clip_ratio_low, self.clip_ratio_high)

    def __init__(self, config: GSPOLoss.Config | None = None) -> None:
        self.config = config if config is not None else self.Config()
        self.clip_low, self.clip_high = clip_range(
            self.config.clip_ratio, self.config.clip_ratio_low, self.config.clip_ratio_high
        )

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
        seq_log_ratio_B = masked_mean(log_ratio_BT.detach(), response_mask_BT, dim=-1)
        seq_log_ratio_B = seq_log_ratio_B.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        log_s_BT = logprobs_BT - logprobs_BT.detach() + seq_log_ratio_B[:, None]
        loss_BT, clipped_BT = clipped_surrogate(
            log_s_BT.exp(), advantages_BT.detach(), self.clip_low, self.clip_high
        )
        loss = aggregate(loss_BT, response_mask_BT, loss_agg_mode, global_normalizer=global_normalizer)
        return loss, {
            "pg_loss": loss.detach(),
            "clipfrac": masked_mean(clipped_BT.float(), response_mask_BT),
            "ppo_kl": masked_mean(-log_ratio_BT.detach(), response_mask_BT),
        }
