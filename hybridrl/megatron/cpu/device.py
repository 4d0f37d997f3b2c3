"""CPU adaptations of Megatron's device and RNG: the current device, the tracked RNG states."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.tensor_parallel import random as mcore_random

from hybridrl.megatron.cpu.proxies import _MARK


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def use_cpu_as_current_device() -> None:
    """Make ``torch.cuda.current_device()`` return ``torch.device("cpu")``.

    megatron-core uses ``torch.cuda.current_device()`` as a device in ~30 places on the paths we run:
    ``models/common/embeddings/rotary_pos_embedding.py`` (``RotaryEmbedding.get_emb`` moves
    ``inv_freq`` "to GPU once at the first micro-batch"), ``tensor_parallel/mappings.py``
    (``_gather_along_last_dim`` and friends allocate their output there), ``utils.py``
    (``GlobalMemoryBuffer.get_tensor``, used by the local ``DotProductAttention``),
    ``pipeline_parallel/p2p_communication.py`` (receive buffers). On a CPU build each raises
    ``AssertionError: Torch not compiled with CUDA enabled``. A global patch, because the calls are
    spread over many modules; on a CPU build nothing else can call the original successfully.
    """
    if not getattr(torch.cuda.current_device, _MARK, False):
        setattr(_cpu_current_device, _MARK, True)
        torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]


class CpuRNGStatesTracker(mcore_random.CudaRNGStatesTracker):
    """Megatron's named RNG states (``model-parallel-rng``, …) kept as CPU generator states."""

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")  # same errors as upstream
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def _no_cuda_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _set_no_cuda_rng_state(*args: Any, **kwargs: Any) -> None:
    return None


def use_cpu_rng_tracker() -> None:
    """Keep Megatron's tracked RNG states on the CPU generator.

    ``tensor_parallel/random.py``: ``CudaRNGStatesTracker.add`` (called by
    ``model_parallel_cuda_manual_seed``) reads ``torch.cuda.get_rng_state()`` → ``AssertionError:
    Torch not compiled with CUDA enabled``; without a seeded tracker the first forward fails in
    ``transformer/dot_product_attention.py`` (``get_cuda_rng_tracker().fork()`` around attention
    dropout) with ``Exception: cuda rng state model-parallel-rng is not added``. Activation
    recomputation (``CheckpointFunction``) saves/restores ``_get_cuda_rng_state()``, which fails the
    same way; there is no CUDA state on CPU, so those two become no-ops (the CPU state and the
    tracker's states are still saved and restored by upstream).
    ``initialize_rng_tracker`` builds the tracker from the module attribute ``CudaRNGStatesTracker``,
    so rebinding it makes every (re)initialisation, including ``force_reset_rng``, CPU-backed.
    """
    if getattr(mcore_random.CudaRNGStatesTracker, _MARK, False):
        return
    setattr(CpuRNGStatesTracker, _MARK, True)
    mcore_random.CudaRNGStatesTracker = CpuRNGStatesTracker  # type: ignore[misc]
    mcore_random._get_cuda_rng_state = _no_cuda_rng_state
    mcore_random._set_cuda_rng_state = _set_no_cuda_rng_state
    if not isinstance(mcore_random._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker):
        mcore_random.initialize_rng_tracker(force_reset=True)
