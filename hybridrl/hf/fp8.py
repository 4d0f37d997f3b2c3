"""A checkpoint's FP8 weights, as DeepSeek-V3 ships them: ``quantization_config`` in config.json.

DeepSeek-V3's (and R1's, Kimi-K2's) published checkpoints carry ``{"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [128, 128], "activation_scheme": "dynamic"}``: every linear layer's weight is float8 e4m3 with
one float32 ``<name>_scale_inv`` per 128 × 128 block (``scale_inv = amax / 448`` of the block; the weight is
``e4m3 × scale_inv``); the embedding, the output layer, the norms and the routers stay bf16. SGLang and vLLM serve
such a checkpoint as it is (FP8 GEMMs). hybridrl plans its engines' memory with it, and its Megatron models load it
dequantised (:class:`hybridrl.hf.tensors.SafetensorsReader`: each block × its scale, cast to the model's dtype), so they
train in bf16/fp32 and export bf16 (without ``quantization_config``). Its weight sync streams those bf16 tensors,
which an FP8 engine cannot take in place (slime quantises each weight to e4m3 blocks on the fly before
``update_weights_from_tensor``; hybridrl does not yet). Any other ``quantization_config`` is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SCALE_SUFFIX = "_scale_inv"  # "<name>.weight_scale_inv": the float32 scale of each block of "<name>.weight"
FP8_FORMAT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}


def read_fp8_blocks(cfg: Mapping[str, Any], source: str) -> tuple[int, int] | None:
    """The block shape of ``cfg``'s block-wise FP8 weights; None when the checkpoint is not quantised."""
    q = cfg.get("quantization_config")
    if q is None:
        return None
    block = q.get("weight_block_size") if isinstance(q, Mapping) else None
    if (not isinstance(q, Mapping) or q.get("quant_method") != "fp8" or q.get("fmt", "e4m3") != "e4m3"
            or not isinstance(block, list) or len(block) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in block)):
        raise NotImplementedError(f"{source}: quantization_config={q!r} is not supported; valid: none (bf16/fp32 "
                                  f"weights) or block-wise FP8 as DeepSeek-V3 ships it, {FP8_FORMAT}")
    return block[0], block[1]
