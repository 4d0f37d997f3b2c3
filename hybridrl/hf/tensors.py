"""The tensors of a Hugging Face checkpoint: safetensors files, single or sharded (``model.safetensors.index.json``).

:func:`tensor_files`, :func:`checkpoint_shapes` (headers only) and :class:`SafetensorsReader` (lazy, sliced reads;
block-wise FP8 weights, :mod:`hybridrl.hf.fp8`, come out dequantised).
Importing this module imports neither torch nor transformers; the readers import what they need.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from hybridrl.hf.arch import INDEX_FILE, SINGLE_FILE, read_json
from hybridrl.hf.fp8 import SCALE_SUFFIX

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
    for embedding in ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight"):  # causal LM, Qwen3-VL
        if embedding in shapes:
            shapes.setdefault("lm_head.weight", shapes[embedding])
    return shapes


def _header_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open  # the numpy framework reads headers without importing torch

    try:
        with safe_open(str(file), framework="numpy") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types (missing file, bad header)
        raise ValueError(f"{file}: not a readable safetensors file ({type(e).__name__}: {e})") from e


class SafetensorsReader:
    """Lazy, sliced reads from a (possibly sharded) safetensors checkpoint; a context manager.

    With ``fp8_blocks`` (the block shape of a block-wise FP8 checkpoint, ``HFArch.fp8_blocks``), a weight stored as
    e4m3 with a ``<name>_scale_inv`` beside it reads dequantised, float32: each block of the e4m3 values (as float32)
    times its block's scale (the last row and column blocks may be partial). The scales themselves are not listed in
    ``files``: whoever reads the checkpoint sees the model's weights only."""

    def __init__(self, model_dir: str | Path, *, fp8_blocks: tuple[int, int] | None = None) -> None:
        self.model_dir = Path(model_dir)
        files = tensor_files(model_dir)
        self.scales = {n.removesuffix(SCALE_SUFFIX): n for n in files if n.endswith(SCALE_SUFFIX)} if fp8_blocks else {}
        self.files = {n: f for n, f in files.items() if n not in self.scales.values()}
        self.fp8_blocks = fp8_blocks
        self._all = files
        self._stack = ExitStack()
        self._open: dict[Path, Any] = {}

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stack.close()

    def read(self, name: str, index: tuple[slice, ...] = ()) -> torch.Tensor:
        """The tensor ``name`` (only ``index`` of it when given: a slice per leading dim), dequantised when it is
        a block-wise FP8 weight."""
        if name not in self.files:
            raise KeyError(f"{self.model_dir}: the checkpoint has no tensor {name!r}")
        if name in self.scales:
            return self._dequantised(name, index)
        return self._raw(name, index)

    def _dequantised(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """``index`` of FP8 weight ``name``: the whole blocks that cover it are read and dequantised, then cut."""
        assert self.fp8_blocks is not None
        shape = self._shape(name)
        if len(shape) != 2:
            raise ValueError(f"{self.model_dir}: FP8 weight {name!r} has the shape {shape}; block-wise FP8 weights "
                             "are matrices")
        wide, cut = [], []  # per dim: the block-aligned slice read, the wanted part of it
        for dim, (size, block) in enumerate(zip(shape, self.fp8_blocks, strict=True)):
            start, stop, step = (index[dim] if dim < len(index) else slice(None)).indices(size)
            if step != 1:
                raise ValueError(f"{name}: a strided read ({index}) of an FP8 weight is not supported")
            first, last = start // block, -(-stop // block)  # the blocks [first, last) cover [start, stop)
            wide.append((first, last))
            cut.append(slice(start - first * block, stop - first * block))
        (r0, r1), (c0, c1) = wide
        (br, bc), scale_name = self.fp8_blocks, self.scales[name]
        if (got := self._shape(scale_name)) != (want := (-(-shape[0] // br), -(-shape[1] // bc))):
            raise ValueError(f"{self.model_dir}: {scale_name} has the shape {got}; {name} {shape} in {br}×{bc} "
                             f"blocks (config.json quantization_config.weight_block_size) needs {want}")
        weight = self._raw(name, (slice(r0 * br, r1 * br), slice(c0 * bc, c1 * bc))).float()
        scale = self._raw(scale_name, (slice(r0, r1), slice(c0, c1))).float()
        scale = scale.repeat_interleave(br, 0)[:weight.shape[0]].repeat_interleave(bc, 1)[:, :weight.shape[1]]
        return (weight * scale)[cut[0], cut[1]]

    def _shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def _handle(self, name: str) -> Any:
        path = self._all[name]
        if path not in self._open:
            from safetensors import safe_open

            self._open[path] = self._stack.enter_context(safe_open(str(path), framework="pt"))
        return self._open[path]

    def _raw(self, name: str, index: tuple[slice, ...] = ()) -> torch.Tensor:
        path = self._all[name]
        try:
            handle = self._handle(name)
            return handle.get_slice(name)[index] if index else handle.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types (missing file, bad header, bad data)
            raise ValueError(f"{path}: tensor {name!r} is not readable: not a usable safetensors file "
                             f"({type(e).__name__}: {e})") from e


