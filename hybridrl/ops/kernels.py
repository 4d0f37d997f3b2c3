"""Which block kernels a device gets: C++ on CPU, Triton on CUDA, plain PyTorch when those can't be had.

A backend is anything with ``row_stats`` and ``row_grad`` of the contract in ``csrc/logprob_entropy.cpp``.
The compiled ones are tried once per process; when one is unavailable the process warns once (naming the
cause) and uses :mod:`hybridrl.ops.torch_kernels`.
"""

from __future__ import annotations

import functools
import warnings
from types import ModuleType, SimpleNamespace
from typing import Protocol

import torch

from hybridrl.ops import torch_kernels
from hybridrl.ops.cpp_build import load_cpu_ops


class Kernels(Protocol):
    def row_stats(self, logits_NC: torch.Tensor, target_N: torch.Tensor, valid: int,
                  temperature: float) -> torch.Tensor: ...

    def row_grad(self, logits_NC: torch.Tensor, target_N: torch.Tensor, valid: int, temperature: float,
                 log_z_N: torch.Tensor, entropy_N: torch.Tensor, g_lp_N: torch.Tensor, g_ent_N: torch.Tensor,
                 out: torch.Tensor) -> torch.Tensor: ...


@functools.cache
def _triton() -> ModuleType | None:
    try:
        from hybridrl.ops import triton_kernels
    except ImportError as e:
        warnings.warn(f"hybridrl fused log-prob/entropy kernels unavailable on CUDA, using the pure-PyTorch path: "
                      f"triton does not import ({e})", RuntimeWarning, stacklevel=3)
        return None
    return triton_kernels


def compiled_kernels(device: torch.device) -> Kernels | None:
    """The compiled kernels for ``device``'s type (built at first use), or None (warned once) when unavailable."""
    if device.type == "cuda":
        return _triton()
    if device.type == "cpu" and load_cpu_ops():
        ops = torch.ops.hybridrl_ops
        return SimpleNamespace(row_stats=ops.row_stats, row_grad=ops.row_grad)
    return None


def kernels_for(device: torch.device) -> Kernels:
    """The compiled kernels for ``device`` if they can be had, else the plain-PyTorch ones."""
    return compiled_kernels(device) or torch_kernels
