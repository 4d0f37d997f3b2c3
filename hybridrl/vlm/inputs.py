"""``ImageInputs``: a sample's images as the policy and the engines take them (issue 46).

A prompt's images travel with its sample (``SampleMeta.images``) from the dataset to the rollout engine (which
generates with them), the actor and the reference (whose first stage puts their features at the prompt's
``<|image_pad|>`` placeholders). Both forms are kept: the processor's patches for the models run here (Megatron,
``hf``), the decoded images for an engine that runs its own processor (vLLM, SGLang).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True, kw_only=True, frozen=True)
class ImageInputs:
    pixel_values: torch.Tensor  # [Σ t·h·w patches, C·temporal_patch·patch²] float32, every image's patches in order
    image_grid_thw: torch.Tensor  # [n_images, 3] long: (t, h, w) patches of each image
    images: list[Any] = field(default_factory=list)  # [n_images] the decoded PIL images (RGB), as read

    def __post_init__(self) -> None:
        g = self.image_grid_thw
        if g.dim() != 2 or g.shape[1] != 3:
            raise ValueError(f"image_grid_thw must be [n_images, 3], got {tuple(g.shape)}")
        patches = int(g.prod(-1).sum())
        if self.pixel_values.shape[0] != patches:
            raise ValueError(f"pixel_values has {self.pixel_values.shape[0]} patches, image_grid_thw "
                             f"{g.tolist()} needs {patches}")

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])


def stack_images(inputs: Sequence[ImageInputs | None]) -> ImageInputs | None:
    """One ``ImageInputs`` of several samples' images in sample order (None: no sample has one) — the form a
    batched vision tower takes."""
    present = [x for x in inputs if x is not None and x.num_images]
    if not present:
        return None
    return ImageInputs(pixel_values=torch.cat([x.pixel_values for x in present]),
                       image_grid_thw=torch.cat([x.image_grid_thw for x in present]),
                       images=[im for x in present for im in x.images])
