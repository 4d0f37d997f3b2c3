"""Rollout correction: importance weights for the gap between the rollout engine and the trainer.

The engine samples y ~ π_rollout (its log-probs are ``batch.rollout_logprobs``); the trainer
recomputes π_old (``batch.old_logprobs``) and runs PPO against it, so the update is off-policy by
ρ = π_old / π_rollout even with identical weights (other kernels, precision, sampling code).

    log ρ_t = log π_old(y_t) − log π_rollout(y_t)                  token level
    log ρ_i = Σ_t m_{i,t} log ρ_{i,t}     (ρ_i = Π_t ρ_{i,t})      sequence level, broadcast over y_i

    TIS  (``rollout_is``):  w = min(ρ, C)                           C = ``rollout_is_threshold``
    MIS  (``rollout_rs``):  keep = 1[lower ≤ ρ ≤ upper]             band ``rollout_rs_threshold[_lower]``
    l'_t = sg[w_t] · keep_t · l_t(π_θ, π_old, A)                   l = the policy-loss plugin's per-token loss

Sources: truncated importance sampling (TIS) is Yao, Liu et al. 2025, "Your Efficient RL Framework
Secretly Brings You Off-Policy RL Training" (Flash-RL blog; token level, C = 2); masked importance
sampling (MIS) and the sequence-level weights are Liu, Li et al. 2025, "When Speed Kills Stability:
Demystifying RL Collapse from the Training-Inference Mismatch" (blog), whose MIS sets the weight of a
sequence with ρ_i > C to 0 instead of truncating it. Key names and the split of "weights" (IS) from
"rejection" (RS) are verl's ``algorithm.rollout_correction`` (decoupled mode: three policies); MIS
is ``rollout_is: sequence`` + ``rollout_rs: sequence`` with ``rollout_rs_threshold`` = C and
``rollout_rs_threshold_lower: 0`` (no lower edge; verl's ``seq_mis`` preset).

Deviations and choices:
- Only verl's decoupled mode, at ``token`` or ``sequence`` level. Not implemented: verl's
  ``geometric`` RS level, ``rollout_token_veto_threshold``, ``rollout_is_batch_normalize`` and the
  bypass / pure-IS modes (which replace π_old by π_rollout).
- How it reaches the loss (``ActorObjective``): w multiplies the advantages (w > 0, so for PPO-clip,
  dual-clip and GSPO-token max(−wA r, −wA clip(r)) = w·max(−A r, −A clip(r)) — exactly the weighted
  per-token loss, and ``clipfrac``/``ppo_kl`` are unchanged); ``keep`` multiplies the response mask of
  the whole objective (policy loss, entropy bonus, KL-to-ref), so ``clipfrac``/``ppo_kl``/entropy are
  means over the kept tokens. A plugin whose loss is not linear in A would not see w exactly.
- The loss normaliser stays the mini-batch's, computed before rejection: a rejected token counts as
  a zero-loss token in ``token-mean`` (the plain masked-IS estimator of Liu et al.); verl instead drops
  it from the denominator. In ``seq-mean-*`` modes a partly rejected sequence is averaged over its
  kept tokens; a wholly rejected one still counts in N.
- Log-ratios (token and sequence) are clamped to [−20, 20] before ``exp`` (verl's safety bound); the
  band test compares unclamped log-ratios with log(lower), log(upper). An empty response has ρ = 1.
- Metrics (token means over the response mask, so the trainer's token-weighted reduction over
  micro-batches and DP ranks is exact): ``rollout_corr/ratio_mean`` (token ratio ρ_t), ``truncated_frac``
  (tokens whose weight hit C), ``masked_frac`` (tokens rejected), ``kl`` = mean_t(−log ρ_t) (k1) and
  ``k3_kl`` = mean_t(ρ_t − 1 − log ρ_t), both estimating KL(π_rollout ‖ π_old) per token — times the
  mean response length it is the sequence-level KL. ``ratio_extremes`` gives the batch's max/min ρ_t,
  which need a max-reduction that the per-micro-batch metrics path does not have.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybridrl.algorithms.masked import masked_mean

LEVELS: tuple[str, ...] = ("token", "sequence")
LOG_RATIO_CLAMP = 20.0
KEY = "algorithm.rollout_correction"


@dataclass(kw_only=True, slots=True)
class RolloutCorrectionConfig:
    """Correction of the rollout-engine / trainer mismatch π_old / π_rollout, as verl's
    ``algorithm.rollout_correction`` (decoupled mode); off while both levels are null. Formulas,
    papers and deviations: the module docstring."""

    rollout_is: str | None = None  # truncated IS weight min(ρ, rollout_is_threshold): a LEVELS entry | null (off)
    rollout_is_threshold: float = 2.0  # C, the truncation of the IS weight (> 0)
    rollout_rs: str | None = None  # masked IS, drop tokens / sequences whose ρ leaves the band: LEVELS | null
    rollout_rs_threshold: float | None = None  # upper edge of the kept band; null: rollout_is_threshold
    rollout_rs_threshold_lower: float | None = None  # lower edge of the kept band (0: none); null: 1 / upper


def config_problems(cfg: RolloutCorrectionConfig) -> list[tuple[str, object, str]]:
    """``(key, value, message)`` for each invalid setting of ``algorithm.rollout_correction``."""
    problems: list[tuple[str, object, str]] = []
    for name, level in (("rollout_is", cfg.rollout_is), ("rollout_rs", cfg.rollout_rs)):
        if level is not None and level not in LEVELS:
            problems.append((f"{KEY}.{name}", level, f"valid: {', '.join(LEVELS)} or null (off)"))
    if not cfg.rollout_is_threshold > 0:
        problems.append((f"{KEY}.rollout_is_threshold", cfg.rollout_is_threshold,
                         "must be > 0 (the IS weight is truncated at it; 2.0 is typical)"))
    upper, lower = cfg.rollout_rs_threshold, cfg.rollout_rs_threshold_lower
    if upper is not None and not upper > 0:
        problems.append((f"{KEY}.rollout_rs_threshold", upper, "must be > 0, or null (= rollout_is_threshold)"))
    if lower is not None and not lower >= 0:
        problems.append((f"{KEY}.rollout_rs_threshold_lower", lower,
                         "must be ≥ 0 (0: no lower edge), or null (= 1 / upper)"))
    if not problems and cfg.rollout_rs is not None:
        lo, hi = rs_band(cfg)
        if not lo < hi:
            problems.append((f"{KEY}.rollout_rs_threshold_lower", lower,
                             f"the kept band [lower, upper] = [{lo:g}, {hi:g}] is empty: lower must be < upper"))
    return problems


def rs_band(cfg: RolloutCorrectionConfig) -> tuple[float, float]:
    """The kept band ``(lower, upper)`` of the rejection step, with verl's defaults resolved."""
    upper = cfg.rollout_rs_threshold if cfg.rollout_rs_threshold is not None else cfg.rollout_is_threshold
    lower = cfg.rollout_rs_threshold_lower if cfg.rollout_rs_threshold_lower is not None else 1.0 / upper
    return lower, upper


def _log_ratio(old_logprobs_BT: torch.Tensor, rollout_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor,
               level: str) -> torch.Tensor:
    """log ρ per token (``token``) or the sequence's Σ_t log ρ_t broadcast over its tokens; 0 off the mask."""
    m_BT = mask_BT.to(old_logprobs_BT.dtype)
    log_ratio_BT = torch.where(m_BT > 0, old_logprobs_BT.detach() - rollout_logprobs_BT.detach(), 0.0)
    if level == "token":
        return log_ratio_BT
    return log_ratio_BT.sum(-1, keepdim=True) * m_BT


@dataclass(slots=True, kw_only=True)
class RolloutCorrection:
    """Weights and rejection mask for one (micro-)batch; build with :meth:`from_config`."""

    is_level: str | None
    is_threshold: float
    rs_level: str | None
    rs_lower: float
    rs_upper: float

    @classmethod
    def from_config(cls, cfg: RolloutCorrectionConfig) -> RolloutCorrection | None:
        """``None`` when both steps are off (the objective then runs exactly as without this module)."""
        if cfg.rollout_is is None and cfg.rollout_rs is None:
            return None
        lower, upper = rs_band(cfg)
        return cls(is_level=cfg.rollout_is, is_threshold=cfg.rollout_is_threshold, rs_level=cfg.rollout_rs,
                   rs_lower=lower, rs_upper=upper)

    def __call__(self, old_logprobs_BT: torch.Tensor, rollout_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """``(weights_BT, keep_BT, metrics)``: detached IS weights (1 where IS is off), the float 0/1 mask of
        kept response tokens (``mask_BT`` where RS is off) and the ``rollout_corr/*`` metrics."""
        m_BT = mask_BT.to(old_logprobs_BT.dtype)
        token_lr_BT = _log_ratio(old_logprobs_BT, rollout_logprobs_BT, m_BT, "token")
        token_ratio_BT = token_lr_BT.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
        weights_BT = torch.ones_like(m_BT)
        truncated_BT = torch.zeros_like(m_BT)
        if self.is_level is not None:
            lr_BT = _log_ratio(old_logprobs_BT, rollout_logprobs_BT, m_BT, self.is_level)
            lr_BT = lr_BT.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
            weights_BT = lr_BT.clamp(max=math.log(self.is_threshold)).exp()  # min(ρ, C) in log space
            truncated_BT = (lr_BT > math.log(self.is_threshold)).to(m_BT.dtype) * m_BT
        keep_BT = m_BT
        if self.rs_level is not None:
            lr_BT = _log_ratio(old_logprobs_BT, rollout_logprobs_BT, m_BT, self.rs_level)
            log_lower = math.log(self.rs_lower) if self.rs_lower > 0 else -math.inf
            inside_BT = (lr_BT >= log_lower) & (lr_BT <= math.log(self.rs_upper))
            keep_BT = m_BT * inside_BT.to(m_BT.dtype)
        metrics = {
            "rollout_corr/ratio_mean": masked_mean(token_ratio_BT, m_BT),
            "rollout_corr/truncated_frac": masked_mean(truncated_BT, m_BT),
            "rollout_corr/masked_frac": masked_mean(m_BT - keep_BT, m_BT),
            "rollout_corr/kl": masked_mean(-token_lr_BT, m_BT),
            "rollout_corr/k3_kl": masked_mean(token_ratio_BT - 1 - token_lr_BT, m_BT),
        }
        return weights_BT, keep_BT, metrics


def ratio_extremes(old_logprobs_BT: torch.Tensor, rollout_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Max and min of the token ratio ρ_t over the response tokens (-inf and inf when there are none)."""
    lr_BT = _log_ratio(old_logprobs_BT, rollout_logprobs_BT, mask_BT, "token")
    ratio_BT = lr_BT.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    off_BT = ~mask_BT.bool()
    return ratio_BT.masked_fill(off_BT, float("-inf")).max(), ratio_BT.masked_fill(off_BT, float("inf")).min()
