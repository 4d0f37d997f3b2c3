"""What a run may set of Megatron's ``OptimizerConfig`` from config, checked without torch or Megatron.

``optim.override_optimizer_config`` (verl's key; the actor's, the critic's, SFT's ``optim``) sets OptimizerConfig
fields verbatim, as verl hands it to Megatron. Only the keys of :data:`OVERRIDES` are accepted: Megatron's optimizer
CPU offload (``HybridDeviceOptimizer``: a fraction of the optimizer's parameters, their fp32 copies, gradients and
Adam state on the host, updated there by a CPU optimizer) and its precision-aware optimizer. hybridrl itself sets the
learning rate, the optimizer, weight decay, Adam's constants, clipping, the distributed optimizer and the precision
(:data:`OWNED_ELSEWHERE` says which key sets each instead).

:func:`optimizer_config_problems` states every rule once: static validation collects its problems and the runner
(:class:`hybridrl.megatron.runner.MegatronRunner`) raises them, so a config that passes validation builds. The rules
are Megatron 0.16.1's (``OptimizerConfig.__post_init__``, ``_get_megatron_optimizer_based_on_param_groups``), plus the
device: ``HybridDeviceOptimizer`` takes ``torch.cuda.current_stream()`` when it is built (on a CPU-only torch:
AssertionError "Torch not compiled with CUDA enabled"), and the precision-aware optimizer is Transformer Engine's
FusedAdam (or that CPU offload), so neither runs on ``trainer.device=cpu``. Megatron's CPU offload also needs
decoupled weight decay (AdamW), its default, which hybridrl never changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridrl.megatron.transformer_overrides import Problem

OVERRIDES = {
    "optimizer_cpu_offload": "true | false: Megatron's HybridDeviceOptimizer keeps optimizer_offload_fraction of the "
                             "optimizer's parameters (their fp32 copies, gradients and Adam state) in host memory and "
                             "updates them there (CUDA only)",
    "optimizer_offload_fraction": "a number in [0, 1] (with optimizer_cpu_offload): the share of the parameters "
                                  "updated on the host (Megatron's default 0: none)",
    "overlap_cpu_optimizer_d2h_h2d": "true | false (with optimizer_cpu_offload): copy gradients to the host and "
                                     "parameters back on side streams, one CPU optimizer per parameter",
    "use_torch_optimizer_for_cpu_offload": "true | false (with optimizer_cpu_offload): torch's optimizer on the "
                                           "device part too",
    "pin_cpu_grads": "true | false (with optimizer_cpu_offload): pinned host gradients (Megatron's default: true)",
    "pin_cpu_params": "true | false (with optimizer_cpu_offload): pinned host parameters (Megatron's default: true)",
    "use_precision_aware_optimizer": "true | false: the optimizer keeps the fp32 main parameters itself (Transformer "
                                     "Engine's FusedAdam, or the CPU offload's optimizer) instead of Megatron's "
                                     "distributed optimizer; adam and megatron.use_distributed_optimizer=true only",
}
BOOLEANS = tuple(k for k in OVERRIDES if k != "optimizer_offload_fraction")
CPU_OFFLOAD_ONLY = ("optimizer_offload_fraction", "overlap_cpu_optimizer_d2h_h2d",
                    "use_torch_optimizer_for_cpu_offload", "pin_cpu_grads", "pin_cpu_params")

# OptimizerConfig fields hybridrl sets itself, and the key (under the optim block, or the role's megatron block:
# "megatron.") that sets each
OWNED_ELSEWHERE = {
    **{k: k for k in ("optimizer", "lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad")},
    "min_lr": "lr_decay_style (hybridrl decays to 0)",
    "use_distributed_optimizer": "megatron.use_distributed_optimizer",
    **{k: "megatron.dtype" for k in ("bf16", "fp16", "params_dtype", "main_params_dtype", "main_grads_dtype",
                                     "exp_avg_dtype", "exp_avg_sq_dtype", "initial_loss_scale", "loss_scale")},
}


def optimizer_config_problems(optimizer: str, overrides: Mapping[str, Any], *, key: str, megatron_key: str,
                              distributed_optimizer: bool, device_type: str | None,
                              transformer_engine: bool | None = None) -> list[Problem]:
    """Problems of ``<key>.override_optimizer_config`` (``key``: the optim block's config path, e.g.
    ``actor_rollout_ref.actor.optim``; ``megatron_key``: the Megatron block the optimizer trains under) for
    ``<key>.optimizer``; ``device_type`` cpu | cuda (None: skip the device's rules); ``transformer_engine`` whether
    it imports where the run builds (None: not known, a plan for another machine)."""
    okey = f"{key}.override_optimizer_config"
    problems: list[Problem] = []
    for name, value in overrides.items():
        if name in OWNED_ELSEWHERE:
            owner = OWNED_ELSEWHERE[name]
            where = (f"{megatron_key}.{owner.removeprefix('megatron.')}" if owner.startswith("megatron.")
                     else f"{key}.{owner}")
            problems.append((f"{okey}.{name}", value, f"set by {where}, not here"))
        elif name not in OVERRIDES:
            problems.append((f"{okey}.{name}", value,
                             f"not a supported override; supported: {', '.join(OVERRIDES)}"))
        elif name in BOOLEANS and not isinstance(value, bool):
            problems.append((f"{okey}.{name}", value, "true or false"))
    fraction = overrides.get("optimizer_offload_fraction")
    if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                                 or not 0 <= fraction <= 1):
        problems.append((f"{okey}.optimizer_offload_fraction", fraction, "a number in [0, 1]"))
    offload = overrides.get("optimizer_cpu_offload") is True
    if overrides.get("use_precision_aware_optimizer") is True:
        if optimizer != "adam":
            problems.append((f"{key}.optimizer", optimizer,
                             "use_precision_aware_optimizer supports adam only (Megatron's rule)"))
        if not distributed_optimizer:
            problems.append((f"{megatron_key}.use_distributed_optimizer", False,
                             f"{okey}.use_precision_aware_optimizer=true needs Megatron's distributed optimizer: set "
                             "it to true"))
        if device_type == "cpu":
            problems.append((f"{okey}.use_precision_aware_optimizer", True,
                             "needs CUDA: its optimizer is Transformer Engine's FusedAdam (or the CPU offload's, "
                             "which needs CUDA too); on trainer.device=cpu set false"))
        elif device_type == "cuda" and not offload and transformer_engine is False:
            problems.append((f"{okey}.use_precision_aware_optimizer", True,
                             "needs Transformer Engine's FusedAdam (not importable here) unless "
                             "optimizer_cpu_offload=true; set false"))
    if offload and device_type == "cpu":
        problems.append((f"{okey}.optimizer_cpu_offload", True,
                         "needs CUDA: Megatron's HybridDeviceOptimizer takes CUDA streams when it is built; on "
                         "trainer.device=cpu the optimizer already runs in host memory: set false"))
    return problems


def optimizer_config_notes(overrides: Mapping[str, Any], *, key: str) -> list[str]:
    """What the plan says of ``<key>.override_optimizer_config``: the CPU offload's settings without
    ``optimizer_cpu_offload=true`` are passed and do nothing (Megatron builds its plain optimizer)."""
    idle = [f"{k}={overrides[k]}" for k in CPU_OFFLOAD_ONLY if k in overrides]
    if not idle or overrides.get("optimizer_cpu_offload") is True:
        return []
    return [f"{key}.override_optimizer_config: {', '.join(idle)} do nothing without optimizer_cpu_offload=true "
            "(Megatron builds its optimizer on the device)"]


def host_fraction(overrides: Mapping[str, Any]) -> float:
    """The share of the optimizer's parameters whose fp32 copy, gradient and state live in host memory (0 without
    ``optimizer_cpu_offload``; a bad fraction counts as 0: validation names it)."""
    fraction = overrides.get("optimizer_offload_fraction", 0.0)
    if overrides.get("optimizer_cpu_offload") is not True or isinstance(fraction, bool) \
            or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
        return 0.0
    return float(fraction)


def precision_aware(overrides: Mapping[str, Any]) -> bool:
    """Whether the optimizer, not Megatron's distributed optimizer, holds the fp32 main parameters."""
    return overrides.get("use_precision_aware_optimizer") is True
