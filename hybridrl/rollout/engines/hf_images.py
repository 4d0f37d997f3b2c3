"""The ``hf`` engine's vision-language side (Qwen2.5-VL, Qwen3-VL; issue 46): loading the model, and what a prompt's
images change in its prefill.

    h[ids == image_token_id] = model.get_image_features(pixel_values, image_grid_thw)   merged patches, image order
    Qwen3-VL: h[ids == image_token_id] += its DeepStack features, after each of decoder layers 0 … k-1
    position ids [3, B, P]   = mrope_positions(ids, grid_thw)          (time, height, width); text alone: (p, p, p)
    generated token k        = (q + k) on all three axes, q = 1 + the prompt's largest id

which is what transformers' ``Qwen2_5_VLModel`` and ``Qwen3VLModel`` compute (their ``get_rope_index`` and
``rope_deltas``: q is the prompt's length plus its delta). The engine runs the vision tower itself, once per prompt,
and hands its output to the prefill (``mm_encoder_outputs``): transformers places the features (and DeepStack's) at
the placeholders. The engine passes the position ids itself, so the model's ``rope_deltas`` — state it keeps between
calls, one delta per row of the batch that set it — is never read: the engine's rows come and go (a prefill once per
prompt, finished rows dropped) and would not line up with it.

Left padding: a padded position gets ids 0 and is masked by the attention mask (transformers builds the mask from
it, not from the position ids, when they have three rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from hybridrl.hf.arch import CONFIG_FILE
from hybridrl.hf.vlm import VLM_FAMILIES, VisionSpec, checkpoint_vision
from hybridrl.vlm.inputs import ImageInputs, stack_images
from hybridrl.vlm.positions import mrope_positions
from hybridrl.vlm.sglang_compat import transformers_rope_rules

Images = Sequence[ImageInputs | None]  # one entry per prompt of a generate call


def load_model(model_path: str, dtype: torch.dtype) -> tuple[Any, VisionSpec | None]:
    """The rollout model (a vision-language checkpoint, :data:`~hybridrl.hf.vlm.VLM_FAMILIES`, as transformers'
    image-text-to-text model) and its vision spec (None: a causal LM)."""
    spec = checkpoint_vision(model_path) if (Path(model_path) / CONFIG_FILE).is_file() else None
    if spec is None:
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype), None
    with transformers_rope_rules():  # its vision tower's axial RoPE, even after SGLang's import (vlm.sglang_compat)
        return AutoModelForImageTextToText.from_pretrained(model_path, dtype=dtype), spec


def check_images(images: Images | None, n_prompts: int, spec: VisionSpec | None, model_path: str) -> None:
    """Raise ValueError unless ``images`` has one entry per prompt and, where any is set, the model takes images."""
    if images is None:
        return
    if len(images) != n_prompts:
        raise ValueError(f"hf engine: {len(images)} image entries for {n_prompts} prompts (one per prompt, None for a "
                         "prompt without images)")
    if spec is None and any(x is not None and x.num_images for x in images):
        raise ValueError(f"hf engine: a prompt has images but the rollout model ({model_path}) is a text-only causal "
                         f"LM; a vision-language one is one of {', '.join(VLM_FAMILIES)}")


def _image(images: Images | None, i: int) -> ImageInputs | None:
    x = images[i] if images is not None else None
    return x if x is not None and x.num_images else None


def row_positions(rows: Sequence[tuple[int, list[int]]], images: Images | None, spec: VisionSpec,
                  P: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``([3, B, P] position ids of the left-padded rows (padding: 0), [B] each row's next position)``; ``rows``:
    (prompt index, prompt ids) of each row, a prompt's images ``images[prompt index]``."""
    pos_3BP = torch.zeros(3, len(rows), P, dtype=torch.long)
    seen: dict[int, torch.Tensor] = {}
    for b, (i, ids) in enumerate(rows):
        if i not in seen:
            image = _image(images, i)
            try:
                seen[i] = mrope_positions(torch.tensor(ids), None if image is None else image.image_grid_thw, spec)
            except ValueError as e:
                raise ValueError(f"hf engine: prompt {i}'s image placeholders do not match its images: {e}") from None
        pos_3BP[:, b, P - len(ids):] = seen[i]
    return pos_3BP, pos_3BP.amax(dim=(0, 2)) + 1


@torch.no_grad()
def prefill_images(model: Any, owners: Sequence[int], images: Images | None) -> dict[str, Any]:
    """The prefill's image inputs for rows of prompts ``owners`` (row u a sample of prompt ``owners[u]``):
    ``{"mm_encoder_outputs": {"image": the vision tower's output}}`` with each row's images' features in row order
    (transformers places them at the rows' placeholders, and Qwen3-VL's DeepStack features after its first decoder
    layers), or {} when no row has an image. The vision tower runs once per distinct prompt."""
    distinct = list(dict.fromkeys(i for i in owners if _image(images, i) is not None))
    if not distinct:
        return {}
    assert images is not None
    stacked = stack_images([images[i] for i in distinct])
    assert stacked is not None
    device = model.device
    out = model.get_image_features(stacked.pixel_values.to(device), stacked.image_grid_thw.to(device))
    first, slots = 0, {}  # prompt → its images' indices among the tower's outputs
    for i in distinct:
        n = images[i].num_images  # type: ignore[union-attr]  # distinct holds prompts with images only
        slots[i] = range(first, first + n)
        first += n
    order = [k for i in owners if i in slots for k in slots[i]]  # a prompt's images again for each of its rows
    out.pooler_output = [out.pooler_output[k] for k in order]
    if getattr(out, "deepstack_features", None):  # Qwen3-VL: one per DeepStack layer, each split per image
        out.deepstack_features = [[layer[k] for k in order] for layer in out.deepstack_features]
    return {"mm_encoder_outputs": {"image": out}}
