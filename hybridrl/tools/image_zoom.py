"""``image_zoom_in``: verl's ``ImageZoomInTool`` (its geo3k-style multi-turn recipes; the policy calls it by verl's
schema name, ``image_zoom_in_tool``) — the policy names a box of the sample's image and gets the crop back as an
image, with verl's line of text.

Arguments: ``bbox_2d`` = [x1, y1, x2, y2] in the image's pixels (x right, y down; x2, y2 exclusive), ``label`` (an
optional name of what is in it, echoed back). The box is clipped to the image; a crop with a side under
``min_side`` pixels (the processor's smallest image: patch size × merge size, 28 for Qwen2.5-VL) is resized up,
keeping its aspect ratio, to have that side. The image is the sample's ``image_index``-th (0: the prompt's first),
through :class:`~hybridrl.interfaces.ToolSample` (``takes_sample``).

Departures from verl: verl grows a small box around its centre to 28 pixels before cropping; this resizes the crop
instead (the same size, without reading pixels outside the box). verl's image is its row's
``tools_kwargs.image_zoom_in_tool.create_kwargs.image`` (the prompt's image in its geo3k data); here it is the
sample's own. A bad box — not four numbers, x2 ≤ x1 or y2 ≤ y1
after clipping, outside the image, or an aspect ratio over ``max_aspect_ratio`` (Qwen's processor refuses more than
200) — raises ``ValueError`` saying what is wrong; the rollout turns it into an error observation for the policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from hybridrl.interfaces import ToolResult, ToolSample


class ImageZoomIn:
    """``image_zoom_in`` tool (schema name ``image_zoom_in_tool``): ``{"bbox_2d": [10, 20, 60, 80], "label": "cat"}``
    → the crop, and a line of text."""

    takes_sample: ClassVar[bool] = True

    @dataclass(slots=True, kw_only=True)
    class Config:
        min_side: int = 28  # pixels: a smaller crop is resized up to it (the processor's patch size × merge size)
        max_aspect_ratio: float = 100.0  # longer side / shorter side of the crop at most (verl's limit)
        image_index: int = 0  # which of the sample's images is zoomed (0: the prompt's first)

        def __post_init__(self) -> None:
            if self.min_side < 1:
                raise ValueError(f"min_side={self.min_side} must be ≥ 1 (pixels)")
            if not self.max_aspect_ratio >= 1:
                raise ValueError(f"max_aspect_ratio={self.max_aspect_ratio} must be ≥ 1")
            if self.image_index < 0:
                raise ValueError(f"image_index={self.image_index} must be ≥ 0")

    schema: ClassVar[dict[str, Any]] = {"type": "function", "function": {
        "name": "image_zoom_in_tool",  # verl's
        "description": ("Zoom in on a specific region of an image by cropping it based on a bounding box (bbox) and an "
                        "optional object label."),
        "parameters": {"type": "object", "properties": {
            "bbox_2d": {"type": "array", "items": {"type": "number"}, "minItems": 4, "maxItems": 4,
                        "description": ("The bounding box of the region to zoom in, as [x1, y1, x2, y2], where "
                                        "(x1, y1) is the top-left corner and (x2, y2) is the bottom-right corner.")},
            "label": {"type": "string",
                      "description": "The name or label of the object in the specified bounding box (optional)."}},
            "required": ["bbox_2d"]}}}

    def __init__(self, config: ImageZoomIn.Config | None = None, **ctx: Any) -> None:
        self.config = config if config is not None else self.Config()

    def __call__(self, arguments: dict[str, Any], *, sample: ToolSample) -> ToolResult:
        if extra := sorted(set(arguments) - {"bbox_2d", "label"}):
            raise ValueError(f"image_zoom_in_tool takes bbox_2d and label; got unknown arguments {extra}")
        box, label = arguments.get("bbox_2d"), arguments.get("label")
        if label is not None and not isinstance(label, str):
            raise ValueError(f"label must be a string, got {label!r}")
        i = self.config.image_index
        if len(sample.images) <= i:
            raise ValueError(f"this sample has {len(sample.images)} image(s); image_zoom_in_tool zooms image {i} "
                             "(tool_kwargs.image_zoom_in.image_index)")
        image = sample.images[i]
        x1, y1, x2, y2 = self.box(box, width=image.width, height=image.height)
        crop = image.crop((x1, y1, x2, y2)).convert("RGB")
        crop = self.resized(crop)
        named = f" with label {label}" if label else ""  # verl's text, with the box as the policy wrote it
        return ToolResult(text=f"Zoomed in on the image to the region {list(box)}{named}.", images=[crop])

    def box(self, box: Any, *, width: int, height: int) -> tuple[int, int, int, int]:
        """``bbox_2d`` checked and clipped to a ``width``×``height`` image, as integer pixels."""
        if not (isinstance(box, list | tuple) and len(box) == 4
                and all(isinstance(v, int | float) and not isinstance(v, bool) for v in box)):
            raise ValueError(f"bbox_2d must be four numbers [x1, y1, x2, y2] in pixels, got {box!r}")
        x1, y1 = max(round(box[0]), 0), max(round(box[1]), 0)
        x2, y2 = min(round(box[2]), width), min(round(box[3]), height)
        if x2 <= x1 or y2 <= y1:
            raise ValueError(f"bbox_2d {list(box)} holds no pixel of the {width}×{height} image: it needs "
                             f"0 ≤ x1 < x2 ≤ {width} and 0 ≤ y1 < y2 ≤ {height}")
        ratio = max(x2 - x1, y2 - y1) / min(x2 - x1, y2 - y1)
        if ratio > self.config.max_aspect_ratio:
            raise ValueError(f"bbox_2d {list(box)} is {x2 - x1}×{y2 - y1} pixels: an aspect ratio of {ratio:.0f}, "
                             f"over {self.config.max_aspect_ratio:g}")
        return x1, y1, x2, y2

    def resized(self, crop: Any) -> Any:
        """``crop`` scaled up (aspect ratio kept) so that its shorter side is at least ``min_side``."""
        short = min(crop.width, crop.height)
        if short >= self.config.min_side:
            return crop
        scale = self.config.min_side / short
        return crop.resize((max(round(crop.width * scale), self.config.min_side),
                            max(round(crop.height * scale), self.config.min_side)))
