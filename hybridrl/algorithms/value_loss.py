"""The critic's clipped value loss (PPO).

    V_clip = clip(V, V_old − ε, V_old + ε)
    L      = ½ · max((V − R)², (V_clip − R)²)          per response token, then aggregated (loss_agg_mode)

with V the critic's values now, V_old its values when the batch was scored (``batch.values``), R the
returns of the advantage estimator (``batch.returns``: GAE's A + V_old) and ε ``critic.cliprange_value``.

Source: Schulman et al. 2017, "Proximal Policy Optimization Algorithms" (the clipped value term of
OpenAI baselines' ppo2); verl's ``compute_value_loss`` with ``critic.cliprange_value``.

Deviations and choices: none in the formula. ``vf_clipfrac`` is verl's: the share of response tokens
whose clipped term is strictly the larger. The loss is aggregated over the whole mini-batch through the
``global_normalizer`` of :mod:`hybridrl.algorithms.loss_agg` (as the actor's), so micro-batch losses add
up to the mini-batch loss; metrics ending in ``_sum`` are such partial sums.
"""

from __future__ import annotations

import torch

from hybridrl.algorithms.loss_agg import aggregate


def clipped_value_loss(values_BT: torch.Tensor, old_values_BT: torch.Tensor, returns_BT: torch.Tensor,
                       mask_BT: torch.Tensor, *, cliprange: float, loss_agg_mode: str = "token-mean",
                       global_normalizer: float | torch.Tensor | None = None,
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The aggregated loss and its metrics: ``vf_loss_sum`` (this part's share of the mini-batch loss),
    ``vf_clipfrac`` and ``vpred_mean`` (token means over ``mask_BT``)."""
    clipped_BT = old_values_BT + (values_BT - old_values_BT).clamp(-cliprange, cliprange)
    unclipped_sq_BT = (values_BT - returns_BT).square()
    clipped_sq_BT = (clipped_BT - returns_BT).square()
    loss = 0.5 * aggregate(torch.maximum(unclipped_sq_BT, clipped_sq_BT), mask_BT, loss_agg_mode,
                           global_normalizer=global_normalizer)
    m_BT = mask_BT.to(values_BT.dtype)
    tokens = m_BT.sum().clamp_min(1)
    metrics = {"vf_loss_sum": loss.detach(),
               "vf_clipfrac": ((clipped_sq_BT > unclipped_sq_BT).to(m_BT.dtype) * m_BT).sum().detach() / tokens,
               "vpred_mean": (values_BT.detach() * m_BT).sum() / tokens}
    return loss, metrics
