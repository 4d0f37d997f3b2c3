"""Process groups: torch.distributed from the torchrun environment, then Megatron's parallel_state.

gloo on CPU, NCCL on GPU. Under torchrun the rendezvous comes from ``RANK``/``WORLD_SIZE``/
``MASTER_ADDR``/``MASTER_PORT``; a plain ``python`` process (no ``RANK``) gets a world of one, which
Megatron still needs for ``initialize_model_parallel``.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from hybridrl.distributed import check as dist_check
from hybridrl.distributed import host_group
from hybridrl.megatron.config import layout_problems
from hybridrl.megatron.cpu import apply_cpu_adaptations, cuda_available
from hybridrl.megatron.fallbacks import say_fallbacks


@dataclass(slots=True, kw_only=True, frozen=True)
class ParallelConfig:
    """Megatron model parallelism of one model (actor, ref, critic); DP is what remains of the world."""

    tensor_model_parallel_size: int = 1
    """TP: ranks that split each layer's matrices (whole KV groups per rank)."""
    pipeline_model_parallel_size: int = 1
    """PP: stages that split the layers (num_layers must divide evenly)."""
    virtual_pipeline_model_parallel_size: int | None = None
    """VPP: model chunks per PP rank (interleaved 1F1B; needs PP ≥ 2); None = one chunk, plain 1F1B.
    Chunk v of PP rank r holds layer block ``v·PP + r`` of ``PP·VPP`` equal blocks."""
    context_parallel_size: int = 1
    """CP: ranks that split the sequence (TE's attention on GPU; ``context_parallel.py``'s without TE)."""
    sequence_parallel: bool = False
    """Shard LayerNorm/dropout activations over TP (needs TP > 1 and Transformer Engine norms)."""
    expert_model_parallel_size: int = 1
    """EP: ranks that split each MoE layer's experts (whole experts per rank), from the DP×CP ranks (and the TP
    ranks when ETP < TP)."""
    expert_tensor_parallel_size: int | None = None
    """ETP: ranks that split each expert's matrices; None: the model's TP."""

    def __post_init__(self) -> None:
        _raise(layout_problems(self, world_size=None))

    @property
    def num_model_chunks(self) -> int:
        """Model chunks this rank builds: VPP under the interleaved schedule, else 1."""
        return self.virtual_pipeline_model_parallel_size or 1

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        _raise(layout_problems(self, world_size=world_size))
        return world_size // self.model_parallel_size


def _raise(problems: list[tuple[str, object, str]]) -> None:
    """The config layer's rules (``hybridrl.config.plan.layout_problems``), raised at runtime."""
    if problems:
        raise ValueError("; ".join(f"{key}={value}: {message}" for key, value, message in problems))


def init_parallel(parallel: ParallelConfig, *, timeout_s: float = 1800.0) -> None:
    """Start torch.distributed (if not yet) and Megatron's model-parallel groups for ``parallel``; every
    group gets the same ``timeout_s`` (``trainer.dist_timeout_s``)."""
    apply_cpu_adaptations()
    if dist_check.enabled():
        dist_check.install()
    if not dist.is_initialized():
        say_fallbacks()
        backend = "nccl" if cuda_available() else "gloo"
        timeout = timedelta(seconds=timeout_s)
        if "RANK" in os.environ:
            if cuda_available():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend, init_method="env://", timeout=timeout)
        else:  # a single process outside torchrun
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    parallel.data_parallel_size(dist.get_world_size())  # raises with the keys to fix
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)),
    )
    host_group.create(timeout_s=timeout_s)


def rank_device() -> torch.device:
    """This rank's one device, decided once by :func:`init_parallel`: ``cuda:LOCAL_RANK`` on GPU machines
    (NCCL groups), the CPU otherwise (gloo groups). Model weights and every tensor a policy hands to a
    Megatron group live there; host-side bookkeeping uses the gloo groups with CPU tensors."""
    return torch.device("cuda", torch.cuda.current_device()) if cuda_available() else torch.device("cpu")


def seed_everything(seed: int) -> None:
    """Seed Python, torch and Megatron's tracked RNG states.

    The default generator gets ``seed`` on every rank; Megatron's ``model-parallel-rng`` state gets
    ``seed + 2718 + tp_rank`` (distinct dropout masks inside TP regions), as upstream does.
    """
    random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_parallel() -> None:
    """Tear down Megatron's groups and the default process group (safe to call twice)."""
    parallel_state.destroy_model_parallel()
    host_group.reset()
    if dist.is_initialized():
        dist.destroy_process_group()
