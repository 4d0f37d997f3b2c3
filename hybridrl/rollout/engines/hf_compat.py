"""Every adaptation the ``hf`` rollout engine makes to transformers 5.19's behaviour, in one place.

Each item names the upstream behaviour it works around; ``tests/rollout/engines/test_hf_compat.py`` shows that each is
still needed (it fails once upstream changes, so the item can go).

1. **Fused experts in memory.** transformers ≥ 5 holds an MoE layer's experts (Qwen3-MoE, Qwen2-MoE, Mixtral) as two
   fused parameters — ``mlp.experts.gate_up_proj`` ``[E, 2f, h]`` (each expert's [gate; up]) and
   ``mlp.experts.down_proj`` ``[E, h, f]`` — and converts a checkpoint's per-expert tensors
   (``mlp.experts.<e>.{gate,up,down}_proj.weight``; Mixtral's ``block_sparse_moe.experts.<e>.{w1,w3,w2}.weight`` and
   ``block_sparse_moe.gate.weight``, its router, :data:`hybridrl.hf.arch.EXPERT_NAMES`: the names the trainer's
   weight stream carries) only when it loads one. :func:`checkpoint_views` names views of the fused parameters (and
   of a renamed router) by the checkpoint's names, so a streamed expert is copied into the fused storage in place.
2. **The experts a router chose.** transformers' MoE blocks return only the mixed hidden states; the chosen experts
   exist as the third output of the block's router (``mlp.gate``: logits, weights, top-k indices), which
   :class:`RoutingRecorder` reads with a forward hook for R3 router replay.
3. **A VLM's parameters are renamed in memory.** transformers ≥ 5 nests Qwen2.5-VL's language model under
   ``model.language_model.*`` and its vision tower under ``model.visual.*``; the checkpoint (the hub layout, and the
   trainer's weight stream) names them ``model.*`` (``model.layers``, ``model.embed_tokens``, ``model.norm``) and
   ``visual.*`` — transformers renames them when it loads (and back when it saves). :func:`vlm_checkpoint_names`
   names the parameters by the checkpoint's names (:data:`hybridrl.hf.vlm.PREFIXES`), so a streamed tensor is copied
   into its parameter in place. Qwen3-VL's checkpoint names are transformers' own: nothing is renamed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from hybridrl.hf.arch import EXPERT_NAMES
from hybridrl.hf.vlm import PREFIXES, VLM_FAMILIES

_FUSED = re.compile(r"(.+)\.mlp\.(experts\.(gate_up_proj|down_proj)|gate\.weight)")


def checkpoint_views(params: Mapping[str, torch.Tensor], model_type: str) -> dict[str, torch.Tensor]:
    """``{checkpoint name: view of the parameter}`` for every fused expert parameter in ``params`` and, where the
    checkpoint keeps the MoE block under another name than ``mlp`` (Mixtral's ``block_sparse_moe``), its router too
    (item 1). A ``model_type`` hybridrl does not convert is taken to name its experts as Qwen3-MoE does."""
    names = EXPERT_NAMES.get(model_type, EXPERT_NAMES["qwen3_moe"])
    out: dict[str, torch.Tensor] = {}
    for name, param in params.items():
        match = _FUSED.fullmatch(name)
        if match is None:
            continue
        block, data = f"{match[1]}.{names.block}", param.data
        if match[2] == "gate.weight":
            if names.block != "mlp":
                out[f"{block}.gate.weight"] = data
            continue
        for e in range(data.shape[0]):
            if match[3] == "gate_up_proj":
                f = data.shape[1] // 2
                out[f"{block}.experts.{e}.{names.gate}.weight"] = data[e, :f]
                out[f"{block}.experts.{e}.{names.up}.weight"] = data[e, f:]
            else:
                out[f"{block}.experts.{e}.{names.down}.weight"] = data[e]
    return out


# transformers' prefixes of a VLM's language model and vision tower in memory (the checkpoint's: hf.vlm.PREFIXES)
_IN_MEMORY = ("model.language_model.", "model.visual.")


def vlm_checkpoint_names(params: Mapping[str, torch.Tensor], model_type: str) -> dict[str, torch.Tensor]:
    """``{checkpoint name: parameter}`` for a vision-language model's parameters that transformers names otherwise
    (item 3); {} for another model. ``lm_head.weight`` keeps its name."""
    if model_type not in VLM_FAMILIES:
        return {}
    renames = [(memory, disk) for memory, disk in zip(_IN_MEMORY, PREFIXES[model_type], strict=True) if memory != disk]
    return {disk + name.removeprefix(memory): param for name, param in params.items()
            for memory, disk in renames if name.startswith(memory)}


class RoutingRecorder:
    """The experts transformers' MoE blocks (Qwen3-MoE, Qwen2-MoE) chose, read by a forward hook on each router
    (item 2), MoE layers in order; a dense model has none."""

    def __init__(self, model: torch.nn.Module) -> None:
        layers = getattr(model.get_decoder(), "layers", [])
        self.gates = [layer.mlp.gate for layer in layers
                      if hasattr(getattr(layer, "mlp", None), "experts") and hasattr(layer.mlp, "gate")]
        self.top_k = int(getattr(model.config, "num_experts_per_tok", 0))
        self._seen: list[torch.Tensor] = []
        self._hooks: list[Any] = []

    def start(self, B: int, S: int) -> torch.Tensor:
        """``[B, S, L, k]`` int16 filled with -1, and the hooks on."""
        if not self.gates:
            raise ValueError("SamplingParams.return_routed_experts: the rollout model has no MoE layers")
        self.stop()
        self._hooks = [g.register_forward_hook(lambda _m, _i, out: self._seen.append(out[2])) for g in self.gates]
        return torch.full((B, S, len(self.gates), self.top_k), -1, dtype=torch.int16)

    def collect(self, route_BSLK: torch.Tensor, rows_A: torch.Tensor, cols_s: torch.Tensor) -> None:
        """The last forward's routing (rows ``rows_A``, ``len(cols_s)`` positions each) into ``route_BSLK``."""
        assert len(self._seen) == len(self.gates), f"{len(self._seen)} router outputs for {len(self.gates)} layers"
        A = len(rows_A)
        idx_AsLK = torch.stack([x.reshape(A, len(cols_s), -1) for x in self._seen], dim=2).to("cpu", torch.int16)
        route_BSLK[rows_A.cpu()[:, None], cols_s[None, :]] = idx_AsLK
        self._seen.clear()

    def stop(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks, self._seen = [], []
