"""Masked reductions over response tokens (padding and non-generated tokens excluded).

``mask_BT`` may be bool, int or float; it is cast to the data's dtype. Empty masks give 0, not NaN,
and no function here reads a value back to the host (no device sync).
"""

from __future__ import annotations

import torch


def masked_sum(x_BT: torch.Tensor, mask_BT: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    m_BT = mask_BT.to(x_BT.dtype)
    return (x_BT * m_BT).sum() if dim is None else (x_BT * m_BT).sum(dim)


def masked_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over masked entries (all of them, or along ``dim``); 0 where nothing is masked in."""
    m_BT = mask_BT.to(x_BT.dtype)
    count = m_BT.sum() if dim is None else m_BT.sum(dim)
    return masked_sum(x_BT, m_BT, dim) / count.clamp_min(1)


def masked_whiten(x_BT: torch.Tensor, mask_BT: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` with mean and unbiased variance over the masked entries.

    Matches verl's ``masked_whiten`` (Bessel-corrected variance, mean shifted), except that with
    fewer than two masked entries the variance is taken as 0 instead of raising; the result is then
    0 everywhere. Entries outside the mask are returned as 0.
    """
    m_BT = mask_BT.to(x_BT.dtype)
    n = m_BT.sum()
    mean = masked_sum(x_BT, m_BT) / n.clamp_min(1)
    dev_BT = (x_BT - mean) * m_BT
    var = dev_BT.square().sum() / (n - 1).clamp_min(1)
    return dev_BT * torch.rsqrt(var + eps)
