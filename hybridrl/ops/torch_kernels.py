"""The block kernels in plain PyTorch: the fallback when the C++/Triton ones can't be built, same contract.

``row_stats(logits_NC, target_N, valid, temperature) -> [N, 4]`` (m, S, zy, T) and ``row_grad(..., out)``
as documented in ``csrc/logprob_entropy.cpp``; ``target_N`` is a column of the block or -1. These allocate
a few ``[N, C]`` fp64 temporaries per call (fp64 like the C++ kernel: the same accuracy), so the chunked
LM-head path still bounds memory by the chunk.
"""

from __future__ import annotations

import torch


def _z(logits_NC: torch.Tensor, valid: int, temperature: float) -> torch.Tensor:
    z_NC = logits_NC.double() / temperature  # a new tensor
    z_NC[:, valid:] = float("-inf")
    return z_NC


def row_stats(logits_NC: torch.Tensor, target_N: torch.Tensor, valid: int, temperature: float) -> torch.Tensor:
    z_NC = _z(logits_NC, valid, temperature)
    m_N = z_NC.max(dim=-1).values if z_NC.shape[1] else z_NC.new_full((z_NC.shape[0],), float("-inf"))
    d_NC = (z_NC - m_N[:, None]).nan_to_num(nan=float("-inf"))  # rows with no valid column: -inf - -inf
    e_NC = d_NC.exp()
    S_N = e_NC.sum(-1)
    T_N = (e_NC * d_NC.nan_to_num(neginf=0.0)).sum(-1)
    local = target_N >= 0
    zy_N = z_NC.gather(-1, target_N.clamp(min=0)[:, None]).squeeze(-1) if z_NC.shape[1] else m_N
    zy_N = torch.where(local, zy_N, torch.zeros_like(m_N))
    return torch.stack([m_N, S_N, zy_N, T_N], dim=-1)


def row_grad(logits_NC: torch.Tensor, target_N: torch.Tensor, valid: int, temperature: float, log_z_N: torch.Tensor,
             entropy_N: torch.Tensor, g_lp_N: torch.Tensor, g_ent_N: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    logp_NC = _z(logits_NC, valid, temperature) - log_z_N.double()[:, None]
    p_NC = logp_NC.exp()
    g_lp_N, g_ent_N, entropy_N = g_lp_N.double(), g_ent_N.double(), entropy_N.double()
    g_NC = -p_NC * (g_lp_N[:, None] + g_ent_N[:, None] * (logp_NC.nan_to_num(neginf=0.0) + entropy_N[:, None]))
    rows = ((target_N >= 0) & (target_N < valid)).nonzero().squeeze(-1)
    g_NC[rows, target_N[rows]] += g_lp_N[rows]
    return out.copy_(g_NC / temperature)
