"""The images of a multi-turn episode's tool results (issue 46), as a vision-language policy reads them.

A tool message with images renders through the chat template with one image part per image, before its text
(verl's tool messages: ``{"role": "tool", "content": [{"type": "image"}, ..., {"type": "text", "text": ...}]}``);
the template writes one ``<|image_pad|>`` per image, which the processor would expand to the image's
``t·h·w / merge²`` placeholders. :class:`ToolImages` does exactly that to a turn's appended ids: the processor's
image processor gives each image's patches and grid (:class:`~hybridrl.vlm.inputs.ImageInputs`, the same settings
as the prompts'), and each ``<|image_pad|>`` id of the appended ids, in order, becomes its run. The episode's
images then grow by these, after the prompt's and the earlier results' — the order of their placeholders in the
sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridrl.vlm.inputs import ImageInputs


def image_message(text: str, images: Sequence[Any], *, role: str = "tool") -> dict[str, Any]:
    """A message of ``images`` then ``text`` (a plain string content where there is no image)."""
    if not images:
        return {"role": role, "content": text}
    return {"role": role, "content": [*({"type": "image"} for _ in images), {"type": "text", "text": text}]}


class ToolImages:
    """A VLM processor's view of tool-result images: their patches, and the placeholder runs they take."""

    def __init__(self, processor: Any, *, image_token_id: int, merge_size: int) -> None:
        self.image_processor = processor.image_processor
        self.image_token_id, self.merge = image_token_id, merge_size

    def encode(self, images: Sequence[Any]) -> ImageInputs:
        """The processor's patches and grids of ``images`` (PIL, RGB), in order."""
        out = self.image_processor(images=list(images), return_tensors="pt")
        return ImageInputs(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"].long(),
                           images=list(images))

    def expand(self, ids: Sequence[int], inputs: ImageInputs) -> list[int]:
        """``ids`` with its k-th ``<|image_pad|>`` id expanded to image k's run (one id per merged patch); ``ids``
        must hold exactly one per image."""
        runs = [int(t * h * w) // self.merge**2 for t, h, w in inputs.image_grid_thw.tolist()]
        at = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(at) != len(runs):
            raise ValueError(f"the rendered tool message holds {len(at)} image placeholder(s) for {len(runs)} "
                             "image(s): the chat template must write one <|image_pad|> per image part")
        out: list[int] = []
        start = 0
        for i, n in zip(at, runs, strict=True):
            out += [*ids[start:i], *[self.image_token_id] * n]
            start = i + 1
        return out + list(ids[start:])

    def runs(self, ids: Sequence[int]) -> list[tuple[int, int]]:
        """``(start, length)`` of each run of placeholder ids in ``ids``, in order."""
        out: list[tuple[int, int]] = []
        for i, t in enumerate(ids):
            if t == self.image_token_id:
                if i and ids[i - 1] == t:
                    out[-1] = (out[-1][0], out[-1][1] + 1)
                else:
                    out.append((i, 1))
        return out


def first_images(inputs: ImageInputs, k: int) -> ImageInputs | None:
    """The first ``k`` images of ``inputs`` (None: k = 0)."""
    if k == 0:
        return None
    patches = int(inputs.image_grid_thw[:k].prod(-1).sum())
    return ImageInputs(pixel_values=inputs.pixel_values[:patches], image_grid_thw=inputs.image_grid_thw[:k],
                       images=list(inputs.images[:k]))
