"""Every adaptation hybridrl makes to megatron-core 0.16.1's MoE layers, in one place.

Each item names the upstream behaviour it works around; ``tests/megatron/test_moe_compat.py`` shows that each is
still needed (it fails once upstream changes, so the item can go).

1. **The router without Transformer Engine.** ``moe_utils.RouterGatingLinearFunction`` (the router's linear,
   ``router_gating_linear``) tests ``te_general_gemm is not None``, a name ``moe_utils`` binds only when Transformer
   Engine imports: without TE (any CPU run, a GPU without TE) the first MoE forward raises ``NameError: name
   'te_general_gemm' is not defined``. :func:`apply_moe_adaptations` binds it to None, which takes the function's own
   ``torch.mm`` path.

Not an adaptation but a choice (:func:`hybridrl.megatron.model.moe_config_kwargs`): the all-to-all token dispatcher
makes a ``torch.cuda.Stream`` when built, so CPU runs use the all-gather one.
"""

from __future__ import annotations


def apply_moe_adaptations() -> None:
    """Idempotent; changes nothing when Transformer Engine is there."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # item 1
        moe_utils.te_general_gemm = None
