"""HF <-> Megatron tensor layouts for the Qwen2/Qwen3/Llama families and Qwen3-MoE/Qwen2-MoE/Mixtral/GLM-4.5/
DeepSeek-V3 (pure tensor code).

Why hand-written and not mbridge 0.15.1: mbridge targets Transformer Engine's layer spec. On
Megatron's local spec (what runs on CPU) it needs four overrides (local spec instead of its
hard-coded TE spec, the local norm names, sequence parallel forced off, masked-softmax fusion off),
it yields one tensor at a time with no bucketing (tied embeddings twice under PP), and its tied
embedding handling mutates a class-level dict. The dense layouts are a few rules, written out below
and cross-checked in the tests against transformers' logits and a bitwise round trip. MoE/VL
families would add rules (experts: one unit per expert matrix, EP instead of TP split) or, if they
multiply, a reason to adopt a bridge.

One *unit* is one Megatron parameter (canonical local-spec name with a *global* layer number) and the
HF tensors it is made of. Layouts, TP size ``T``, rank ``r``:

- ``qkv``: Megatron interleaves per KV group: ``[q_g (heads_per_group·d); k_g (d); v_g (d)]`` for each
  group ``g``; rank ``r`` holds groups ``[r·G/T, (r+1)·G/T)`` whole. Same for the biases.
- ``fc1``: ``[gate_r; up_r]`` per rank (SwiGLU: ``silu(first half) * second half``).
- ``row`` (``linear_proj``, ``linear_fc2``): split along the input dim (1).
- ``column`` (multi-latent attention's projections): split along the output dim (0), HF's row order kept.
- ``vocab`` (embedding, output layer): rows, after padding the vocab to Megatron's size.
- ``replicated``: norms, QK norms, the MoE router (``mlp.gate``) and its expert bias, the shared expert's gate.

MoE layers (:class:`~hybridrl.hf.arch.MoE`): the router and one ``fc1``/``row`` unit pair per expert
(``mlp.experts.local_experts.<global expert>``, HF ``mlp.experts.<e>.{gate,up,down}_proj`` — Mixtral's
``block_sparse_moe.experts.<e>.{w1,w3,w2}``, :data:`~hybridrl.hf.arch.EXPERT_NAMES` — split over the expert TP ranks
like a dense MLP of the experts' size) and the shared expert (``mlp.shared_experts``, a dense MLP: Qwen2-MoE's
``mlp.shared_expert`` of ``shared_expert_intermediate_size`` plus its gate, GLM-4.5's ungated ``mlp.shared_experts``).
Sigmoid routers (GLM-4.5) add the router's ``expert_bias``, HF ``mlp.gate.e_score_correction_bias``: a buffer, not a
parameter, that both sides keep in float32 whatever the model's dtype (:attr:`Unit.fp32`).

Multi-latent attention (DeepSeek-V3, :class:`~hybridrl.hf.arch.MLA`) is one ``column`` unit per HF projection, both
sides laying out a head's rows alike (q: ``[nope; rope]``, kv_b: ``[k_nope; v]``, kv_a: ``[latent; k_rope]``):
``linear_q_down_proj`` / ``linear_q_up_proj`` = ``q_a_proj`` / ``q_b_proj`` (or ``linear_q_proj`` = ``q_proj``
when ``q_lora_rank`` is null), ``linear_kv_down_proj`` / ``linear_kv_up_proj`` = ``kv_a_proj_with_mqa`` /
``kv_b_proj``, ``q_layernorm`` / ``kv_layernorm`` = ``q_a_layernorm`` / ``kv_a_layernorm``, ``linear_proj`` =
``o_proj`` (``row``). Megatron's local spec makes the down projections column-parallel too (each rank computes a
slice of the latent, then gathers it); :func:`hybridrl.megatron.model.layer_spec` makes TE's do the same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from hybridrl.hf.arch import EXPERT_NAMES, HFArch

Kind = Literal["replicated", "row", "vocab", "qkv", "fc1", "column"]
# Reads part of an HF tensor: ``read(name, (slice(lo, hi),))`` rows, ``(slice(None), slice(lo, hi))``
# columns, ``()`` all of it. A safetensors reader reads only that part from disk.
Read = Callable[[str, tuple[slice, ...]], torch.Tensor]
ALL: tuple[slice, ...] = ()


def _rows(lo: int, hi: int) -> tuple[slice, ...]:
    return (slice(lo, hi),)

# Transformer Engine fuses the pre-attention/pre-MLP norms into the following linear layer.
TE_TO_LOCAL = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",  # MLA's latent norms
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
}


@dataclass(slots=True, frozen=True)
class Unit:
    megatron_name: str  # local-spec name, global layer number: decoder.layers.<global>.<suffix>
    hf_names: tuple[str, ...]
    kind: Kind
    layer: int | None  # global layer index; None for embedding / final norm / output layer
    ffn: int = 0  # fc1 / MLP row units: the MLP's intermediate size (0: the dense one, arch.ffn_hidden_size)
    shape: tuple[int, ...] | None = None  # replicated units other than norms, MLA's: the (HF) tensor's shape
    fp32: bool = False  # a float32 buffer in any model dtype (the router's expert bias), not a parameter


def _mlp_units(m: str, h: str, layer: int, *, ffn: int = 0,
               names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> list[Unit]:
    """A SwiGLU MLP: Megatron ``<m>linear_fc1`` = [gate; up] of HF ``<h>gate_proj`` / ``<h>up_proj``, ``linear_fc2``
    = ``down_proj`` (``names``: the HF gate, up and down matrices' names)."""
    gate, up, down = names
    return [Unit(m + "linear_fc1.weight", (f"{h}{gate}.weight", f"{h}{up}.weight"), "fc1", layer, ffn),
            Unit(m + "linear_fc2.weight", (f"{h}{down}.weight",), "row", layer, ffn)]


def _moe_units(arch: HFArch, m: str, h: str, layer: int) -> list[Unit]:
    moe, names = arch.moe, EXPERT_NAMES[arch.family]
    assert moe is not None
    units = [Unit(m + "mlp.router.weight", (f"{h}{names.block}.gate.weight",), "replicated", layer,
                  shape=(moe.num_experts, arch.hidden_size))]
    if moe.expert_bias:
        units.append(Unit(m + "mlp.router.expert_bias", (f"{h}{names.block}.gate.e_score_correction_bias",),
                          "replicated", layer, shape=(moe.num_experts,), fp32=True))
    for e in range(moe.num_experts):
        units += _mlp_units(f"{m}mlp.experts.local_experts.{e}.", f"{h}{names.block}.experts.{e}.", layer,
                            ffn=moe.ffn_hidden_size, names=(names.gate, names.up, names.down))
    if moe.shared_ffn_hidden_size:
        units += _mlp_units(m + "mlp.shared_experts.", f"{h}{names.block}.{names.shared}.", layer,
                            ffn=moe.shared_ffn_hidden_size)
    if moe.shared_expert_gate:
        units.append(Unit(m + "mlp.shared_experts.gate_weight", (h + "mlp.shared_expert_gate.weight",), "replicated",
                          layer, shape=(1, arch.hidden_size)))
    return units


def _mla_units(arch: HFArch, m: str, h: str, layer: int) -> list[Unit]:
    mla, hidden, heads = arch.mla, arch.hidden_size, arch.num_attention_heads
    assert mla is not None
    m, h = m + "self_attention.", h + "self_attn."

    def unit(megatron: str, hf: str, kind: Kind, *shape: int) -> Unit:
        return Unit(f"{m}{megatron}.weight", (f"{h}{hf}.weight",), kind, layer, shape=shape)

    q_rows = heads * mla.q_head_dim
    if mla.q_lora_rank is None:
        units = [unit("linear_q_proj", "q_proj", "column", q_rows, hidden)]
    else:
        units = [unit("linear_q_down_proj", "q_a_proj", "column", mla.q_lora_rank, hidden),
                 unit("q_layernorm", "q_a_layernorm", "replicated", mla.q_lora_rank),
                 unit("linear_q_up_proj", "q_b_proj", "column", q_rows, mla.q_lora_rank)]
    return units + [
        unit("linear_kv_down_proj", "kv_a_proj_with_mqa", "column", mla.kv_lora_rank + mla.qk_rope_head_dim, hidden),
        unit("kv_layernorm", "kv_a_layernorm", "replicated", mla.kv_lora_rank),
        unit("linear_kv_up_proj", "kv_b_proj", "column", heads * (mla.qk_nope_head_dim + mla.v_head_dim),
             mla.kv_lora_rank),
        unit("linear_proj", "o_proj", "row", hidden, heads * mla.v_head_dim),
    ]


def layer_units(arch: HFArch, layer: int) -> list[Unit]:
    m, h = f"decoder.layers.{layer}.", f"{arch.hf_prefix}layers.{layer}."
    units = [Unit(m + "input_layernorm.weight", (h + "input_layernorm.weight",), "replicated", layer)]
    if arch.mla is not None:
        units += _mla_units(arch, m, h, layer)
        units.append(Unit(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), "replicated",
                          layer))
        if arch.moe is not None and arch.moe.sparse_layers[layer]:
            return units + _moe_units(arch, m, h, layer)
        return units + _mlp_units(m + "mlp.", h + "mlp.", layer)
    attn = tuple(f"{h}self_attn.{p}_proj.weight" for p in "qkv")
    units.append(Unit(m + "self_attention.linear_qkv.weight", attn, "qkv", layer))
    if arch.qkv_bias:
        bias = tuple(f"{h}self_attn.{p}_proj.bias" for p in "qkv")
        units.append(Unit(m + "self_attention.linear_qkv.bias", bias, "qkv", layer))
    if arch.qk_layernorm:
        units.append(Unit(m + "self_attention.q_layernorm.weight", (h + "self_attn.q_norm.weight",),
                          "replicated", layer))
        units.append(Unit(m + "self_attention.k_layernorm.weight", (h + "self_attn.k_norm.weight",),
                          "replicated", layer))
    units += [
        Unit(m + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",), "row", layer),
        Unit(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), "replicated", layer),
    ]
    if arch.moe is not None and arch.moe.sparse_layers[layer]:
        return units + _moe_units(arch, m, h, layer)
    return units + _mlp_units(m + "mlp.", h + "mlp.", layer)


def ffn_size(unit: Unit, arch: HFArch) -> int:
    return unit.ffn or arch.ffn_hidden_size


def all_units(arch: HFArch) -> list[Unit]:
    """Every unit of the model in HF order; with tied embeddings there is no output-layer unit; a reward model's
    (``arch.score_head``) is its scalar head, ``score.weight`` (replicated over TP, as
    :class:`~hybridrl.megatron.critic.ValueHead` holds it)."""
    units = [Unit("embedding.word_embeddings.weight", (arch.hf_prefix + "embed_tokens.weight",), "vocab", None)]
    for layer in range(arch.num_layers):
        units += layer_units(arch, layer)
    units.append(Unit("decoder.final_layernorm.weight", (arch.hf_prefix + "norm.weight",), "replicated", None))
    if arch.score_head:
        units.append(Unit("output_layer.weight", ("score.weight",), "replicated", None, shape=(1, arch.hidden_size)))
    elif not arch.tie_word_embeddings:
        units.append(Unit("output_layer.weight", ("lm_head.weight",), "vocab", None))
    return units


def hf_shapes(unit: Unit, arch: HFArch) -> list[tuple[int, ...]]:
    if unit.shape is not None:
        return [unit.shape]
    h, d, f = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    q, kv = arch.num_attention_heads * d, arch.num_query_groups * d
    if unit.kind == "qkv":
        tail = (h,) if unit.megatron_name.endswith("weight") else ()
        return [(q, *tail), (kv, *tail), (kv, *tail)]
    if unit.kind in ("fc1", "row"):
        f = ffn_size(unit, arch)
    if unit.kind == "fc1":
        return [(f, h), (f, h)]
    if unit.kind == "vocab":
        return [(arch.vocab_size, h)]
    if unit.kind == "row":
        return [(h, q)] if "linear_proj" in unit.megatron_name else [(h, f)]
    suffix = unit.megatron_name.rsplit(".", 2)[-2]
    return [(d,)] if suffix in ("q_layernorm", "k_layernorm") else [(h,)]


def full_shape(unit: Unit, arch: HFArch) -> tuple[int, ...]:
    """Shape of the TP-gathered Megatron tensor (true vocab, no padding)."""
    shapes = hf_shapes(unit, arch)
    if unit.kind in ("qkv", "fc1"):
        return (sum(s[0] for s in shapes), *shapes[0][1:])
    return shapes[0]


def shard_from_hf(unit: Unit, arch: HFArch, read: Read, *, tp_rank: int, tp_size: int,
                  padded_vocab: int) -> torch.Tensor:
    """This TP rank's Megatron shard of ``unit``, reading only the part of each HF tensor it needs."""
    r, t = tp_rank, tp_size
    if unit.kind == "replicated":
        return read(unit.hf_names[0], ALL)
    if unit.kind == "row":
        n = hf_shapes(unit, arch)[0][1] // t
        return read(unit.hf_names[0], (slice(None), slice(r * n, (r + 1) * n)))
    if unit.kind == "column":
        n = hf_shapes(unit, arch)[0][0] // t
        return read(unit.hf_names[0], _rows(r * n, (r + 1) * n))
    if unit.kind == "vocab":
        n = padded_vocab // t
        lo, hi = r * n, min((r + 1) * n, arch.vocab_size)
        shard = torch.zeros(n, arch.hidden_size)
        if hi > lo:
            rows = read(unit.hf_names[0], _rows(lo, hi))
            shard = shard.to(rows.dtype)
            shard[: hi - lo] = rows
        return shard
    if unit.kind == "fc1":
        n = ffn_size(unit, arch) // t
        return torch.cat([read(name, _rows(r * n, (r + 1) * n)) for name in unit.hf_names])
    # qkv: whole groups [r·G/T, (r+1)·G/T) of q (heads_per_group·d rows each), k and v (d rows each)
    groups, d, rep = arch.num_query_groups // t, arch.head_dim, arch.heads_per_group
    q_name, k_name, v_name = unit.hf_names
    q = read(q_name, _rows(r * groups * rep * d, (r + 1) * groups * rep * d))
    k = read(k_name, _rows(r * groups * d, (r + 1) * groups * d))
    v = read(v_name, _rows(r * groups * d, (r + 1) * groups * d))
    tail = q.shape[1:]
    per_group = [x.reshape(groups, -1, *tail) for x in (q, k, v)]
    return torch.cat(per_group, dim=1).reshape(-1, *tail)


def gather_dim(unit: Unit) -> int:
    """Dimension along which the TP shards of ``unit`` concatenate (replicated units: none, -1)."""
    return {"replicated": -1, "row": 1}.get(unit.kind, 0)


def full_from_shards(unit: Unit, arch: HFArch, shards: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate TP shards (rank order) into the full Megatron tensor, true vocab rows only."""
    if unit.kind == "replicated":
        return shards[0]
    full = torch.cat(shards, dim=gather_dim(unit))
    return full[: arch.vocab_size] if unit.kind == "vocab" else full


def hf_from_full(unit: Unit, arch: HFArch, full: torch.Tensor, *, tp_size: int) -> list[torch.Tensor]:
    """Split a full Megatron tensor (as from :func:`full_from_shards`) into ``unit.hf_names``' tensors.

    The per-rank layouts of ``qkv`` (whole groups in group order) and ``fc1`` (``[gate_r; up_r]``) make
    the inverse depend on how many ranks the full tensor was concatenated from: ``tp_size``.
    """
    if unit.kind == "qkv":
        d, rep, tail = arch.head_dim, arch.heads_per_group, full.shape[1:]
        grouped = full.reshape(arch.num_query_groups, rep + 2, d, *tail)
        return [grouped[:, :rep].reshape(-1, *tail), grouped[:, rep].reshape(-1, *tail),
                grouped[:, rep + 1].reshape(-1, *tail)]
    if unit.kind == "fc1":
        f = ffn_size(unit, arch)
        halves = full.reshape(tp_size, 2, f // tp_size, -1)
        return [halves[:, 0].reshape(f, -1), halves[:, 1].reshape(f, -1)]
    return [full]
