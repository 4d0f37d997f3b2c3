"""Per-token estimators of KL(pi || pi_ref) from the sampled token's log-probs.

With ``log_r = logprob - ref_logprob`` (tokens sampled from pi):

    k1  = log_r                        unbiased, high variance, can be negative
    k2  = 0.5 * log_r^2                biased, low variance, >= 0
    k3  = exp(-log_r) + log_r - 1      unbiased, low variance, >= 0  (alias ``low_var_kl``)
    abs = |log_r|

Source: Schulman 2020, "Approximating KL Divergence" (k1, k2, k3); names and aliases as verl's
``kl_penalty`` (``kl`` = k1, ``mse`` = k2, ``low_var_kl`` = k3).

Deviations, as in verl: k3 clamps ``-log_r`` to [-20, 20] before ``exp`` and clamps the result
to [-10, 10], which caps the penalty (and zeroes its gradient) on tokens whose log-ratio is far off.
verl's straight-through variants (``k3+``) are not implemented.
"""

from __future__ import annotations

import torch

KL_KINDS: tuple[str, ...] = ("k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs")


def kl_penalty(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of ``kind`` (one of ``KL_KINDS``); same shape as the inputs."""
    log_ratio_BT = logprobs_BT - ref_logprobs_BT
    if kind in ("k1", "kl"):
        return log_ratio_BT
    if kind in ("k2", "mse"):
        return 0.5 * log_ratio_BT.square()
    if kind in ("k3", "low_var_kl"):
        neg_log_ratio_BT = (-log_ratio_BT).clamp(-20.0, 20.0)
        return (neg_log_ratio_BT.exp() - neg_log_ratio_BT - 1).clamp(-10.0, 10.0)
    if kind == "abs":
        return log_ratio_BT.abs()
    raise ValueError(f"KL estimator kind={kind!r} is invalid; valid: {', '.join(KL_KINDS)}")
