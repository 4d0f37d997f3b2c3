"""The whole world over gloo: the process group for host-side objects and flags, whatever the backend.

An NCCL group takes CUDA tensors only; samples, causes and flags are host data. ``create()`` is a
collective (every rank calls it once, at start: ``init_parallel`` does); where the default group is gloo
already it creates nothing and :func:`get` returns None (the default group).
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

_GROUP: list[dist.ProcessGroup | None] = []


def create(*, timeout_s: float) -> None:
    if not _GROUP:
        timeout = timedelta(seconds=timeout_s)
        _GROUP.append(None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", timeout=timeout))


def get() -> dist.ProcessGroup | None:
    if dist.get_backend() == "gloo":
        return None
    if not _GROUP:
        raise RuntimeError("host_group.create() was not called after the process group started (init_parallel does)")
    return _GROUP[0]


def reset() -> None:
    """Forget the group (``destroy_parallel``: a new world needs a new one)."""
    _GROUP.clear()
