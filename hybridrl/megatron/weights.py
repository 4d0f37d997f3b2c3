"""HF safetensors -> this rank's Megatron shards, and Megatron -> a bucketed stream of HF tensors.

Loading: each rank opens the checkpoint lazily (:class:`hybridrl.hf.tensors.SafetensorsReader`)
and reads only the slices of the tensors its TP rank and PP stage hold. Both directions take this
rank's model chunks (one, or VPP under the interleaved schedule); parameters are named by global
layer number, so a chunk's layers map to HF layers wherever interleaving put them. Export:
:func:`export_hf_weights` yields buckets of ``(hf_name, full_tensor)`` in HF order; each unit is
all-gathered over TP on the stage that owns it and broadcast over PP, so every rank receives the same
stream. The stream feeds the in-place weight sync into SGLang and HF checkpoint saving; it never holds
more than one bucket plus the unit being converted. Layout rules live in :mod:`hybridrl.megatron.convert`.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from hybridrl.hf.arch import HFArch
from hybridrl.hf.tensors import SafetensorsReader
from hybridrl.interfaces import WeightBucket
from hybridrl.megatron.convert import (
    TE_TO_LOCAL,
    Unit,
    all_units,
    full_from_shards,
    full_shape,
    hf_from_full,
    shard_from_hf,
)
from hybridrl.megatron.lora import is_lora_name
from hybridrl.megatron.model import unwrap_model
from hybridrl.vlm.megatron_vlm import VISION_ATTR, vision_stream

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"(mlp\.experts\.local_experts\.)(\d+)(\..+)")


def expert_of(unit: Unit) -> int | None:
    """The global expert index of an expert's unit (None for any other unit)."""
    match = _EXPERT.fullmatch(unit.megatron_name.split(".", 3)[-1])
    return int(match[2]) if match else None


def _experts_per_rank(arch: HFArch) -> int:
    assert arch.moe is not None
    return arch.moe.num_experts // parallel_state.get_expert_model_parallel_world_size()


def _global_suffix(suffix: str, arch: HFArch) -> str:
    """A layer parameter's suffix with its local expert index (EP: each rank holds experts
    ``[r·E/EP, (r+1)·E/EP)`` as ``local_experts.0…``) made global."""
    match = _EXPERT.fullmatch(suffix)
    if match is None:
        return suffix
    first = parallel_state.get_expert_model_parallel_rank() * _experts_per_rank(arch)
    return f"{match[1]}{first + int(match[2])}{match[3]}"


def _tp(unit: Unit) -> tuple[int, int]:
    """``unit``'s TP rank and size: the experts' own TP group for an expert, the model's for the rest."""
    if expert_of(unit) is not None:
        return (parallel_state.get_expert_tensor_parallel_rank(),
                parallel_state.get_expert_tensor_parallel_world_size())
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def local_units(chunks: Sequence[torch.nn.Module], arch: HFArch,
                skip: tuple[str, ...] = ()) -> dict[str, tuple[Unit, torch.Tensor]]:
    """This rank's parameters (over all its model chunks) by canonical name (global layer numbers,
    local-spec names) with units; parameters whose Megatron name starts with one of ``skip`` are left out
    (the critic's value head, which no causal-LM tensor fills). The routers' expert biases (sigmoid routing) are
    buffers, listed here too: the checkpoint holds them.

    With tied embeddings the last PP stage holds a copy of the embedding as ``output_layer.weight``;
    it maps to ``model.embed_tokens.weight``.
    """
    units = {u.megatron_name: u for u in all_units(arch)}
    if arch.tie_word_embeddings:
        units["output_layer.weight"] = Unit("output_layer.weight", (arch.hf_prefix + "embed_tokens.weight",),
                                            "vocab", None)
    out: dict[str, tuple[Unit, torch.Tensor]] = {}
    for chunk in chunks:
        out.update(_chunk_units(unwrap_model(chunk), arch, units, skip))
    return out


def _chunk_units(gpt: GPTModel, arch: HFArch, units: dict[str, Unit],
                 skip: tuple[str, ...] = ()) -> dict[str, tuple[Unit, torch.Tensor]]:
    out: dict[str, tuple[Unit, torch.Tensor]] = {}
    biases = ((n, b) for n, b in gpt.named_buffers() if n.endswith(".router.expert_bias"))
    for name, param in itertools.chain(gpt.named_parameters(), biases):
        if name.startswith(skip) or is_lora_name(name):  # adapters: hybridrl.megatron.lora
            continue
        if name.startswith(VISION_ATTR + "."):  # a VLM's vision tower: its own stream (hybridrl.vlm.megatron_vlm)
            continue
        canonical = name
        if match := _LAYER.fullmatch(name):
            local, suffix = int(match[1]), match[2]
            layer = gpt.decoder.layers[local].layer_number - 1  # Megatron's global, 1-based number
            canonical = f"decoder.layers.{layer}.{_global_suffix(TE_TO_LOCAL.get(suffix, suffix), arch)}"
        if canonical not in units:
            raise KeyError(f"Megatron parameter {name!r} has no HF counterpart for a {arch.family} model; "
                           f"known: {sorted(units)[:6]}...")
        out[canonical] = (units[canonical], param)
    return out


@torch.no_grad()
def load_hf_weights(chunks: Sequence[torch.nn.Module], arch: HFArch, model_dir: str | Path, *,
                    skip: tuple[str, ...] = ()) -> None:
    """Fill every parameter of this rank's model chunks from the HF checkpoint (only the slices it needs),
    except those whose Megatron name starts with one of ``skip``. A block-wise FP8 checkpoint (:mod:`hybridrl.hf.fp8`)
    loads dequantised (each e4m3 block × its ``weight_scale_inv``) and cast to the model's dtype."""
    padded_vocab = unwrap_model(chunks[0]).vocab_size
    with SafetensorsReader(model_dir, fp8_blocks=arch.fp8_blocks) as reader:
        for name, (unit, param) in local_units(chunks, arch, skip).items():
            tp_rank, tp_size = _tp(unit)
            if unit.fp32:  # Float16Module cast the buffer down; Megatron's router keeps it float32 (router.py:
                param.data = param.data.float()  # TopKRouter._maintain_float32_expert_bias), transformers too
            shard = shard_from_hf(unit, arch, reader.read, tp_rank=tp_rank, tp_size=tp_size,
                                  padded_vocab=padded_vocab)
            if shard.shape != param.shape:
                raise ValueError(f"{model_dir}: {unit.hf_names} give {name} the shape {tuple(shard.shape)} "
                                 f"on TP rank {tp_rank}, but the model has {tuple(param.shape)}; does "
                                 "config.json match the weights?")
            param.copy_(shard)


def _tp_gather(unit: Unit, arch: HFArch, param: torch.Tensor, group: dist.ProcessGroup,
               tp_size: int) -> torch.Tensor:
    if unit.kind == "replicated" or tp_size == 1:
        return full_from_shards(unit, arch, [param.detach().clone()])
    shards = [torch.empty_like(param) for _ in range(tp_size)]
    dist.all_gather(shards, param.detach().contiguous(), group=group)
    return full_from_shards(unit, arch, shards)


@torch.no_grad()
def export_hf_weights(chunks: Sequence[torch.nn.Module], arch: HFArch, *, bucket_bytes: int,
                      merge: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> Iterator[WeightBucket]:
    """Yield the whole model (this rank's ``chunks`` and its peers') as HF-named full tensors, in buckets
    of at most ``bucket_bytes``.

    Every rank gets the same buckets in the same order (HF order: embedding, layers, norm, lm_head).
    A tensor larger than ``bucket_bytes`` travels alone in its bucket. Each yielded tensor owns its
    storage (never a view of a parameter) and has the model's dtype (a router's expert bias: float32) and device.
    The stream runs TP all-gathers, EP broadcasts (each expert from the rank that holds it) and PP broadcasts: every
    rank of the model's TP×EP×PP group must consume it to the end.
    Memory: one bucket plus the unit in flight (its TP-gathered tensor and HF pieces).
    ``merge(hf_name, tensor)`` (LoRA: :meth:`hybridrl.megatron.lora.LoRAModel.merger`) replaces each tensor.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    local = local_units(chunks, arch)
    if arch.tie_word_embeddings and pp_size > 1 and "embedding.word_embeddings.weight" not in local:
        local.pop("output_layer.weight", None)  # the first stage exports the tied embedding
    # what this stage holds: its layers (every EP rank of a stage holds all of them, experts apart) and the
    # units outside the layers (embedding, final norm, output layer)
    layers = {u.layer for u, _ in local.values() if u.layer is not None}
    outside = {name for name, (u, _) in local.items() if u.layer is None}
    owner: dict[object, int] = {}  # layer index or outside unit name -> PP stage
    if pp_size > 1:
        per_stage: list[tuple[list[int], list[str]] | None] = [None] * pp_size
        dist.all_gather_object(per_stage, (sorted(layers), sorted(outside)), group=pp_group)
        owner = {key: s for s, held in enumerate(per_stage) if held for keys in held for key in keys}
    param = next(iter(local.values()))[1]
    dtype, device = param.dtype, param.device

    bucket: WeightBucket = []
    size = 0
    for hf_name, tensor in itertools.chain(_language_stream(arch, local, layers, owner, dtype, device, merge),
                                           vision_stream(chunks, arch) if arch.vision is not None else ()):
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((hf_name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def _language_stream(arch: HFArch, local: dict[str, tuple[Unit, torch.Tensor]], layers: set[int],
                     owner: dict[object, int], dtype: torch.dtype, device: torch.device,
                     merge: Callable[[str, torch.Tensor], torch.Tensor] | None) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`export_hf_weights`' tensors of the causal LM, one at a time, in HF order."""
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    ep_size = parallel_state.get_expert_model_parallel_world_size() if arch.moe is not None else 1
    for unit in all_units(arch):
        tp_size = _tp(unit)[1]
        if unit.megatron_name in local:
            group = (parallel_state.get_expert_tensor_parallel_group() if expert_of(unit) is not None
                     else parallel_state.get_tensor_model_parallel_group())
            full = _tp_gather(unit, arch, local[unit.megatron_name][1], group, tp_size)
        else:
            full = torch.empty(full_shape(unit, arch), dtype=torch.float32 if unit.fp32 else dtype, device=device)
        expert = expert_of(unit)
        if expert is not None and ep_size > 1 and unit.layer in layers:  # from the EP rank that holds it
            ep_group = parallel_state.get_expert_model_parallel_group()
            dist.broadcast(full, src=dist.get_global_rank(ep_group, expert // _experts_per_rank(arch)),
                           group=ep_group)
        if pp_size > 1:
            stage = owner[unit.layer if unit.layer is not None else unit.megatron_name]
            dist.broadcast(full, src=dist.get_global_rank(pp_group, stage), group=pp_group)
        for hf_name, tensor in zip(unit.hf_names, hf_from_full(unit, arch, full, tp_size=tp_size),
                                   strict=True):
            yield hf_name, (tensor if merge is None else merge(hf_name, tensor)).contiguous()
