"""``image_zoom_in`` (verl's ``ImageZoomInTool``, schema name ``image_zoom_in_tool``): it crops the sample's image to
``bbox_2d``, resizes a small crop up to ``min_side``, and names what is wrong with a bad box; it is an installed tool
like the others."""

from __future__ import annotations

from typing import Any

import pytest
from PIL import Image

from hybridrl.batch import SampleMeta
from hybridrl.interfaces import ToolResult, ToolSample
from hybridrl.registry import Registry
from hybridrl.tools.image_zoom import ImageZoomIn


def _sample(*images: Image.Image) -> ToolSample:
    return ToolSample(meta=SampleMeta(ground_truth="", data_source="t"), create_kwargs={}, images=list(images))


def _gradient(width: int, height: int) -> Image.Image:
    image = Image.new("RGB", (width, height))
    image.putdata([(x % 256, y % 256, 7) for y in range(height) for x in range(width)])
    return image


def test_crops_the_box_and_resizes_a_small_crop_up() -> None:
    tool = Registry("tools").build("image_zoom_in", {"min_side": 28}, key="tool_kwargs.image_zoom_in")
    image = _gradient(100, 80)
    out = tool({"bbox_2d": [10, 20, 60, 70], "label": "dot"}, sample=_sample(image))
    assert isinstance(out, ToolResult) and len(out.images) == 1
    crop = out.images[0]
    assert crop.size == (50, 50) and crop.getpixel((0, 0)) == (10, 20, 7) and crop.getpixel((49, 49)) == (59, 69, 7)
    assert out.text == "Zoomed in on the image to the region [10, 20, 60, 70] with label dot."  # verl's text
    small = tool({"bbox_2d": [0, 0, 7, 14]}, sample=_sample(image)).images[0]
    assert small.size == (28, 56)  # shorter side up to min_side, aspect ratio kept
    clipped = tool({"bbox_2d": [90.4, -5, 500, 30]}, sample=_sample(image)).images[0]  # clipped to the image
    assert clipped.size == (28, 28 * 30 // 10) and clipped.getpixel((0, 0)) == (90, 0, 7)


def test_zooms_the_configured_image_of_the_sample() -> None:
    first, second = _gradient(40, 40), Image.new("RGB", (60, 60), (1, 2, 3))
    out = ImageZoomIn(ImageZoomIn.Config(image_index=1))({"bbox_2d": [0, 0, 30, 30]}, sample=_sample(first, second))
    assert out.images[0].getpixel((5, 5)) == (1, 2, 3)
    with pytest.raises(ValueError, match=r"this sample has 1 image\(s\); image_zoom_in_tool zooms image 1"):
        ImageZoomIn(ImageZoomIn.Config(image_index=1))({"bbox_2d": [0, 0, 30, 30]}, sample=_sample(first))


@pytest.mark.parametrize(("arguments", "message"), [
    ({"bbox_2d": [1, 2, 3]}, r"bbox_2d must be four numbers \[x1, y1, x2, y2\] in pixels, got \[1, 2, 3\]"),
    ({"bbox_2d": "0,0,5,5"}, r"bbox_2d must be four numbers"),
    ({"bbox_2d": [0, 0, True, 5]}, r"bbox_2d must be four numbers"),
    ({}, r"bbox_2d must be four numbers .* got None"),
    ({"bbox_2d": [30, 10, 20, 40]}, r"holds no pixel of the 100×80 image: it needs 0 ≤ x1 < x2 ≤ 100"),
    ({"bbox_2d": [200, 10, 300, 40]}, r"holds no pixel"),
    ({"bbox_2d": [0, 0, 100, 1]}, r"is 100×1 pixels: an aspect ratio of 100, over 50"),
    ({"bbox_2d": [0, 0, 9, 9], "label": 3}, r"label must be a string"),
    ({"bbox_2d": [0, 0, 9, 9], "zoom": 2}, r"takes bbox_2d and label; got unknown arguments \['zoom'\]"),
])
def test_a_bad_box_is_an_error_saying_what_is_wrong(arguments: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ImageZoomIn(ImageZoomIn.Config(max_aspect_ratio=50))(arguments, sample=_sample(_gradient(100, 80)))


def test_config_is_checked() -> None:
    for bad, key in (({"min_side": 0}, "min_side=0"), ({"max_aspect_ratio": 0.5}, "max_aspect_ratio=0.5"),
                     ({"image_index": -1}, "image_index=-1")):
        with pytest.raises(ValueError, match=key):
            ImageZoomIn.Config(**bad)


def test_the_plugin_contract_holds_with_an_image() -> None:
    from hybridrl.testing.agents import check_tool

    meta = SampleMeta(ground_truth="1", images=_inputs(_gradient(64, 48)))
    check_tool(ImageZoomIn, arguments=[{"bbox_2d": [4, 4, 40, 30], "label": "x"}, {"bbox_2d": [9, 9, 1, 1]}], meta=meta)


def _inputs(image: Image.Image) -> Any:
    import torch

    from hybridrl.vlm.inputs import ImageInputs

    return ImageInputs(pixel_values=torch.zeros(4, 1), image_grid_thw=torch.tensor([[1, 2, 2]]), images=[image])
