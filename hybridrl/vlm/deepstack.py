"""DeepStack on Megatron: Qwen3-VL's intermediate vision features added to the first decoder layers' outputs
(Meng et al. 2024, "DeepStack: Deeply Stacking Visual Tokens is Surprisingly Simple and Effective for LMMs"; as
Qwen3-VL uses it, Bai et al. 2025).

    h_0 = embed(ids);  h_0[image] = merger(vision block N)                  (the ordinary image features)
    h_{l+1} = layer_l(h_l);  h_{l+1}[image] += deepstack_merger_l(vision block d_l)   for l < len(d)

where ``d`` = ``vision_config.deepstack_visual_indexes``. transformers adds them after the layer, before the next
(``Qwen3VLTextModel._deepstack_process``); here a forward hook on each of the first ``len(d)`` decoder layers of the
first pipeline stage does the same to the layer's output, ``[s, b, h]`` (with CP, this rank's chunks of the row and
the feature rows that fall in them). The features of the micro-batch in flight
sit on the ``GPTModel`` (:func:`set_features`, called where its decoder input is built, right before its forward);
a micro-batch with no image clears them. Those layers must be on the first stage (where the tower runs): a pipeline
layout that puts fewer layers there is refused (``hybridrl.config.check_vlm``).
"""

from __future__ import annotations

from typing import Any

import torch

_STATE = "_hybridrl_deepstack"  # (mask [b, s], [feature [n, h] per layer]) of the micro-batch in flight, or None
_HOOKED = "_hybridrl_deepstack_hooked"


def set_features(gpt: Any, n_layers: int, mask_BS: torch.Tensor | None, features: list[torch.Tensor] | None) -> None:
    """The DeepStack features of the next forward through ``gpt`` (None: this micro-batch has no image); the first
    call puts the hooks on the chunk's first ``n_layers`` decoder layers."""
    if not getattr(gpt, _HOOKED, False):
        layers = [layer for layer in gpt.decoder.layers if layer.layer_number <= n_layers]  # 1-based, global
        if len(layers) < n_layers:
            raise ValueError(f"DeepStack adds image features after decoder layers 0..{n_layers - 1}, but the first "
                             f"pipeline stage holds {len(layers)} of them: put at least {n_layers} layers on it")
        for layer in layers:
            layer.register_forward_hook(_make_hook(gpt, layer.layer_number - 1))
        setattr(gpt, _HOOKED, True)
    if features is not None and len(features) != n_layers:
        raise ValueError(f"{len(features)} DeepStack feature sets for {n_layers} layers")
    if mask_BS is None or features is None:
        object.__setattr__(gpt, _STATE, None)
        return
    from hybridrl.megatron.context_parallel import shard_sequence

    # CP: the layers see this rank's chunks of the sequence; keep the mask and the feature rows that fall there
    row_BS = (mask_BS.flatten().cumsum(0) - 1).view_as(mask_BS)  # each placeholder's feature row (sample order)
    local_BS = shard_sequence(mask_BS)
    rows = shard_sequence(row_BS)[local_BS]
    object.__setattr__(gpt, _STATE, (local_BS, [f.index_select(0, rows) for f in features]))


def _make_hook(gpt: Any, index: int) -> Any:
    def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
        state = getattr(gpt, _STATE, None)
        if state is None:
            return output
        mask_BS, features = state
        hidden_SBH = output[0] if isinstance(output, tuple) else output
        hidden_BSH = hidden_SBH.transpose(0, 1).clone()  # the features are in sample order: sample 0's images first
        hidden_BSH[mask_BS] = hidden_BSH[mask_BS] + features[index].to(hidden_BSH.dtype)
        hidden_SBH = hidden_BSH.transpose(0, 1).contiguous()
        return (hidden_SBH, *output[1:]) if isinstance(output, tuple) else hidden_SBH

    return hook
