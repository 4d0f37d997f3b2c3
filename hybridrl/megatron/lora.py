"""LoRA adapters on Megatron's column- and row-parallel linears (``linear_qkv``, ``linear_proj``, ``linear_fc1``,
``linear_fc2``), exactly peft's adapters per HF projection.

    y = W x + (alpha / r) · B · A · dropout(x),   A: [r, in], B: [out, r]   (Hu et al. 2021, "LoRA"; peft's layout)

A is drawn like peft's (Kaiming-uniform, a = √5: U(±1/√in)) and B is zero, so training starts at the base model.
Deviation: A's draw comes from a generator seeded by (seed, global layer, projection), not the global RNG, so
the adapters are the same at every TP/PP/VPP layout.

Per HF projection, not per Megatron linear: Megatron fuses q/k/v into one ``linear_qkv`` (per KV group
``[q_g; k_g; v_g]``) and gate/up into ``linear_fc1`` (``[gate_r; up_r]`` per TP rank). Each fused linear gets
one (A, B) pair per projection it holds, and the deltas are laid out like the fused weight, so the adapters
are peft's ``q_proj``/``k_proj``/… ones after a plain gather (no re-factorisation), and a subset such as
``[q_proj, v_proj]`` is exact.

Sharding under TP (the factor that touches the sharded dimension is split on it, the other is replicated):

- column-parallel base (output dim sharded): A replicated, B sharded on its output rows (this rank's KV
  groups / ffn rows, as the base weight). ``h = A x`` is identical on every TP rank; it passes Megatron's
  ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce backward) before B, so A's gradient is
  the sum over ranks' B shards, as the base's input gradient is.
- row-parallel base (input dim sharded): A sharded on its input columns, B replicated. The partial
  ``h_r = A_r x_r`` is all-reduced (``reduce_from_tensor_model_parallel_region``, like the base's partial
  output, but on r channels instead of ``out``) before B.

``lora_dropout`` draws from torch's default generator, which every rank seeds alike and advances alike, so a
column-parallel (TP-replicated) input gets the same mask on every TP rank.

The adapters live as a child module ``<linear>_lora`` of the attention / MLP module (so Megatron's
``sharded_state_dict`` recursion picks up their own sharding; the linear's own state dict stays the base's),
and a forward hook on the linear adds the delta to its output. CP and PP need nothing special (per token,
per layer); sequence parallel and Transformer Engine's fused norm+linear are refused (no CPU path to test).

MoE layers: ``gate_proj``/``up_proj``/``down_proj`` adapt every routed expert (each its own (A, B): peft's
per-expert modules, ``model.layers.L.mlp.experts.E.gate_proj``, Mixtral's ``w1``/``w3``/``w2``) and the shared expert
(``mlp.shared_expert(s)``), as peft's ``target_modules`` matching by name does; the dense MLP of a dense layer as
before. Separate adapters per expert, not one shared by all: an expert is its own function of its own tokens, and a
shared adapter would add the same delta to experts that the router keeps apart (and could not be written as a peft
adapter vLLM loads). Under EP each rank holds its experts' adapters, marked expert-parallel like their weights
(``allreduce = False``: Megatron's DDP reduces their gradients over the expert-DP group, its optimizer counts them in
the expert grad norm), and the checkpoint keeps them under Megatron's global expert index. An MoE model at TP > 1
trains with sequence parallelism, which LoRA refuses, so expert adapters are never TP-sharded.

Base weights are frozen (``requires_grad=False``): Megatron's DDP builds grad buffers and its optimizer
(plain or distributed) param groups only from parameters that require grad, so only the adapters are
trained and hold optimizer state.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

from hybridrl.hf.arch import EXPERT_NAMES, HFArch
from hybridrl.lora.config import HF_PROJECTIONS, MEGATRON_LINEARS, LoRAConfig
from hybridrl.megatron.convert import all_units, full_shape
from hybridrl.megatron.model import unwrap_model

__all__ = ["LORA_SUFFIX", "LoRAAdapter", "LoRAModel", "apply_lora", "is_lora_name"]

LORA_SUFFIX = "_lora"  # the adapter module of ``linear_qkv`` is ``linear_qkv_lora``
_PARENT = {"linear_qkv": "self_attention", "linear_proj": "self_attention", "linear_fc1": "mlp", "linear_fc2": "mlp"}
_HF_MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
              "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def is_lora_name(name: str) -> bool:
    """True for a parameter / state-dict name of an adapter (``…linear_qkv_lora.lora_A.q_proj``)."""
    return any(f"{linear}{LORA_SUFFIX}." in name for linear in MEGATRON_LINEARS)


@dataclass(frozen=True, slots=True)
class _Site:
    """Which MLP of a layer an adapter sits on: the dense one, routed expert ``expert``, or the shared expert."""

    kind: str = "dense"  # dense | expert | shared
    expert: int = -1

    @property
    def key(self) -> int:  # folds into the adapters' seeds
        return {"dense": 0, "shared": 1}.get(self.kind, 2 + self.expert)


DENSE = _Site()


def hf_module_name(layer: int, projection: str, site: _Site = DENSE, arch: HFArch | None = None) -> str:
    """The HF (and peft) module path of ``projection`` in ``layer``: ``model.layers.3.self_attn.q_proj``; an expert's
    by the checkpoint's names (``model.layers.3.mlp.experts.5.gate_proj``, Mixtral's ``block_sparse_moe…w1``); a
    vision-language model's under its checkpoint's language-model prefix (Qwen3-VL: ``model.language_model.``)."""
    base = f"{arch.hf_prefix if arch is not None else 'model.'}layers.{layer}"
    if site.kind == "dense":
        return f"{base}.{_HF_MODULE[projection]}.{projection}"
    assert arch is not None
    names = EXPERT_NAMES[arch.family]
    if site.kind == "shared":
        return f"{base}.{names.block}.{names.shared}.{projection}"
    own = {"gate_proj": names.gate, "up_proj": names.up, "down_proj": names.down}[projection]
    return f"{base}.{names.block}.experts.{site.expert}.{own}"


def _full_shapes(arch: HFArch, projection: str, site: _Site = DENSE) -> tuple[int, int]:
    """``(in_features, out_features)`` of the HF projection (of the MLP at ``site``)."""
    h, f, q, kv = arch.hidden_size, arch.ffn_hidden_size, arch.num_attention_heads * arch.head_dim, \
        arch.num_query_groups * arch.head_dim
    if site.kind != "dense":
        assert arch.moe is not None
        f = arch.moe.ffn_hidden_size if site.kind == "expert" else arch.moe.shared_ffn_hidden_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, f),
            "up_proj": (h, f), "down_proj": (f, h)}[projection]


def _sites(arch: HFArch, layer: int) -> list[_Site]:
    """The MLPs of ``layer`` that MLP projections adapt: the dense one, or every routed expert and the shared one."""
    moe = arch.moe
    if moe is None or not moe.sparse_layers[layer]:
        return [DENSE]
    return ([_Site("expert", e) for e in range(moe.num_experts)]
            + ([_Site("shared")] if moe.shared_ffn_hidden_size else []))


@dataclass(frozen=True, slots=True)
class _Factor:
    """Where one factor of one projection's adapter is split under TP: ``axis`` (None: replicated)."""

    full_shape: tuple[int, int]
    axis: int | None


class LoRAAdapter(torch.nn.Module):
    """The adapters of one Megatron linear of one layer: one (A, B) pair per adapted HF projection it holds."""

    def __init__(self, *, linear: str, layer: int, arch: HFArch, cfg: LoRAConfig, projections: Sequence[str],
                 like: torch.Tensor, seed: int, site: _Site = DENSE) -> None:
        super().__init__()
        self.linear, self.layer, self.arch, self.scaling, self.site = linear, layer, arch, cfg.scaling, site
        self.row = linear in ("linear_proj", "linear_fc2")
        self.projections = tuple(projections)  # adapted ones, in the linear's output order
        self.enabled = True
        self.dropout = torch.nn.Dropout(cfg.dropout) if cfg.dropout > 0 else torch.nn.Identity()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.lora_A, self.lora_B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        self.factors: dict[str, tuple[_Factor, _Factor]] = {}
        for p in self.projections:
            n_in, n_out = _full_shapes(arch, p, site)
            a_axis, b_axis = (1, None) if self.row else (None, 0)
            self.factors[p] = (_Factor((cfg.rank, n_in), a_axis), _Factor((n_out, cfg.rank), b_axis))
            gen = torch.Generator().manual_seed(seed * 1_000_003 + layer * 101 + list(HF_PROJECTIONS).index(p)
                                                + site.key * 7_919)
            bound = 1.0 / math.sqrt(n_in)  # peft: kaiming_uniform_(a=√5) on [r, in]
            a_full = torch.rand(cfg.rank, n_in, generator=gen, dtype=torch.float32) * (2 * bound) - bound
            b_full = torch.zeros(n_out, cfg.rank)
            a = _shard(a_full, a_axis, tp_rank, tp)
            b = _shard(b_full, b_axis, tp_rank, tp)
            self.lora_A[p] = torch.nn.Parameter(a.to(device=like.device, dtype=like.dtype))
            self.lora_B[p] = torch.nn.Parameter(b.to(device=like.device, dtype=like.dtype))
            for param, axis in ((self.lora_A[p], a_axis), (self.lora_B[p], b_axis)):
                if axis is not None:  # the grad norm counts sharded params on every TP rank, replicated ones once
                    set_tensor_model_parallel_attributes(param, is_parallel=True, dim=axis, stride=1)
                if site.kind == "expert":  # as the expert's own weights: reduced over expert-DP, not all of DP
                    param.allreduce = False
        tp_groups = arch.num_query_groups // tp
        ffn = _full_shapes(arch, "gate_proj", site)[1]
        self._local_out = {"q_proj": tp_groups * arch.heads_per_group * arch.head_dim,
                           "k_proj": tp_groups * arch.head_dim, "v_proj": tp_groups * arch.head_dim,
                           "gate_proj": ffn // tp, "up_proj": ffn // tp}

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The adapters' contribution to the linear's (TP-local) output for its input ``x`` ``[s, b, in_local]``."""
        x = self.dropout(x)
        ys: dict[str, torch.Tensor] = {}
        for p in self.projections:
            h = F.linear(x, self.lora_A[p])  # [s, b, r]: partial (row) or full (column)
            h = reduce_from_tensor_model_parallel_region(h) if self.row else copy_to_tensor_model_parallel_region(h)
            ys[p] = F.linear(h, self.lora_B[p]) * self.scaling
        if self.row:
            return ys[self.projections[0]]
        return self._fuse(ys, x)

    def _fuse(self, ys: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Lay per-projection deltas out like the fused local weight (zeros for projections not adapted)."""
        lead = x.shape[:-1]
        parts = MEGATRON_LINEARS[self.linear]

        def get(p: str) -> torch.Tensor:
            y = ys.get(p)
            return y if y is not None else x.new_zeros(*lead, self._local_out[p])

        if self.linear == "linear_fc1":
            return torch.cat([get(p) for p in parts], dim=-1)  # [gate_r; up_r]
        groups = self.arch.num_query_groups // parallel_state.get_tensor_model_parallel_world_size()
        q, k, v = (get(p).reshape(*lead, groups, -1) for p in parts)  # per KV group [q_g; k_g; v_g]
        return torch.cat([q, k, v], dim=-1).reshape(*lead, -1)

    def hook(self, module: torch.nn.Module, args: tuple[Any, ...], output: tuple[torch.Tensor, Any]) -> Any:
        if not self.enabled:
            return output
        out, bias = output
        return out + self.delta(args[0]).to(out.dtype), bias

    # --- checkpointing (Megatron dist_checkpointing) ---
    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple[Any, ...] = (),
                           metadata: dict[str, Any] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for kind, params in (("lora_A", self.lora_A), ("lora_B", self.lora_B)):
            for p, param in params.items():
                key = f"{prefix}{kind}.{p}"
                axis = self.factors[p][0 if kind == "lora_A" else 1].axis
                out[key] = (make_sharded_tensor_for_checkpoint(param, key, prepend_offsets=sharded_offsets)
                            if axis is None else
                            make_tp_sharded_tensor_for_checkpoint(param, key, tp_axis=axis,
                                                                  prepend_offsets=sharded_offsets))
        return out


def _shard(full: torch.Tensor, axis: int | None, rank: int, size: int) -> torch.Tensor:
    return full if axis is None else full.chunk(size, dim=axis)[rank].clone()


class LoRAModel:
    """The adapters of this rank's model chunks: switch them off (the reference policy), count them, and
    gather them into full HF-named tensors (merged weights, peft export)."""

    def __init__(self, adapters: list[LoRAAdapter], cfg: LoRAConfig, arch: HFArch) -> None:
        self.adapters, self.cfg, self.arch = adapters, cfg, arch

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """The base model: every adapter off inside the block (the RL reference policy: no second copy)."""
        for a in self.adapters:
            a.enabled = False
        try:
            yield
        finally:
            for a in self.adapters:
                a.enabled = True

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        for a in self.adapters:
            yield from a.parameters()

    def trainable_numel(self) -> int:
        """Adapter parameters of the whole model (all TP/PP ranks; replicated factors counted once)."""
        return sum(math.prod(f.full_shape) for _, factors in self._all_factors() for f in factors)

    def _all_factors(self) -> list[tuple[tuple[int, str, _Site], tuple[_Factor, _Factor]]]:
        """Every adapter of the whole model, ``((global layer, projection, site), (A, B))``, in HF order."""
        r = self.cfg.rank
        out = []
        for layer in range(self.arch.num_layers):
            for p in self.cfg.projections:
                for site in _sites(self.arch, layer) if HF_PROJECTIONS[p] in ("linear_fc1", "linear_fc2") else [DENSE]:
                    n_in, n_out = _full_shapes(self.arch, p, site)
                    row = HF_PROJECTIONS[p] in ("linear_proj", "linear_fc2")
                    a, b = _Factor((r, n_in), 1 if row else None), _Factor((n_out, r), None if row else 0)
                    out.append(((layer, p, site), (a, b)))
        return out

    @torch.no_grad()
    def gather(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{hf module name: (A [r, in], B [out, r])}`` of the whole model, on every rank (collective over the
        TP, EP and PP groups: every rank must call it). Small: rank × (in + out) per projection (and expert)."""
        tp_group = parallel_state.get_tensor_model_parallel_group()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        ep_group = parallel_state.get_expert_model_parallel_group()
        ep = parallel_state.get_expert_model_parallel_world_size()
        local = {(a.layer, p, a.site): (a.lora_A[p], a.lora_B[p]) for a in self.adapters for p in a.projections}
        owners: dict[int, int] = {}
        if pp > 1:
            layers: list[list[int] | None] = [None] * pp
            dist.all_gather_object(layers, sorted({a.layer for a in self.adapters}), group=pp_group)
            owners = {layer: s for s, ls in enumerate(layers) for layer in ls or []}
        like = next(iter(self.parameters()))
        out = {}
        per_rank = self.arch.moe.num_experts // ep if self.arch.moe is not None else 0
        for (layer, p, site), factors in self._all_factors():
            full = []
            for i, factor in enumerate(factors):
                if (layer, p, site) in local:
                    shard = local[(layer, p, site)][i].detach()
                    if factor.axis is None or tp == 1:
                        t = shard.clone()
                    else:
                        parts = [torch.empty_like(shard) for _ in range(tp)]
                        dist.all_gather(parts, shard.contiguous(), group=tp_group)
                        t = torch.cat(parts, dim=factor.axis)
                else:
                    t = torch.empty(factor.full_shape, dtype=like.dtype, device=like.device)
                if ep > 1 and site.kind == "expert":  # from the EP rank that holds the expert, in its stage
                    dist.broadcast(t, src=dist.get_global_rank(ep_group, site.expert // per_rank), group=ep_group)
                if pp > 1:
                    dist.broadcast(t, src=dist.get_global_rank(pp_group, owners[layer]), group=pp_group)
                full.append(t)
            out[hf_module_name(layer, p, site, self.arch)] = (full[0], full[1])
        return out

    def summary(self, *, optimizer: str, dtype: torch.dtype) -> str:
        """The start-up line: trainable parameters (vs the base) and the optimizer state they need, whole model."""
        base = sum(math.prod(full_shape(u, self.arch)) for u in all_units(self.arch))
        n = self.trainable_numel()
        # Adam: m and v in fp32 (SGD: momentum); + fp32 main weights when the model is 16-bit (Megatron's)
        per_param = (8 if optimizer == "adam" else 4) + (4 if dtype != torch.float32 else 0)
        return (f"LoRA r={self.cfg.rank} alpha={self.cfg.alpha:g} on {', '.join(self.cfg.projections)}: "
                f"{n:,} trainable parameters ({100 * n / base:.2f}% of the base's {base:,}); optimizer state "
                f"{n * per_param / 2**20:.2f} MiB ({optimizer}; full fine-tuning: {base * per_param / 2**20:.1f} MiB)")

    def merger(self) -> Merge:
        """A function ``(hf weight name, tensor) -> merged tensor`` for the weight stream (collective: gathers now)."""
        return Merge(self.gather(), self.cfg.scaling)


class Merge:
    """W + scale · B · A for each adapted HF weight (computed in fp32, cast back to W's dtype); others as they are."""

    def __init__(self, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float) -> None:
        self.adapters, self.scaling = adapters, scaling

    def __call__(self, hf_name: str, weight: torch.Tensor) -> torch.Tensor:
        module = hf_name.removesuffix(".weight")
        if module == hf_name or module not in self.adapters:
            return weight
        a, b = self.adapters[module]
        return (weight.float() + self.scaling * (b.float() @ a.float())).to(weight.dtype)


def apply_lora(chunks: Sequence[torch.nn.Module], arch: HFArch, cfg: LoRAConfig, *, seed: int = 0) -> LoRAModel:
    """Put adapters on the targeted linears of this rank's model chunks (built and loaded) and freeze every
    other parameter; call before the chunks are wrapped in DDP / given to an optimizer."""
    if parallel_state.get_tensor_model_parallel_world_size() > 1 and unwrap_model(chunks[0]).config.sequence_parallel:
        raise NotImplementedError("LoRA with sequence_parallel=True is not supported; use sequence_parallel=False")
    adapters: list[LoRAAdapter] = []
    for chunk in chunks:
        gpt = unwrap_model(chunk)
        gpt.requires_grad_(False)
        for layer in gpt.decoder.layers:
            global_layer = layer.layer_number - 1
            for linear, projections in MEGATRON_LINEARS.items():
                chosen = [p for p in projections if p in cfg.projections]
                if not chosen:
                    continue
                for site, parent in _parents(layer, linear, global_layer, arch):
                    base = getattr(parent, linear)
                    if type(base) not in (ColumnParallelLinear, RowParallelLinear):
                        raise NotImplementedError(
                            f"LoRA needs Megatron's local layer spec; {linear} is a {type(base).__name__} (Transformer "
                            "Engine fuses the norm into it, so its input is not the adapter's)")
                    adapter = LoRAAdapter(linear=linear, layer=global_layer, arch=arch, cfg=cfg, projections=chosen,
                                          like=base.weight, seed=seed, site=site)
                    parent.add_module(linear + LORA_SUFFIX, adapter)
                    base.register_forward_hook(adapter.hook)
                    adapters.append(adapter)
    return LoRAModel(adapters, cfg, arch)


def _parents(layer: torch.nn.Module, linear: str, global_layer: int,
             arch: HFArch) -> list[tuple[_Site, torch.nn.Module]]:
    """The modules holding ``linear`` in ``layer``: its attention or dense MLP, or an MoE layer's local experts
    (Megatron's SequentialMLP: one MLP each, global index from the EP rank) and its shared expert."""
    parent = getattr(layer, _PARENT[linear])
    if _PARENT[linear] != "mlp" or _sites(arch, global_layer) == [DENSE]:
        return [(DENSE, parent)]
    experts = parent.experts
    if not hasattr(experts, "local_experts"):
        raise NotImplementedError(f"LoRA on experts needs Megatron's SequentialMLP experts (moe_grouped_gemm off); "
                                  f"layer {global_layer} has {type(experts).__name__}")
    first = parallel_state.get_expert_model_parallel_rank() * len(experts.local_experts)
    out = [(_Site("expert", first + i), mlp) for i, mlp in enumerate(experts.local_experts)]
    if getattr(parent, "shared_experts", None) is not None:
        out.append((_Site("shared"), parent.shared_experts))
    return out
