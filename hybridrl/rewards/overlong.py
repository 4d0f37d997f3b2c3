"""Soft overlong punishment (DAPO, Yu et al. 2025, §3.4): a length penalty added to the reward's score.

With ``L_max = data.max_response_length`` and ``L_cache = reward.overlong_buffer.len``::

    penalty(|y|) = 0                                   if |y| ≤ L_max − L_cache
                 = (L_max − L_cache − |y|) / L_cache   if L_max − L_cache < |y| ≤ L_max
                 = −1                                  if |y| > L_max

times ``reward.overlong_buffer.penalty_factor`` (the paper: 1), added to each sample's score before the
advantages (so a truncated response scores its reward − factor).

Choices: ``|y|`` counts the generated tokens, EOS included (verl: ``valid_response_length``). The engine never
generates more than ``L_max`` tokens, so the last branch is only a clamp. verl puts the keys under
``reward_model.overlong_buffer``; here they are ``reward.overlong_buffer``. The penalty applies to the
training scores only (``trainer.score``), not to evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KEY = "reward.overlong_buffer"


@dataclass(kw_only=True, slots=True)
class OverlongBufferConfig:
    """DAPO's soft overlong punishment (verl's ``reward_model.overlong_buffer``): a response longer than
    data.max_response_length − len loses up to penalty_factor of its score, linearly over the last len
    tokens (the module docstring)."""

    enable: bool = False
    len: int = 0  # L_cache: tokens before data.max_response_length where the penalty ramps from 0 to −1
    penalty_factor: float = 1.0  # the penalty at data.max_response_length (the paper: 1)


def overlong_penalty(lengths_B: torch.Tensor, *, max_length: int, buffer: int, factor: float) -> torch.Tensor:
    """The penalty of responses of ``lengths_B`` tokens, ``[B]`` float32, in ``[−factor, 0]``."""
    over_B = (lengths_B.float() - (max_length - buffer)).clamp(min=0)
    return -(over_B / buffer).clamp(max=1.0) * factor


def overlong_penalty_B(o: OverlongBufferConfig, response_mask_BT: torch.Tensor, *, max_length: int) -> torch.Tensor:
    """``[B]``: each sample's penalty as ``reward.overlong_buffer`` says (zeros when it is off); ``max_length`` is
    ``data.max_response_length``."""
    if not o.enable:
        return torch.zeros(response_mask_BT.shape[0], dtype=torch.float32, device=response_mask_BT.device)
    return overlong_penalty(response_mask_BT.sum(-1), max_length=max_length, buffer=o.len, factor=o.penalty_factor)


def config_problems(o: OverlongBufferConfig, *, max_response_length: int) -> list[tuple[str, object, str]]:
    """``(key, value, message)`` for every problem of ``reward.overlong_buffer`` (checked when enabled)."""
    longest, key = max_response_length, KEY
    if not o.enable:
        return []
    out: list[tuple[str, object, str]] = []
    if not 1 <= o.len < longest:
        out.append((f"{key}.len", o.len, f"must be ≥ 1 and below data.max_response_length={longest} (the penalty "
                                         f"ramps over the last len tokens a response may have)"))
    if o.penalty_factor < 0:
        out.append((f"{key}.penalty_factor", o.penalty_factor, "must be ≥ 0 (the paper: 1)"))
    return out
