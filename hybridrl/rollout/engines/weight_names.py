"""The check an engine makes of a streamed weight bucket before loading it: SGLang and vLLM skip an unknown name
silently (the weight would stay stale), and fail deep inside on a wrong shape."""

from __future__ import annotations

from hybridrl.interfaces import WeightBucket


def check_bucket(bucket: WeightBucket, shapes: dict[str, tuple[int, ...]], *, engine: str, model_path: str) -> None:
    """Raise KeyError for a name the rollout model's checkpoint lacks, ValueError for a shape it does not have."""
    for name, tensor in bucket:
        shape = shapes.get(name)
        if shape is None:
            raise KeyError(f"{engine} engine: weight {name!r} is not in the rollout model's checkpoint "
                           f"({model_path}); known names look like {next(iter(shapes))!r}")
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{engine} engine: weight {name!r} has shape {tuple(tensor.shape)}, "
                             f"the rollout model expects {shape}")
