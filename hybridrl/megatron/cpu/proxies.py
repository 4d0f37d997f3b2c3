"""The shared stand-ins the CPU patches install: torch proxies, temporary Tensor method swaps, the patch mark."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_MARK = "_hybridrl_cpu_adaptation"


def cuda_available() -> bool:
    return torch.cuda.is_available()


class _TorchWithCpuFactories:
    """``torch`` as seen by one Megatron module, with ``device="cuda"`` factory calls sent to CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*size: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        if device == "cuda":
            device = "cpu"
        return torch.zeros(*size, device=device, **kwargs)

    @staticmethod
    def tensor(data: Any, *, device: Any = None, **kwargs: Any) -> torch.Tensor:
        if device == "cuda":
            device = "cpu"
        return torch.tensor(data, device=device, **kwargs)


@contextlib.contextmanager
def _tensor_cuda_is_identity() -> Iterator[None]:
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]


class _CudaWithoutStreams:
    """``torch.cuda`` as seen by one Megatron module, with ``synchronize`` a no-op (no streams on CPU)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None


class _TorchWithoutCudaStreams:
    """``torch`` whose ``cuda`` attribute is :class:`_CudaWithoutStreams`; everything else is torch."""

    cuda = _CudaWithoutStreams()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)
