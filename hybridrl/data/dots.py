"""A synthetic vision task made here: count the dots in a small image (``<image>How many dots?`` → ``7``).

Each image is a ``size``×``size`` white canvas with ``min_dots``..``max_dots`` black dots of radius ``radius``
at seeded positions, no two touching and none cut by the border; the count is uniform over its range. Rows are
in verl's multimodal layout (:mod:`hybridrl.data.multimodal`): ``prompt`` (one user message holding the
``<image>`` placeholder), ``images`` (``[{"bytes": PNG, "path": None}]``), ``ground_truth`` (the count as a
string) and ``data_source``. The same config gives the same rows, pixel for pixel; train and test images differ
(no dot layout occurs twice).
"""

from __future__ import annotations

import io
import os
import random
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

from hybridrl.data.images import IMAGE_PLACEHOLDER
from hybridrl.data.rows import Row, write_rows

MAX_TRIES = 10_000  # dot placements tried per image before the canvas is called too small


@dataclass(slots=True, kw_only=True, frozen=True)
class DotsTaskConfig:
    num_train: int = 1000
    num_test: int = 100
    min_dots: int = 1
    max_dots: int = 9
    size: int = 56  # pixels per side (56 × 56: 4 image tokens for the tiny Qwen2.5-VL)
    radius: int = 3
    seed: int = 0
    template: str = f"{IMAGE_PLACEHOLDER}How many dots?"  # must hold one <image>
    data_source: str = "dots"

    def __post_init__(self) -> None:
        if not 1 <= self.min_dots <= self.max_dots:
            raise ValueError(f"min_dots={self.min_dots}, max_dots={self.max_dots}: need 1 <= min_dots <= max_dots")
        if self.num_train < 0 or self.num_test < 0:
            raise ValueError(f"num_train={self.num_train}, num_test={self.num_test} must be >= 0")
        if self.template.count(IMAGE_PLACEHOLDER) != 1:
            raise ValueError(f"template={self.template!r} must hold {IMAGE_PLACEHOLDER} once")
        if self.radius < 1 or self.size < 4 * self.radius:
            raise ValueError(f"radius={self.radius}, size={self.size}: need radius >= 1 and size >= 4 × radius")


def draw_dots(centers: list[tuple[int, int]], *, size: int, radius: int) -> Image.Image:
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    for x, y in centers:
        draw.ellipse((x - radius, y - radius, x + radius, y + radius), fill="black")
    return image


def dots_splits(config: DotsTaskConfig) -> tuple[list[Row], list[Row]]:
    """``(train_rows, test_rows)`` (module docstring)."""
    rng = random.Random(config.seed)
    seen: set[tuple[tuple[int, int], ...]] = set()
    rows: list[Row] = []
    while len(rows) < config.num_train + config.num_test:
        centers = _place(rng.randint(config.min_dots, config.max_dots), rng, config)
        if (layout := tuple(sorted(centers))) in seen:
            continue
        seen.add(layout)
        buffer = io.BytesIO()
        draw_dots(centers, size=config.size, radius=config.radius).save(buffer, format="PNG")
        rows.append({
            "prompt": [{"role": "user", "content": config.template}],
            "images": [{"bytes": buffer.getvalue(), "path": None}],
            "ground_truth": str(len(centers)),
            "data_source": config.data_source,
        })
    return rows[: config.num_train], rows[config.num_train:]


def write_dots_splits(out_dir: str | os.PathLike[str], config: DotsTaskConfig) -> dict[str, Path]:
    """Write ``train.parquet`` and ``test.parquet`` to ``out_dir``; return ``{"train": path, "test": path}``."""
    train, test = dots_splits(config)
    out = Path(out_dir)
    return {"train": write_rows(train, out / "train.parquet"), "test": write_rows(test, out / "test.parquet")}


def _place(n: int, rng: random.Random, config: DotsTaskConfig) -> list[tuple[int, int]]:
    """``n`` dot centres, at least one pixel apart edge to edge and ``radius + 1`` from the border."""
    r, gap = config.radius, 2 * config.radius + 2
    centers: list[tuple[int, int]] = []
    for _ in range(MAX_TRIES):
        if len(centers) == n:
            return centers
        x, y = rng.randint(r + 1, config.size - r - 2), rng.randint(r + 1, config.size - r - 2)
        if all((x - a) ** 2 + (y - b) ** 2 >= gap * gap for a, b in centers):
            centers.append((x, y))
    if len(centers) == n:
        return centers
    raise ValueError(f"cannot place {n} dots of radius {r} apart on a {config.size}-pixel canvas; raise size or "
                     "lower max_dots")
