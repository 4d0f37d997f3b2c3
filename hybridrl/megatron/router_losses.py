"""An MoE model's router losses as metrics: Megatron's load-balancing loss and router z-loss, when they are on.

Both are off by default for RL, as the peers run them; ``override_transformer_config.moe_aux_loss_coeff`` and
``moe_z_loss_coeff`` (verl's keys, :mod:`~hybridrl.megatron.transformer_overrides`) turn them on. Megatron adds
each to the gradient itself (``MoEAuxLossAutoScaler``: scaled by 1/micro-batches, averaged over DP by DDP) and
records its unweighted value per layer in a process-wide tracker during every training forward.
:func:`router_loss_metrics` reads that tracker after an optimizer step — summed over the pipeline stages (each
holds its own layers), averaged over DP ranks, over the micro-batches and over the MoE layers — and clears it.
Megatron's own reduction (``reduce_aux_losses_tracker_across_ranks``) averages with ``ReduceOp.AVG``, which gloo
lacks, so the reduction is done here with sums.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from hybridrl.megatron.parallel import rank_device

# Megatron's tracker name → the metric (under the role's prefix, e.g. actor/)
METRICS = {"load_balancing_loss": "moe_load_balancing_loss", "seq_load_balancing_loss": "moe_load_balancing_loss",
           "z_loss": "moe_z_loss"}


# Megatron's load-balancing type → the name its router records that loss under
TRACKED = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}


def router_loss_metrics(config: Any, *, num_micro_batches: int, num_moe_layers: int) -> dict[str, float]:
    """The mean per MoE layer and micro-batch of each router loss ``config`` (the model's TransformerConfig) turns
    on, recorded since the last call, over all DP ranks; the same on every rank (none on: {}). The names come from
    the config, not the tracker, so a pipeline stage without MoE layers (an empty tracker) joins the same
    reductions. Empties the tracker (Megatron makes an entry anew when it records)."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    names = []
    if (config.moe_aux_loss_coeff or 0) > 0 and config.moe_router_load_balancing_type in TRACKED:
        names.append(TRACKED[config.moe_router_load_balancing_type])
    if (config.moe_z_loss_coeff or 0) > 0:
        names.append("z_loss")
    tracker = get_moe_layer_wise_logging_tracker()
    out: dict[str, float] = {}
    for name in names:
        entry = tracker.pop(name, None)
        total = torch.zeros(1, dtype=torch.float64, device=rank_device())
        if entry is not None:
            total += entry["values"].sum().double().to(total.device)
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
        total /= parallel_state.get_data_parallel_world_size()
        out[METRICS[name]] = float(total) / max(num_micro_batches, 1) / max(num_moe_layers, 1)
    return out
