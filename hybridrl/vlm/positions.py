"""Multimodal RoPE positions of one sequence (Qwen2-VL / Qwen2.5-VL; Wang et al. 2024, "Qwen2-VL", §2.1).

Each position has three ids (time, height, width):

    text token         all three = p, the running position, which then advances by 1
    image (T×H×W patches, merged m×m into (H/m)·(W/m) tokens per frame, frames t < T):
                       (p + t, p + h, p + w) for the token at frame t, row h, column w of the merged grid;
                       p then advances by max(H, W) / m

A sequence of text alone gets (p, p, p) at every token — plain RoPE. The image's own tokens are its
``image_token_id`` placeholders, (T·H·W)/m² of them in a row, in the order of ``image_grid_thw``'s rows.

Deviation: videos (time ids spaced by ``tokens_per_second``) are not handled — a sequence with a video placeholder
is refused (one the policy sampled is a text token, as any sampled id). The rule is transformers 5's
``Qwen2_5_VLModel.get_rope_index`` (the advance after an image is max(H, W)/m, which equals the older "largest id +
1" for an image), checked against it in ``tests/vlm``; ``images_S`` plays its ``mm_token_type_ids``.
"""

from __future__ import annotations

import torch

from hybridrl.hf.vlm import VisionSpec


def mrope_positions(ids_S: torch.Tensor, grid_thw_N3: torch.Tensor | None, spec: VisionSpec,
                    images_S: torch.Tensor | None = None) -> torch.Tensor:
    """``[3, S]`` position ids of one sequence's real tokens ``ids_S``; ``grid_thw_N3``: its images' patch grids, one
    row per image in order (None: no image); ``images_S``: where a placeholder id is an image (None: everywhere;
    elsewhere it is a text token — one the policy sampled)."""
    slots_S = torch.ones_like(ids_S, dtype=torch.bool) if images_S is None else images_S.to(ids_S.device)
    if spec.video_token_id is not None and bool(((ids_S == spec.video_token_id) & slots_S).any()):
        raise NotImplementedError("a video in a VLM sample: only images are supported (time ids per video frame are "
                                  "not computed)")
    is_image = ((ids_S == spec.image_token_id) & slots_S).tolist()
    grids = [] if grid_thw_N3 is None else [tuple(int(x) for x in row) for row in grid_thw_N3.tolist()]
    m = spec.spatial_merge_size
    out = torch.empty(3, len(is_image), dtype=torch.long)
    p, i, image = 0, 0, 0
    while i < len(is_image):
        if not is_image[i]:
            out[:, i] = p
            p, i = p + 1, i + 1
            continue
        if image >= len(grids):
            raise ValueError(f"token {i} is an image placeholder beyond the {len(grids)} image(s) of image_grid_thw")
        t, h, w = grids[image]
        n = t * (h // m) * (w // m)
        if is_image[i:i + n] != [True] * n:
            raise ValueError(f"image {image} (grid {t}×{h}×{w}, merge {m}) needs {n} placeholder tokens in a row from "
                             f"token {i}")
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h // m), torch.arange(w // m), indexing="ij")
        out[:, i:i + n] = torch.stack([tt, hh, ww]).reshape(3, -1) + p
        p, i, image = p + max(h, w) // m, i + n, image + 1
    if image != len(grids):
        raise ValueError(f"{len(grids)} image grid(s) but {image} image(s) of placeholders in the sequence")
    return out
