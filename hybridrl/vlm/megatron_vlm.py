"""A vision-language model on Megatron: the language model as a ``GPTModel`` with multimodal RoPE, the vision tower
beside it (Qwen2.5-VL, Qwen3-VL; issue 46).

    h      = embed(ids)                                   the first stage's embedding, [s, b, h]
    h[ids == image_token_id] = vision(pixel_values, grid_thw)   the merged patch features, in image order
    logits = GPTModel(decoder_input=h, position_ids=mrope_positions(ids, grid_thw))

The language model is the causal LM the checkpoint's text half is (``HFArch`` with ``mrope_section``; its weights are
a Qwen2 checkpoint's, read and written by the causal-LM converter), on every TP/PP layout the policy has: Megatron's
``MultimodalRotaryEmbedding`` rotates each (time, height, width) slice of the rotary dims by its own id
(:mod:`hybridrl.vlm.positions`). The vision tower is transformers' own module (``visual.*`` weights), replicated on
every rank that embeds (the first pipeline stage): it is small next to the language model (~0.7 B of Qwen2.5-VL-7B's
8.3 B) and its patches are few, so splitting it over TP would cost more in communication than it saves.

In the RL loop and the offline trainers the tower is a submodule of the first stage's ``GPTModel``
(:func:`attach_vision_tower`, ``vision_model``), so Megatron's DDP reduces its gradients over DP, the one optimizer
updates it (unless ``actor_rollout_ref.actor.freeze_vision_tower``) and clips it with the rest, and the checkpoint
saves it; :func:`vision_stream` adds its tensors to the weight stream the engines and exports read. Its gradient is
the same on every TP rank (its features enter a layer whose column-parallel input all-reduces its gradient over TP),
so the DP reduction is all it needs.

Qwen3-VL adds its interleaved M-RoPE channel layout (:mod:`hybridrl.vlm.mrope`) and DeepStack: intermediate
vision features added at the image positions after the first decoder layers (:mod:`hybridrl.vlm.deepstack`).

With context parallelism each CP rank embeds the whole padded row (tower included) and keeps its own chunks of the
sequence, as Megatron splits a row (``shard_sequence``); the tower's gradients, from each rank's positions, are summed
by the DP × CP reduction like every other parameter's.

Limits of this first slice: padded rows only (packed THD rows give Megatron's RoPE one table per sequence, which
multimodal ids do not fit), no sequence parallelism (the embedding's output would be scattered over TP before
the features could be placed), images only (no video).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.hf.arch import HFArch
from hybridrl.hf.tensors import SafetensorsReader
from hybridrl.vlm.deepstack import set_features
from hybridrl.vlm.positions import mrope_positions
from hybridrl.vlm.sglang_compat import transformers_rope_rules

VISION_ATTR = "vision_model"  # the tower's name inside the first stage's GPTModel


def _tower_classes(family: str) -> tuple[Any, Any]:
    if family == "qwen3_vl":
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
        return Qwen3VLVisionConfig, Qwen3VLVisionModel
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    return Qwen2_5_VLVisionConfig, Qwen2_5_VisionTransformerPretrainedModel


def build_vision_tower(arch: HFArch, model_dir: str | Path | None, *,
                       dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """transformers' vision tower of the checkpoint's family (patch embedding, blocks, merger; Qwen3-VL's DeepStack
    mergers) with its weights (``visual.*``; Qwen3-VL: ``model.visual.*``), in eval mode, on the CPU; ``model_dir``
    None: as initialised, for a training checkpoint to fill."""
    assert arch.vision is not None, "not a vision-language model"
    config_class, tower_class = _tower_classes(arch.vision.family)
    prefix = arch.vision.vision_prefix
    with transformers_rope_rules():  # its axial RoPE even after SGLang's import (hybridrl.vlm.sglang_compat)
        config = config_class(**{k: v for k, v in arch.vision.config.items() if k != "model_type"})
        config._attn_implementation = "sdpa"
        tower = tower_class(config)
    if model_dir is None:
        return tower.to(dtype).eval()
    with SafetensorsReader(model_dir) as reader:
        names = [n for n in reader.files if n.startswith(prefix)]
        state = {n.removeprefix(prefix): reader.read(n) for n in names}
    missing, unexpected = tower.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{model_dir}: the vision tower's weights do not match its config: missing "
                         f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    return tower.to(dtype).eval()


def vision_tensors(tower: torch.nn.Module, arch: HFArch) -> list[tuple[str, torch.Tensor]]:
    """The vision tower's weights under their checkpoint names (the export beside the language model's stream)."""
    assert arch.vision is not None
    return [(arch.vision.vision_prefix + name, t.detach().clone()) for name, t in tower.state_dict().items()]


def image_features(tower: torch.nn.Module, pixel_values: torch.Tensor,
                   grid_thw_N3: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``([n, hidden], [[n, hidden] per DeepStack layer])``: the merged patch features of every image, in image order
    (one row per placeholder), and Qwen3-VL's DeepStack features of the same rows (Qwen2.5-VL: none)."""
    out = tower(pixel_values.to(next(tower.parameters()).dtype), grid_thw=grid_thw_N3)
    if not hasattr(out, "pooler_output"):
        return out, []
    return out.pooler_output, list(getattr(out, "deepstack_features", None) or [])


def decoder_input(gpt: Any, tower: torch.nn.Module, ids_BS: torch.Tensor, pixel_values: torch.Tensor | None,
                  grid_thw_N3: torch.Tensor | None, arch: HFArch,
                  images_in_BS: torch.Tensor | None = None) -> torch.Tensor:
    """``[s, b, h]``: the first stage's token embeddings with each image placeholder replaced by its feature (the
    images of sample 0 first, each sample's in order); ``images_in_BS``: where placeholders are images (the prompts
    and tool results; None: everywhere). Qwen3-VL: the DeepStack features of this forward are set on ``gpt`` too."""
    v = arch.vision
    assert v is not None
    emb_SBH = gpt.embedding(input_ids=ids_BS, position_ids=None)
    at_BS = ids_BS == v.image_token_id
    if images_in_BS is not None:
        at_BS &= images_in_BS
    if pixel_values is None or not bool(at_BS.any()):
        if v.deepstack_layers:
            set_features(gpt, v.deepstack_layers, None, None)
        return emb_SBH
    assert grid_thw_N3 is not None
    feats, deep = image_features(tower, pixel_values, grid_thw_N3)
    if v.deepstack_layers:
        set_features(gpt, v.deepstack_layers, at_BS, deep)
    if feats.shape[0] != int(at_BS.sum()):
        raise ValueError(f"{int(at_BS.sum())} image placeholder tokens but {feats.shape[0]} image features "
                         f"(image_grid_thw {grid_thw_N3.tolist()})")
    emb_BSH = emb_SBH.transpose(0, 1).clone()
    emb_BSH[at_BS] = feats.to(emb_BSH.dtype)
    return emb_BSH.transpose(0, 1).contiguous()


def batch_positions(ids_BS: torch.Tensor, lengths_B: torch.Tensor, grid_thw_N3: torch.Tensor | None,
                    arch: HFArch, images_in_BS: torch.Tensor | None = None) -> torch.Tensor:
    """``[3, b, s]`` position ids of right-padded rows (padding: 0), each row's images taken from ``grid_thw_N3`` in
    order, over the whole row: what transformers' ``get_rope_index`` gives the row, which is what an engine uses when
    it prefills a context (a multi-turn episode's next turn) and, for the tokens it decodes, what its
    ``rope_deltas`` continue with. ``images_in_BS``: where a placeholder id is an image (the prompt's, a tool
    result's; None: everywhere); elsewhere (a response's sampled ids) it is a text token, as the engine decoded it."""
    assert arch.vision is not None
    out = torch.zeros(3, *ids_BS.shape, dtype=torch.long)
    image = 0
    for b, n in enumerate(lengths_B.tolist()):
        row = ids_BS[b, :n].cpu()
        slots = None if images_in_BS is None else images_in_BS[b, :n].cpu()
        k = int(((row == arch.vision.image_token_id) & (True if slots is None else slots)).sum())
        grids, taken = [], 0  # this row's images: as many grids as its placeholders need
        while taken < k:
            assert grid_thw_N3 is not None
            t, h, w = (int(x) for x in grid_thw_N3[image])
            grids.append((t, h, w))
            taken += t * h * w // arch.vision.spatial_merge_size ** 2
            image += 1
        out[:, b, :n] = mrope_positions(row, torch.tensor(grids) if grids else None, arch.vision, slots)
    return out.to(ids_BS.device)


def image_slots(prompt_len_B: torch.Tensor, loss_mask_BT: torch.Tensor | None, seq_len: int) -> torch.Tensor:
    """``[B, S]`` bool: where a row's placeholder ids are images — its prompt, and the ids of its response that the
    policy did not sample (``loss_mask`` 0: a multi-turn episode's tool results; None: a response is all text)."""
    col_BS = torch.arange(seq_len, device=prompt_len_B.device)[None] - prompt_len_B[:, None]
    slots_BS = col_BS < 0
    if loss_mask_BT is None:
        return slots_BS
    T = loss_mask_BT.shape[1]
    inside_BS = (col_BS >= 0) & (col_BS < T)
    appended_BS = torch.gather(loss_mask_BT.to(prompt_len_B.device) == 0, 1, col_BS.clamp(0, max(T - 1, 0)))
    return slots_BS | (inside_BS & appended_BS)


def attach_vision_tower(chunks: Sequence[torch.nn.Module], arch: HFArch, model_dir: str | Path | None, *,
                        dtype: torch.dtype, trainable: bool) -> None:
    """Put the checkpoint's vision tower into the first stage's model chunk (``vision_model``; none on later
    stages): before DDP wraps the chunks, so that a trainable tower is trained with them; a frozen one has no
    gradient and no optimizer state (``freeze_vision_tower``). ``model_dir`` None: its weights come from a training
    checkpoint loaded next (``hybridrl export-hf``)."""
    from hybridrl.megatron.model import unwrap_model

    for chunk in chunks:
        gpt = unwrap_model(chunk)
        if gpt.pre_process:
            tower = build_vision_tower(arch, model_dir, dtype=dtype).requires_grad_(trainable)
            setattr(gpt, VISION_ATTR, tower.to(next(gpt.parameters()).device))


def tower_of(gpt: Any) -> torch.nn.Module | None:
    return getattr(gpt, VISION_ATTR, None)


def forward_rows(model: Any, arch: HFArch, tokens_BS: torch.Tensor, prompt_len_B: torch.Tensor,
                 lengths_B: torch.Tensor, images: Sequence[Any], attention_mask: Any, *,
                 loss_mask_BT: torch.Tensor | None = None, **kwargs: Any) -> Any:
    """One padded micro-batch through a VLM chunk: rows of real tokens then padding (``lengths_B`` real tokens, the
    first ``prompt_len_B`` the prompt's), ``images[b]`` the :class:`~hybridrl.vlm.inputs.ImageInputs` of row b's
    sample (None: text only), in sequence order. A placeholder id is an image in the prompt and in the response's
    ids the policy did not sample (``loss_mask_BT`` 0: a multi-turn episode's tool results; None: none); the ids the
    policy sampled are text whatever they are (a multi-turn episode ends at such a turn:
    :mod:`hybridrl.rollout.episodes`). A row whose placeholders were cut away (a filler row cut to its last prompt
    token) takes no image."""
    from hybridrl.megatron.context_parallel import shard_sequence
    from hybridrl.megatron.model import unwrap_model
    from hybridrl.vlm.inputs import stack_images

    v = arch.vision
    assert v is not None
    # a row's images are its first placeholders in the prompt and appended ids, as many as its images take: those
    # precede any the policy sampled (an episode ends at a turn that samples one), and a filler row (a copy with
    # loss mask 0, its outputs dropped) keeps its own images
    slots_BS = image_slots(prompt_len_B.to(tokens_BS.device), loss_mask_BT, tokens_BS.shape[1])
    slots_BS &= tokens_BS == v.image_token_id
    need_B = torch.tensor([0 if x is None else int(x.image_grid_thw.prod(-1).sum()) // v.spatial_merge_size ** 2
                           for x in images], device=tokens_BS.device)
    slots_BS &= slots_BS.cumsum(-1) <= need_B[:, None]
    has_image = slots_BS.any(-1).tolist()
    stacked = stack_images([x if keep else None for x, keep in zip(images, has_image, strict=True)])
    pixels = None if stacked is None else stacked.pixel_values.to(tokens_BS.device)
    grid = None if stacked is None else stacked.image_grid_thw.to(tokens_BS.device)
    positions = batch_positions(tokens_BS, lengths_B, grid, arch, slots_BS)
    gpt = unwrap_model(model)
    dec = None
    if gpt.pre_process:
        tower = tower_of(gpt)
        assert tower is not None, "a VLM's first stage without its vision tower (attach_vision_tower)"
        dec = shard_sequence(decoder_input(gpt, tower, tokens_BS, pixels, grid, arch, slots_BS), dim=0)
    # CP: each rank its chunks of the sequence (the features were placed in the whole of it); Megatron's multimodal
    # RoPE takes every position and keeps this rank's itself
    return model(shard_sequence(tokens_BS), positions, attention_mask, decoder_input=dec, **kwargs)


def vision_stream(chunks: Sequence[torch.nn.Module], arch: HFArch) -> Iterator[tuple[str, torch.Tensor]]:
    """The vision tower's tensors under their checkpoint names (``visual.*``; Qwen3-VL ``model.visual.*``), on every
    rank: the first pipeline stage holds the tower and broadcasts each tensor over the PP group (every rank of it must
    consume the stream)."""
    from megatron.core import parallel_state

    from hybridrl.megatron.model import unwrap_model

    towers = [t for c in chunks if (t := tower_of(unwrap_model(c))) is not None]
    assert arch.vision is not None
    local = [(arch.vision.vision_prefix + n, t.detach()) for n, t in towers[0].state_dict().items()] if towers else []
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pp == 1:
        for name, t in local:
            yield name, t.clone()
        return
    group = parallel_state.get_pipeline_model_parallel_group()
    first = dist.get_global_rank(group, 0)
    box: list[Any] = [[(n, tuple(t.shape), t.dtype) for n, t in local]]
    dist.broadcast_object_list(box, src=first, group=group)
    device = next(unwrap_model(chunks[0]).parameters()).device
    mine = dict(local)
    for name, shape, dtype in box[0]:
        t = mine[name].clone() if name in mine else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(t, src=first, group=group)
        yield name, t
