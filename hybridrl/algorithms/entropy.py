"""Token entropy and target log-probs from logits, in pure torch (one device, full vocabulary).

    logprob(y_t) = z_{t, y_t} - logsumexp_v z_{t, v}
    H_t = -sum_v p_{t,v} log p_{t,v},   p = softmax(z)

Both are computed in float32 when the logits are in a lower precision (bf16/fp16), so they match
what a fused kernel returns; this materialises one float32 copy of the logits. Logits of ``-inf``
(e.g. masked-out vocabulary) are allowed and contribute 0 to the entropy. A vocabulary-parallel
variant (TP > 1, vocabulary sharded) lives with the Megatron code, not here.
"""

from __future__ import annotations

import torch


def _float32(logits_BTV: torch.Tensor) -> torch.Tensor:
    return logits_BTV.float() if logits_BTV.dtype in (torch.bfloat16, torch.float16) else logits_BTV


def logprobs_from_logits(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """Log-probability of ``targets_BT`` under ``softmax(logits_BTV)`` (any leading dims)."""
    z_BTV = _float32(logits_BTV)
    target_logit_BT = z_BTV.gather(-1, targets_BT.unsqueeze(-1)).squeeze(-1)
    return target_logit_BT - torch.logsumexp(z_BTV, dim=-1)


def entropy_from_logits(logits_BTV: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits_BTV)`` over the last dim (differentiable)."""
    logp_BTV = torch.log_softmax(_float32(logits_BTV), dim=-1)
    p_BTV = logp_BTV.exp()
    # 0 * log 0 = 0; filling before the product also keeps NaN out of the backward pass
    return -(p_BTV * logp_BTV.masked_fill(p_BTV == 0, 0.0)).sum(-1)
