"""Every adaptation the ``hf`` rollout engine makes to transformers 5.19's behaviour, in one place.

Each item names the upstream behaviour it works around; ``tests/rollout/test_hf_compat.py`` shows that each is still
needed (it fails once upstream changes, so the item can go).

1. **Fused experts in memory.** transformers ≥ 5 holds an MoE layer's experts (Qwen3-MoE, Qwen2-MoE) as two fused
   parameters — ``mlp.experts.gate_up_proj`` ``[E, 2f, h]`` (each expert's [gate; up]) and ``mlp.experts.down_proj``
   ``[E, h, f]`` — and converts a checkpoint's per-expert tensors (``mlp.experts.<e>.{gate,up,down}_proj.weight``,
   the names the trainer's weight stream carries) only when it loads one. :func:`checkpoint_views` names views of
   the fused parameters by the checkpoint's names, so a streamed expert is copied into the fused storage in place.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

_FUSED = re.compile(r"(.+\.mlp\.experts)\.(gate_up_proj|down_proj)")


def checkpoint_views(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{checkpoint name: view of the fused parameter}`` for every fused expert parameter in ``params`` (item 1)."""
    out: dict[str, torch.Tensor] = {}
    for name, param in params.items():
        match = _FUSED.fullmatch(name)
        if match is None:
            continue
        base, data = match[1], param.data
        for e in range(data.shape[0]):
            if match[2] == "gate_up_proj":
                f = data.shape[1] // 2
                out[f"{base}.{e}.gate_proj.weight"] = data[e, :f]
                out[f"{base}.{e}.up_proj.weight"] = data[e, f:]
            else:
                out[f"{base}.{e}.down_proj.weight"] = data[e]
    return out
