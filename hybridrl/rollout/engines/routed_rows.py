"""R3 router replay: an engine's routed-experts rows as ``Generation.routed_experts``, for any engine.

An engine that records its routing (``vllm``, ``sglang``) returns, per finished sample, the top-k experts of every
position it ran: ``[prompt + output − 1, layers, top-k]``, where ``layers`` is either every decoder layer (vLLM and
SGLang size their buffers by ``num_hidden_layers``; a dense layer's rows are meaningless) or the MoE layers only.
:func:`routed_rows` checks the shape and keeps the MoE layers' rows, in order, as int16 — a wrong shape is an error,
not a silently misaligned replay.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridrl.hf.arch import HFArch
from hybridrl.rollout.engines.server_engine import CONFIG_KEY


def moe_layers(model_path: str, *, error: type[Exception]) -> list[int]:
    """The indices of the model's MoE layers (the rows R3 replays); ``error`` for a dense model."""
    moe = HFArch.from_hf(model_path).moe
    if moe is None:
        raise error(f"{CONFIG_KEY}.return_routed_experts: {model_path} has no MoE layers to record")
    return [i for i, sparse in enumerate(moe.sparse_layers) if sparse]


def routed_rows(rows: Any, positions: int, moe_layers: list[int], *, engine: str,
                error: type[Exception]) -> torch.Tensor:
    """``rows`` (``[positions, layers, top-k]``, array-like) as ``Generation.routed_experts``: int16, the MoE layers'
    rows only. ``engine`` names the engine in the errors, ``error`` is raised."""
    routed = torch.as_tensor(rows).to(torch.int16)
    if routed.ndim != 3 or routed.shape[0] != positions:
        raise error(f"{engine}'s routed experts have the shape {tuple(routed.shape)}; expected "
                    f"[{positions} positions (prompt + output − 1), layers, top-k]")
    if routed.shape[1] != len(moe_layers):  # one row per layer, the dense ones too: keep the MoE layers'
        if routed.shape[1] <= moe_layers[-1]:
            raise error(f"{engine}'s routed experts cover {routed.shape[1]} layers; the model's MoE layers "
                        f"are {moe_layers}")
        routed = routed[:, moe_layers]
    return routed
