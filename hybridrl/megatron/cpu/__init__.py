"""Every adaptation that lets megatron-core 0.16.1 run on a CPU-only torch build, in one place.

megatron-core assumes CUDA in a handful of spots (PLATFORM.md lists them). Where Megatron takes an
explicit argument that avoids the CUDA path we pass it (:func:`causal_attention_mask`,
:func:`cpu_model_parallel_kwargs`, :func:`cpu_distributed_optimizer_checkpoint_metadata`), where it has
a helper we call it (:func:`init_distributed_optimizer_state`); the rest are patches, installed by
:func:`apply_cpu_adaptations`, which is idempotent and does nothing when CUDA is available. Each
function's docstring names the upstream file and behaviour it works around;
``tests/megatron/test_cpu_adaptations.py`` runs each upstream behaviour without its adaptation and fails
once upstream no longer needs it.

The items live by what they adapt: :mod:`.device` (current device, RNG tracker), :mod:`.model` (attention
mask, pipeline, tied embeddings, CP RoPE, MLA's local core attention), :mod:`.optimizer`, :mod:`.checkpointing`;
:mod:`.proxies` holds the stand-ins they install. Every item is importable from here, the index.

Not adapted (not used yet; it fails loudly if reached): ``torch.cuda.Event`` in the inference controller.
(The fp32 optimizer and gradient clipping are adapted: :func:`use_cpu_in_optimizer`; the bf16/fp16 optimizer
and fp16's loss scaler: :func:`use_cpu_in_float16_optimizer`, :func:`use_cpu_in_grad_scaler`; the distributed
optimizer: :func:`use_cpu_in_distributed_optimizer`,
:func:`cpu_distributed_optimizer_checkpoint_metadata`, :func:`init_distributed_optimizer_state` and
:func:`load_torch_adam_step_in_distributed_optimizer`; the CP RoPE slice: :func:`use_cpu_in_cp_rope`.)
"""

from __future__ import annotations

from hybridrl.megatron.cpu.checkpointing import (
    cpu_distributed_optimizer_checkpoint_metadata,
    init_distributed_optimizer_state,
    load_torch_adam_step_in_distributed_optimizer,
    use_cpu_in_dist_checkpointing,
)
from hybridrl.megatron.cpu.device import CpuRNGStatesTracker, use_cpu_as_current_device, use_cpu_rng_tracker
from hybridrl.megatron.cpu.model import (
    MLADotProductAttention,
    causal_attention_mask,
    cpu_model_parallel_kwargs,
    use_cpu_in_cp_rope,
    use_cpu_in_p2p_shape_exchange,
    use_cpu_in_pipeline_schedules,
    use_cpu_in_tied_embedding_setup,
    use_mla_without_transformer_engine,
)
from hybridrl.megatron.cpu.optimizer import (
    use_cpu_in_distributed_optimizer,
    use_cpu_in_float16_optimizer,
    use_cpu_in_grad_scaler,
    use_cpu_in_optimizer,
)
from hybridrl.megatron.cpu.proxies import cuda_available

__all__ = [
    "CpuRNGStatesTracker",
    "MLADotProductAttention",
    "apply_cpu_adaptations",
    "causal_attention_mask",
    "cpu_distributed_optimizer_checkpoint_metadata",
    "cpu_model_parallel_kwargs",
    "cuda_available",
    "init_distributed_optimizer_state",
    "load_torch_adam_step_in_distributed_optimizer",
    "use_cpu_as_current_device",
    "use_cpu_in_cp_rope",
    "use_cpu_in_dist_checkpointing",
    "use_cpu_in_distributed_optimizer",
    "use_cpu_in_float16_optimizer",
    "use_cpu_in_grad_scaler",
    "use_cpu_in_optimizer",
    "use_cpu_in_p2p_shape_exchange",
    "use_cpu_in_pipeline_schedules",
    "use_cpu_in_tied_embedding_setup",
    "use_cpu_rng_tracker",
    "use_mla_without_transformer_engine",
]


def apply_cpu_adaptations() -> None:
    """Install every CPU patch of this package (once; a no-op when CUDA is available)."""
    if cuda_available():
        return
    use_cpu_as_current_device()
    use_cpu_rng_tracker()
    use_cpu_in_pipeline_schedules()
    use_cpu_in_tied_embedding_setup()
    use_cpu_in_optimizer()
    use_cpu_in_float16_optimizer()
    use_cpu_in_grad_scaler()
    use_cpu_in_distributed_optimizer()
    load_torch_adam_step_in_distributed_optimizer()
    use_cpu_in_cp_rope()
    use_cpu_in_dist_checkpointing()
    use_cpu_in_p2p_shape_exchange()
