"""Prompts with images, in verl's multimodal parquet layout, tokenized by a vision-language model's processor.

Row layout (verl's; what ``hybridrl prepare multimodal`` and :mod:`hybridrl.data.dots` write):

- ``prompt``: chat messages whose string contents hold one ``<image>`` placeholder per image, in order (a plain
  string is one user message);
- ``images`` (``data.image_key``): a list whose entries are ``{"bytes": ...}`` (verl's geo3k, HF ``datasets``'
  Image feature), ``{"path": ...}``, a plain path string, or a PIL image; bytes win over a path when an entry has
  both. A relative path is taken from the data file's directory;
- ``ground_truth`` (or ``reward_model.ground_truth`` with ``data.ground_truth_key``), ``data_source``, other
  columns: as for :class:`hybridrl.data.dataset.PromptDataset`.

A prompt is rendered by the processor's chat template with each ``<image>`` replaced by an image content part
(``{"type": "image"}``; the text around it stays a text part), then the processor expands each image's pad token
to its number of tokens, so ``data.max_prompt_length`` counts the image tokens: a prompt over it is dropped
(``data.filter_overlong_prompts``, the default) or an error (``data.truncation=error``); cutting it is refused, as
a cut would split an image's tokens. The number of placeholders must equal the number of images, and every image
must open: either mistake is an error naming the file and row.

Each row is tokenized (its images decoded and resized) once when the dataset is built, to count its tokens; the
pixels are computed again when the row is drawn (:class:`MultimodalPromptItem`) rather than held for every row.
Videos are not read yet (``<video>`` is an error).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import ProcessorMixin

from hybridrl.config.errors import DataError
from hybridrl.data.dataset import PromptDataset, PromptDatasetConfig, PromptItem
from hybridrl.data.images import (
    IMAGE_PLACEHOLDER,
    VIDEO_PLACEHOLDER,
    count_placeholders,
    image_messages,
    load_image,
)
from hybridrl.data.rows import Row
from hybridrl.vlm.inputs import ImageInputs


@dataclass(slots=True, kw_only=True)
class MultimodalDatasetConfig(PromptDatasetConfig):
    image_key: str = "images"  # verl's data.image_key: the column holding a row's images


@dataclass(slots=True, kw_only=True, frozen=True)
class MultimodalPromptItem(PromptItem):
    """A prompt with its images: ``prompt_ids`` hold each image's ``<|image_pad|>`` tokens, expanded."""

    images: list[Image.Image]  # [n_images] RGB, as read (an engine that runs its own processor takes these)
    pixel_values: torch.Tensor  # [Σ grid_t·grid_h·grid_w, C·temporal_patch·patch²] float32, every image's patches
    image_grid_thw: torch.Tensor  # [n_images, 3] long: (t, h, w) patches of each image


@dataclass(slots=True, kw_only=True, frozen=True)
class EncodedPrompt:
    input_ids: list[int]
    images: list[Image.Image]
    pixel_values: torch.Tensor  # [patches, C·T·P²], empty [0, 0] without images
    image_grid_thw: torch.Tensor  # [n_images, 3], empty [0, 3] without images


def encode_prompt(processor: ProcessorMixin, messages: list[dict[str, Any]], images: Sequence[Any], *,
                  base_dir: Path | None, where: str, image_key: str = "images",
                  tools: list[dict[str, Any]] | None = None) -> EncodedPrompt:
    """Messages with ``<image>`` placeholders and their images → the processor's ids and pixels (module docstring)."""
    if (videos := count_placeholders(messages, VIDEO_PLACEHOLDER)):
        raise DataError(f"{where}: the prompt has {videos} {VIDEO_PLACEHOLDER} placeholders; videos are not "
                        "supported yet")
    if (n := count_placeholders(messages)) != len(images):
        raise DataError(f"{where}: the prompt has {n} {IMAGE_PLACEHOLDER} placeholders but {image_key!r} "
                        f"(data.image_key) holds {len(images)} images; each image needs one {IMAGE_PLACEHOLDER} "
                        "in the prompt, in order")
    read = [load_image(entry, base_dir=base_dir, where=f"{where}, image {i} of {image_key!r}")
            for i, entry in enumerate(images)]
    text = processor.apply_chat_template(image_messages(messages), tools=tools, add_generation_prompt=True,
                                         tokenize=False)
    out = processor(text=[text], images=read or None, return_tensors="pt")
    return EncodedPrompt(input_ids=out["input_ids"][0].tolist(), images=read,
                         pixel_values=out["pixel_values"] if read else torch.zeros(0, 0),
                         image_grid_thw=out["image_grid_thw"] if read else torch.zeros(0, 3, dtype=torch.long))


class MultimodalPromptDataset(PromptDataset):
    """:class:`PromptDataset` over rows with images: its length filter counts the image tokens, and an item is a
    :class:`MultimodalPromptItem` (its ``meta.messages`` carry image parts; the image column is left out of
    ``meta.extra``)."""

    def __init__(self, files: Sequence[str | os.PathLike[str]], *, config: MultimodalDatasetConfig,
                 processor: ProcessorMixin) -> None:
        if not config.filter_overlong_prompts and config.truncation != "error":
            raise ValueError(f"data.truncation={config.truncation!r} would cut a prompt's image tokens; with images "
                             "set data.filter_overlong_prompts=true (drop long prompts) or data.truncation=error")
        if not config.apply_chat_template:
            raise ValueError("data.apply_chat_template=false: prompts with images are rendered by the processor's "
                             "chat template; set it true")
        self.processor = processor
        self.image_config = config
        super().__init__(files, config=config, tokenizer=processor.tokenizer)  # type: ignore[attr-defined]

    def _encode(self, where: str, row: Row) -> EncodedPrompt:
        prompt = row.get(self.config.prompt_key)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages)):
            raise DataError(f"{where}: {self.config.prompt_key!r} (data.prompt_key) must be a string or a list of "
                            f"{{'role', 'content'}} messages with string contents, got {prompt!r:.80}")
        images = row.get(self.image_config.image_key)
        images = [] if images is None else images
        if not isinstance(images, list | tuple | np.ndarray):
            raise DataError(f"{where}: {self.image_config.image_key!r} (data.image_key) must be a list of images, "
                            f"got {type(images).__name__}")
        source = where.rpartition(" row ")[0]  # PromptDataset names a row "<file> row <n>"
        return encode_prompt(self.processor, messages, list(images), base_dir=Path(source).parent, where=where,
                             image_key=self.image_config.image_key, tools=list(self.config.tools) or None)

    def _item(self, where: str, stem: str, row: Row) -> PromptItem:
        meta = self._meta(where, stem, row)  # first: a missing prompt or ground truth is PromptDataset's error
        return PromptItem(prompt_ids=self._encode(where, row).input_ids, meta=meta)

    def __getitem__(self, index: int) -> MultimodalPromptItem:
        item = super().__getitem__(index)
        g = int(self.rows[index % len(self)])
        t = int(np.searchsorted(self._starts, g, side="right")) - 1
        table, row_no = self.tables[t], g - int(self._starts[t])
        where = f"{table.source} row {row_no}"
        encoded = self._encode(where, table.row(row_no))
        assert encoded.input_ids == item.prompt_ids, (
            f"{where}: the processor's tokens changed since the dataset was built")
        extra = {k: v for k, v in item.meta.extra.items() if k != self.image_config.image_key}
        inputs = ImageInputs(pixel_values=encoded.pixel_values, image_grid_thw=encoded.image_grid_thw,
                             images=encoded.images) if encoded.images else None
        return MultimodalPromptItem(prompt_ids=item.prompt_ids, meta=replace(item.meta, extra=extra, images=inputs),
                                    images=encoded.images, pixel_values=encoded.pixel_values,
                                    image_grid_thw=encoded.image_grid_thw)

    @staticmethod
    def _messages(prompt: Any) -> list[dict[str, Any]] | None:
        messages = PromptDataset._messages(prompt)
        return image_messages(messages) if messages is not None else None
