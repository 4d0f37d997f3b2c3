"""The tensors of a Hugging Face checkpoint: safetensors files, single or sharded (``model.safetensors.index.json``).

:func:`tensor_files`, :func:`checkpoint_shapes` (headers only) and :class:`SafetensorsReader` (lazy, sliced reads).
Importing this module imports neither torch nor transformers; the readers import what they need.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from hybridrl.hf.arch import INDEX_FILE, SINGLE_FILE, read_json

if TYPE_CHECKING:
    import torch


def tensor_files(model_dir: str | Path) -> dict[str, Path]:
    """HF tensor name -> safetensors file, from ``model.safetensors`` or its sharded index."""
    root = Path(model_dir)
    if (root / INDEX_FILE).is_file():
        weight_map = read_json(root / INDEX_FILE).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{root / INDEX_FILE}: no 'weight_map' object (tensor name -> file)")
        return {name: root / file for name, file in weight_map.items()}
    if (root / SINGLE_FILE).is_file():
        return dict.fromkeys(_header_shapes(root / SINGLE_FILE), root / SINGLE_FILE)
    raise FileNotFoundError(f"{root}: no {SINGLE_FILE} or {INDEX_FILE}; a HF checkpoint dir holds its "
                            "weights in one of them")


def checkpoint_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, from the safetensors headers only (no weights are read). With tied
    embeddings (no ``lm_head.weight``), ``lm_head.weight`` maps to the embedding's shape too."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(set(tensor_files(model_dir).values())):
        shapes.update(_header_shapes(file))
    if "model.embed_tokens.weight" in shapes:
        shapes.setdefault("lm_head.weight", shapes["model.embed_tokens.weight"])
    return shapes


def _header_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open  # the numpy framework reads headers without importing torch

    try:
        with safe_open(str(file), framework="numpy") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types (missing file, bad header)
        raise ValueError(f"{file}: not a readable safetensors file ({type(e).__name__}: {e})") from e


class SafetensorsReader:
    """Lazy, sliced reads from a (possibly sharded) safetensors checkpoint; a context manager."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.files = tensor_files(model_dir)
        self._stack = ExitStack()
        self._open: dict[Path, Any] = {}

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stack.close()

    def read(self, name: str, index: tuple[slice, ...] = ()) -> torch.Tensor:
        """The tensor ``name`` (only ``index`` of it when given: a slice per leading dim)."""
        if name not in self.files:
            raise KeyError(f"{self.model_dir}: the checkpoint has no tensor {name!r}")
        path = self.files[name]
        try:
            if path not in self._open:
                from safetensors import safe_open

                self._open[path] = self._stack.enter_context(safe_open(str(path), framework="pt"))
            handle = self._open[path]
            return handle.get_slice(name)[index] if index else handle.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types (missing file, bad header, bad data)
            raise ValueError(f"{path}: tensor {name!r} is not readable: not a usable safetensors file "
                             f"({type(e).__name__}: {e})") from e


