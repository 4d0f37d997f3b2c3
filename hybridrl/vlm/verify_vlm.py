"""``hybridrl verify-model`` on a vision-language checkpoint: the same check as for a causal LM, with an image in
every row — Megatron's logits (:mod:`hybridrl.vlm.megatron_vlm`) against transformers' own model on the same ids,
pixels and grid; the vision tower's weights join the round trip."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hybridrl.hf.arch import HFArch
from hybridrl.vlm.megatron_vlm import batch_positions, decoder_input
from hybridrl.vlm.sglang_compat import transformers_rope_rules

GRID = (1, 4, 4)  # each row's image: one frame of 4 × 4 patches → 4 placeholder tokens at merge 2


def vlm_inputs(arch: HFArch, *, batch: int, seq_len: int,
               gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids [b, s], pixel_values, image_grid_thw)``: random text around one image per row (its vision start and
    end tokens and placeholders), random pixels."""
    v = arch.vision
    assert v is not None
    n = GRID[0] * GRID[1] * GRID[2] // v.spatial_merge_size ** 2
    if seq_len < n + 4:
        raise ValueError(f"--seq-len {seq_len} is too short for an image of {n} tokens and its frame (≥ {n + 4})")
    special = {v.image_token_id, v.vision_start_token_id, v.video_token_id}
    text = torch.tensor([t for t in range(arch.vocab_size) if t not in special])
    ids_BS = text[torch.randint(0, len(text), (batch, seq_len), generator=gen)]
    start = (seq_len - n - 2) // 2
    ids_BS[:, start] = v.vision_start_token_id
    ids_BS[:, start + 1:start + 1 + n] = v.image_token_id
    c = v.config
    patch = c.get("in_channels", 3) * c.get("temporal_patch_size", 2) * c.get("patch_size", 14) ** 2
    pixels = torch.randn(batch * GRID[0] * GRID[1] * GRID[2], patch, generator=gen)
    return ids_BS, pixels, torch.tensor([GRID] * batch)


def vlm_forward(tower: torch.nn.Module, arch: HFArch, ids_BS: torch.Tensor, pixels: torch.Tensor,
                grid_N3: torch.Tensor) -> Callable[[Any, torch.Tensor, Any], Any]:
    """``forward(model, ids, mask)`` for ``verify``'s Megatron pass: each chunk run with the image features in its
    first stage's embeddings and the rows' multimodal positions."""
    from hybridrl.megatron.model import unwrap_model

    v = arch.vision
    assert v is not None
    b, s = ids_BS.shape
    positions = batch_positions(ids_BS, torch.full((b,), s), grid_N3, arch)

    def forward(model: Any, ids: torch.Tensor, mask: Any) -> Any:
        gpt = unwrap_model(model)
        dec = decoder_input(gpt, tower, ids, pixels, grid_N3, arch) if gpt.pre_process else None
        return model(ids, positions, mask, decoder_input=dec)

    return forward


def hf_vlm_logits(model_dir: Path, arch: HFArch, ids_BS: torch.Tensor, pixels: torch.Tensor,
                  grid_N3: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForImageTextToText

    assert arch.vision is not None
    with transformers_rope_rules():  # hybridrl.vlm.sglang_compat
        hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return hf.eval()(input_ids=ids_BS, pixel_values=pixels, image_grid_thw=grid_N3,
                         mm_token_type_ids=(ids_BS == arch.vision.image_token_id).int()).logits
