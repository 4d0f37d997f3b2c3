"""Reducing a per-token loss ``loss_BT`` to the scalar that is back-propagated.

    token-mean           L = sum_{i,t} m_{i,t} l_{i,t} / sum_{i,t} m_{i,t}
    seq-mean-token-mean  L = (1/N) sum_i [ sum_t m_{i,t} l_{i,t} / sum_t m_{i,t} ]
    seq-mean-token-sum   L = (1/N) sum_i   sum_t m_{i,t} l_{i,t}
    seq-mean-token-sum-norm
                         L = (1/N) sum_i   sum_t m_{i,t} l_{i,t} / C

with ``m`` the response mask, ``N`` the number of sequences with at least one response token and
``C`` a constant (``norm_constant``; by default the mask's width T).
Mode names are verl's ``actor.loss_agg_mode``. ``seq-mean-token-mean`` is the original GRPO
objective (Shao et al. 2024) and GSPO's; ``token-mean`` is DAPO's token-level loss (Yu et al. 2025),
which stops long responses from being down-weighted; ``seq-mean-token-sum`` drops the length
normalisation; ``seq-mean-token-sum-norm`` is Dr. GRPO's objective (Liu et al. 2025, "Understanding
R1-Zero-Like Training: A Critical Perspective"): the per-response sum divided by a constant that does
not depend on the response, the maximum response length (the trainer passes
``data.max_response_length``), so every token of every response gets the same weight.

Deviation (``seq-mean-token-sum-norm``): verl divides the batch's token sum by C only
(``loss_scale_factor``, default the padded width T) and leaves the division by the number of
sequences to its gradient-accumulation scaling; here the mean over sequences is part of the mode, as
for the other seq-mean modes, so ``local_normalizer`` / ``global_normalizer`` mean the same for all
three. The default C = T equals the maximum response length only when responses are padded to it;
the trainer does not rely on it (see ``actor_objective``).

Gradient accumulation: a micro-batch's ``token-mean`` divides by *its own* token count, so summing
micro-batch losses does not give the mini-batch loss (micro-batches with few tokens get too much
weight); the same holds for the sequence count ``N`` of the seq-mean modes. To make the sum of
micro-batch losses equal the mini-batch loss, pass ``global_normalizer`` = the sum of
``local_normalizer(mask, mode)`` over all micro-batches of the mini-batch (and over data-parallel
ranks too, if the gradients are summed rather than averaged across them; with DDP's averaging,
multiply the loss by the DP size as well).
"""

from __future__ import annotations

import torch

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def _check_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode={mode!r} is invalid; valid: {', '.join(LOSS_AGG_MODES)}")


def local_normalizer(mask_BT: torch.Tensor, mode: str) -> torch.Tensor:
    """What ``mode`` divides by on this batch: its response-token count for ``token-mean``, its
    number of non-empty sequences for the seq-mean modes (0-dim float tensor)."""
    _check_mode(mode)
    m_BT = mask_BT.float()
    if mode == "token-mean":
        return m_BT.sum()
    return (m_BT.sum(-1) > 0).float().sum()


def aggregate(
    loss_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: str,
    *,
    global_normalizer: float | torch.Tensor | None = None,
    norm_constant: float | None = None,
) -> torch.Tensor:
    """Reduce ``loss_BT`` over the masked tokens as ``mode`` says (see the module docstring).

    ``global_normalizer`` replaces this batch's own denominator (``local_normalizer``): a token
    count for ``token-mean``, a sequence count for the seq-mean modes. Without it, an empty mask
    gives a loss of 0. ``norm_constant`` is ``seq-mean-token-sum-norm``'s C (None: the mask's
    width T); the other modes ignore it.
    """
    _check_mode(mode)
    m_BT = mask_BT.to(loss_BT.dtype)
    masked_BT = loss_BT * m_BT
    if mode == "token-mean":
        total = masked_BT.sum()
    else:
        per_seq_B = masked_BT.sum(-1)
        if mode == "seq-mean-token-mean":
            per_seq_B = per_seq_B / m_BT.sum(-1).clamp_min(1)
        elif mode == "seq-mean-token-sum-norm":
            per_seq_B = per_seq_B / (norm_constant if norm_constant is not None else mask_BT.shape[-1])
        total = per_seq_B.sum()  # empty sequences contribute 0 and are not counted in N
    if global_normalizer is None:
        return total / local_normalizer(mask_BT, mode).to(total.dtype).clamp_min(1)
    return total / global_normalizer
