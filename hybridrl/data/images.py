"""A row's images: verl's ``<image>`` placeholders, image entries read as PIL images, entries embedded for parquet.

PIL only (no torch, no transformers), so ``hybridrl prepare`` and the data tasks stay light; the processor side is
:mod:`hybridrl.data.multimodal`, whose docstring describes the row layout.
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

from hybridrl.config.errors import DataError

IMAGE_PLACEHOLDER = "<image>"  # verl's, in a row's prompt
VIDEO_PLACEHOLDER = "<video>"
_PLACEHOLDERS = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})")


def image_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages whose string contents hold ``<image>`` → content parts (``{"type": "image"}`` in each placeholder's
    place, ``{"type": "text", "text": ...}`` around it), as verl builds them; other contents are left as they are."""
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, str) and IMAGE_PLACEHOLDER in content:
            parts = [{"type": "image"} if piece == IMAGE_PLACEHOLDER else {"type": "text", "text": piece}
                     for piece in _PLACEHOLDERS.split(content) if piece]
            message = {**message, "content": parts}
        out.append(message)
    return out


def count_placeholders(messages: list[dict[str, Any]], placeholder: str = IMAGE_PLACEHOLDER) -> int:
    return sum(m["content"].count(placeholder) for m in messages if isinstance(m.get("content"), str))


def load_image(entry: Any, *, base_dir: Path | None, where: str) -> Image.Image:
    """One entry of a row's image list (module docstring) as an RGB image; :class:`DataError` naming ``where``."""
    data: bytes | None = None
    path: str | None = None
    if isinstance(entry, Image.Image):
        return entry.convert("RGB")
    if isinstance(entry, dict):
        data, path = entry.get("bytes"), entry.get("path")
    elif isinstance(entry, str | os.PathLike):
        path = str(entry)
    elif isinstance(entry, bytes):
        data = entry
    if data is None and not path:
        raise DataError(f"{where}: expected {{'bytes': ...}}, {{'path': ...}} or a path, got "
                        f"{type(entry).__name__} {entry!r:.80}")
    if data is not None:
        what, source = f"{len(data)} bytes", io.BytesIO(data)
    else:
        file = Path(str(path).removeprefix("file://")).expanduser()
        if not file.is_absolute() and base_dir is not None:
            file = base_dir / file
        what, source = f"file {file}", file  # type: ignore[assignment]
    try:
        with Image.open(source) as image:
            return image.convert("RGB")
    except (OSError, UnidentifiedImageError, ValueError) as e:
        raise DataError(f"{where}: cannot read the image ({what}): {type(e).__name__}: {e}") from None


def embed_images(entries: Any, *, base_dir: Path | None, where: str, image_key: str) -> list[dict[str, Any]]:
    """A source row's images as verl's parquet holds them: ``{"bytes": ..., "path": ...}`` with the file's own
    bytes (a PIL image or undecodable entry: PNG bytes of what it shows); each is checked to open."""
    if entries is None:
        return []
    if isinstance(entries, str | dict | bytes | Image.Image):
        entries = [entries]
    out = []
    for i, entry in enumerate(entries):
        here = f"{where}, image {i} of {image_key!r}"
        image = load_image(entry, base_dir=base_dir, where=here)  # opens it: an unreadable image fails here
        path = entry.get("path") if isinstance(entry, dict) else str(entry) if isinstance(entry, str) else None
        data = entry.get("bytes") if isinstance(entry, dict) else entry if isinstance(entry, bytes) else None
        if data is None and path is not None:
            file = Path(path.removeprefix("file://")).expanduser()
            data = (file if file.is_absolute() or base_dir is None else base_dir / file).read_bytes()
        if data is None:
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            data = buffer.getvalue()
        out.append({"bytes": data, "path": path})
    return out
