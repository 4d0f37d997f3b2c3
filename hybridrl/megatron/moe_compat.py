"""Every adaptation hybridrl makes to megatron-core 0.16.1's MoE layers, in one place.

Each item names the upstream behaviour it works around; ``tests/megatron/test_moe_compat.py`` shows that each is
still needed (it fails once upstream changes, so the item can go).

1. **The router without Transformer Engine.** ``moe_utils.RouterGatingLinearFunction`` (the router's linear,
   ``router_gating_linear``) tests ``te_general_gemm is not None``, a name ``moe_utils`` binds only when Transformer
   Engine imports: without TE (any CPU run, a GPU without TE) the first MoE forward raises ``NameError: name
   'te_general_gemm' is not defined``. :func:`apply_moe_adaptations` binds it to None, which takes the function's own
   ``torch.mm`` path.
2. **One optimizer layout at every EP.** Megatron marks an expert's weights ``allreduce = not (is_expert and
   expert_parallel)`` (``tensor_parallel/layers.py``, ``expert_parallel = expert_model_parallel_size > 1``), and
   ``get_megatron_optimizer`` / DDP put the ``allreduce=False`` ones in a second optimizer (a ``ChainedOptimizer``)
   and in their own gradient buffers. So an MoE model's optimizer state is one optimizer's at EP = 1 and a chain of
   two at EP > 1, saved under other keys and another structure: a checkpoint saved at one does not load at the other
   (``KeyError`` deep in ``dist_checkpointing``, or ``ChainedOptimizer.load_state_dict``'s "Expected 2 entries").
   :func:`mark_expert_weights` gives experts ``allreduce=False`` at every EP: the chain and its keys are the same
   at EP = 1, so checkpoints reshard between any two EP layouts. At EP = 1 the expert data-parallel group is the
   data-parallel group, so the experts' gradients are reduced over the same ranks as before; only the grad norm is
   summed in two parts (the chain's), as at EP > 1.

3. **A chain with an empty part cannot be saved.** A ``ChainedOptimizer`` part with no trainable parameters is a
   stub whose ``optimizer`` is None, and the chain's ``sharded_state_dict`` (every checkpoint save) reads every part:
   ``_synchronize_steps`` its ``optimizer.param_groups``, the part's own ``sharded_state_dict`` its
   ``optimizer.state_dict()`` — ``AttributeError: 'NoneType' object has no attribute 'param_groups'``. That is the
   dense part under LoRA on the experts of a model whose every layer is MoE (every adapter is an expert's).
   :func:`drop_empty_parts` takes such parts out of the chain (they have nothing to step, clip or save) while
   another part remains.

Not an adaptation but a choice (:func:`hybridrl.megatron.model.moe_config_kwargs`): the all-to-all token dispatcher
makes a ``torch.cuda.Stream`` when built, so CPU runs use the all-gather one.
"""

from __future__ import annotations

import torch


def apply_moe_adaptations() -> None:
    """Idempotent; changes nothing when Transformer Engine is there."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # item 1
        moe_utils.te_general_gemm = None


def mark_expert_weights(model: torch.nn.Module) -> int:
    """Item 2: every weight of an MoE layer's routed experts (``MoELayer.experts``: SequentialMLP, GroupedMLP or
    TE's; not the shared expert, not the router) is ``allreduce=False``, as Megatron marks them at EP > 1 only. Call
    before DDP and the optimizer are built. Returns how many were marked."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    marked = 0
    for module in model.modules():
        if isinstance(module, MoELayer):
            for param in module.experts.parameters():
                param.allreduce = False  # type: ignore[attr-defined]
                marked += 1
    return marked


def drop_empty_parts(optimizer: object) -> int:
    """Item 3: the stub parts (no trainable parameters) of a ``ChainedOptimizer``, removed while a real part remains.
    Returns how many were dropped."""
    parts = getattr(optimizer, "chained_optimizers", None)
    if not parts:
        return 0
    real = [p for p in parts if getattr(p, "optimizer", None) is not None]
    if not real or len(real) == len(parts):
        return 0
    optimizer.chained_optimizers = real  # type: ignore[attr-defined]
    return len(parts) - len(real)
