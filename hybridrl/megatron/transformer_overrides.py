"""What a run may set of Megatron's ``TransformerConfig`` from config, checked without torch or Megatron.

Two keys of ``MegatronConfig`` reach the TransformerConfig:

- ``dtype`` (:data:`DTYPES`): parameters and compute in that dtype, through Megatron's own mixed precision
  (``bf16``/``fp16`` + ``params_dtype``, ``Float16Module``, fp32 main weights and grads in the optimizer);
- ``override_transformer_config`` (verl's key): TransformerConfig fields set verbatim. Only the keys of
  :data:`OVERRIDES` (activation recompute, an MoE model's router losses, router dtype and token dispatcher,
  uneven end pipeline stages) and :data:`FUSIONS`
  (kernel fusions) are accepted, and those of :data:`NOT_PASSED` (accepted, with a note, and not handed to
  Megatron); hybridrl itself
  sets the layout, the dtype and the architecture (:data:`OWNED_ELSEWHERE` says where to set those instead).

:func:`megatron_config_problems` states every rule once: static validation collects its problems and the
model builder (:func:`hybridrl.megatron.model.transformer_config`) raises them, so a config that passes
validation builds. The rules are Megatron 0.16.1's (``TransformerConfig.__post_init__``), plus errors for
settings Megatron would silently ignore (a recompute method or module list without the granularity it
belongs to) and for an MoE dispatcher the device cannot run (alltoall and flex need CUDA, flex DeepEP).
:func:`megatron_config_notes` says what the plan should note: the dispatcher's settings do nothing on a dense model
(verl's Qwen3-VL-8B script sets DeepEP's), and so are passed as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridrl.megatron.stages import FIRST, LAST

Problem = tuple[str, object, str]  # (config key, value, what is wrong and what would be valid)

DTYPES = ("float32", "bfloat16", "float16")

RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
# selective recompute of a dense model. Megatron also knows MoE/MLA modules, which these models lack, and
# "layernorm", left out: with Transformer Engine's spec the norms are fused into the linears (nothing to
# recompute); without TE, 0.16.1's CheckpointWithoutOutput takes fp8=False for "fp8 on" and fails with
# NameError: name 'FP8GlobalStateManager' is not defined (tensor_parallel/random.py).
RECOMPUTE_MODULES = ("core_attn", "mlp")

# Megatron's load-balancing losses that leave routing as it is (sinkhorn changes it; global_aux_loss keeps CUDA
# buffers)
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
MOE_LOSS_COEFFS = ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate")
MOE_ROUTER_DTYPES = ("fp32", "fp64")  # Megatron's moe_router_dtype (null: the model's dtype)
# Megatron's token dispatchers of an MoE layer (null: hybridrl's choice, hybridrl.megatron.model.moe_config_kwargs:
# alltoall on CUDA, allgather on CPU). alltoall makes CUDA streams when it is built; flex runs DeepEP's kernels
# (its backend, 0.16.1's default moe_flex_dispatcher_backend=deepep): both CUDA only, flex with the deep_ep package
MOE_DISPATCHERS = ("allgather", "alltoall", "flex")
MOE_DISPATCH = ("moe_token_dispatcher_type", "moe_enable_deepep")  # do nothing on a dense model

OVERRIDES = {
    "recompute_granularity": f"null | {' | '.join(RECOMPUTE_GRANULARITIES)}: full recomputes whole layers in the "
                             "backward pass, selective only the modules of recompute_modules",
    "recompute_method": f"null | {' | '.join(RECOMPUTE_METHODS)} (with granularity full): uniform recomputes "
                        "every block of recompute_num_layers layers, block the first recompute_num_layers "
                        "layers of each pipeline stage",
    "recompute_num_layers": "an integer ≥ 1 (with granularity full)",
    "recompute_modules": f"a list of {', '.join(RECOMPUTE_MODULES)} (with granularity selective; Megatron's "
                         "default: [core_attn])",
    "moe_aux_loss_coeff": "a number ≥ 0: the weight of Megatron's load-balancing loss (0, the RL default: off)",
    "moe_z_loss_coeff": "a number ≥ 0 or null: the weight of the router z-loss (null, the RL default: off)",
    "moe_router_load_balancing_type": f"{' | '.join(LOAD_BALANCING_TYPES)}: the load-balancing loss "
                                      "(default: aux_loss when moe_aux_loss_coeff > 0, else none)",
    "moe_router_dtype": f"null | {' | '.join(MOE_ROUTER_DTYPES)}: the precision of the router's logits and "
                        "softmax (null: the model's dtype)",
    "moe_router_bias_update_rate": "a number ≥ 0: aux-loss-free balancing of a sigmoid router with an expert bias "
                                   "(GLM-4.5, DeepSeek-V3): after each optimizer step each expert's bias moves by "
                                   "this × sign(mean load − its load) (0, the default: the checkpoint's bias)",
    "moe_token_dispatcher_type": f"null | {' | '.join(MOE_DISPATCHERS)}: how an MoE layer sends tokens to its "
                                 "experts' ranks (null: alltoall on CUDA, allgather on CPU; alltoall and flex: CUDA "
                                 "only; flex: DeepEP, the deep_ep package); no effect on a dense model",
    "moe_enable_deepep": "true | false: flex's DeepEP backend (Megatron's older switch; with "
                         "moe_token_dispatcher_type=flex only); no effect on a dense model",
    FIRST: "null | an integer ≥ 1: the first pipeline stage holds this many layers, the stages after it share the "
           "rest equally (a model whose layers PP does not divide: DeepSeek-V3's 61; hybridrl.megatron.stages)",
    LAST: f"null | an integer ≥ 1: the last pipeline stage holds this many layers (as {FIRST})",
}

# Megatron's kernel-fusion switches (booleans, verl's scripts set them): speed only, the same math up to kernel
# rounding; passed as they are. They need the fused kernels (Transformer Engine / apex / CUDA): leave them off
# on CPU, where Megatron's own checks refuse the ones it cannot run
FUSIONS = ("apply_rope_fusion", "masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion",
           "gradient_accumulation_fusion", "persist_layer_norm", "deallocate_pipeline_outputs",
           "moe_permute_fusion")  # TE ≥ 2.1's fused token permutation of an MoE layer

# switches accepted (verl's MoE scripts set them) but not handed to Megatron, and why: the run's derived config
# (hybridrl/config/derived.py) drops them with a note
NOT_PASSED = {
    "moe_grouped_gemm": "the experts run one GEMM each (Megatron's SequentialMLP, whose per-expert weights "
                        "hybridrl's HF converters read); grouped GEMM is the same math, faster, and its fused expert "
                        "weights are not converted yet",
}

# TransformerConfig fields hybridrl sets itself, and the key that sets each
OWNED_ELSEWHERE = {
    **{k: f"megatron.{k}" for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                    "virtual_pipeline_model_parallel_size", "context_parallel_size",
                                    "sequence_parallel")},
    **{k: "megatron.dtype" for k in ("bf16", "fp16", "params_dtype", "pipeline_dtype")},
    **{k: "the model's config.json" for k in ("num_layers", "hidden_size", "ffn_hidden_size",
                                              "num_attention_heads", "num_query_groups", "kv_channels")},
}


def megatron_config_problems(dtype: str, overrides: Mapping[str, Any], *, key: str, moe: bool | None = None,
                             device_type: str | None = None, deep_ep: bool | None = None) -> list[Problem]:
    """Problems of ``<key>.dtype`` and ``<key>.override_transformer_config`` (``key``: the MegatronConfig's
    config path, e.g. ``actor_rollout_ref.actor.megatron``); empty when both are valid. The MoE dispatcher's rules
    need to know the model (``moe``: whether it has MoE layers), the device (cpu | cuda) and whether ``deep_ep``
    imports where the run builds; None skips the rules that need it (a plan for another machine: deep_ep None)."""
    problems: list[Problem] = []
    if dtype not in DTYPES:
        problems.append((f"{key}.dtype", dtype, f"valid: {', '.join(DTYPES)}"))
    okey = f"{key}.override_transformer_config"
    for name, value in overrides.items():
        if name in OWNED_ELSEWHERE:
            problems.append((f"{okey}.{name}", value, f"set by {OWNED_ELSEWHERE[name]}, not here"))
        elif name in FUSIONS or name in NOT_PASSED:
            if not isinstance(value, bool):
                problems.append((f"{okey}.{name}", value, "a fusion switch: true or false"))
        elif name not in OVERRIDES:
            problems.append((f"{okey}.{name}", value, f"not a supported override; supported: {', '.join(OVERRIDES)}, "
                                                      f"the fusion switches {', '.join(FUSIONS)} and "
                                                      f"{', '.join(NOT_PASSED)}"))
    for name in MOE_LOSS_COEFFS:
        value = overrides.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            problems.append((f"{okey}.{name}", value, "must be a number ≥ 0" + (" (or null)" if "z_loss" in name
                                                                                   else "")))
    for name in (FIRST, LAST):  # how they split the model's layers: hybridrl.megatron.stages (needs the model)
        value = overrides.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            problems.append((f"{okey}.{name}", value, "must be an integer ≥ 1 (or null: an even split)"))
    router_dtype = overrides.get("moe_router_dtype")
    if router_dtype is not None and router_dtype not in MOE_ROUTER_DTYPES:
        problems.append((f"{okey}.moe_router_dtype", router_dtype, f"valid: null, {', '.join(MOE_ROUTER_DTYPES)}"))
    balancing = overrides.get("moe_router_load_balancing_type")
    if balancing is not None and balancing not in LOAD_BALANCING_TYPES:
        problems.append((f"{okey}.moe_router_load_balancing_type", balancing,
                         f"valid: {', '.join(LOAD_BALANCING_TYPES)}"))
    problems += _dispatcher_problems(overrides, okey=okey, moe=moe, device_type=device_type, deep_ep=deep_ep)
    granularity = overrides.get("recompute_granularity")
    method = overrides.get("recompute_method")
    num_layers = overrides.get("recompute_num_layers")
    modules = overrides.get("recompute_modules")
    if granularity is not None and granularity not in RECOMPUTE_GRANULARITIES:
        problems.append((f"{okey}.recompute_granularity", granularity,
                         f"valid: null, {', '.join(RECOMPUTE_GRANULARITIES)}"))
    if method is not None and method not in RECOMPUTE_METHODS:
        problems.append((f"{okey}.recompute_method", method, f"valid: null, {', '.join(RECOMPUTE_METHODS)}"))
    if num_layers is not None and (isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1):
        problems.append((f"{okey}.recompute_num_layers", num_layers, "must be an integer ≥ 1 (or null)"))
    if modules is not None and (not isinstance(modules, (list, tuple)) or not set(modules) <= set(RECOMPUTE_MODULES)):
        problems.append((f"{okey}.recompute_modules", modules, f"must be a list of {', '.join(RECOMPUTE_MODULES)}"))
    if granularity == "full":
        if method is None:
            problems.append((f"{okey}.recompute_method", method,
                             f"recompute_granularity=full needs one of {', '.join(RECOMPUTE_METHODS)}"))
        if num_layers is None:
            problems.append((f"{okey}.recompute_num_layers", num_layers,
                             "recompute_granularity=full needs an integer ≥ 1"))
    else:  # Megatron would ignore these (or, for selective + num_layers, refuse them)
        for name, value in (("recompute_method", method), ("recompute_num_layers", num_layers)):
            if value is not None:
                problems.append((f"{okey}.{name}", value, "only with recompute_granularity=full "
                                                          f"(got recompute_granularity={granularity}); remove it"))
    if modules is not None and granularity != "selective":
        problems.append((f"{okey}.recompute_modules", modules, "only with recompute_granularity=selective "
                                                             f"(got recompute_granularity={granularity}); remove it"))
    return problems


def _dispatcher_problems(overrides: Mapping[str, Any], *, okey: str, moe: bool | None, device_type: str | None,
                         deep_ep: bool | None) -> list[Problem]:
    """An MoE layer's token dispatcher: Megatron's values and its DeepEP rule (which it checks on any model), then,
    on an MoE model, what the device and the installed packages can run."""
    problems: list[Problem] = []
    dispatcher, deepep = overrides.get("moe_token_dispatcher_type"), overrides.get("moe_enable_deepep")
    if dispatcher is not None and dispatcher not in MOE_DISPATCHERS:
        problems.append((f"{okey}.moe_token_dispatcher_type", dispatcher, f"valid: null, {', '.join(MOE_DISPATCHERS)}"))
    if deepep is not None and not isinstance(deepep, bool):
        problems.append((f"{okey}.moe_enable_deepep", deepep, "true or false"))
    if deepep is True and dispatcher != "flex":  # TransformerConfig.__post_init__ raises
        problems.append((f"{okey}.moe_enable_deepep", True, "DeepEP runs under the flex dispatcher only: set "
                                                            "moe_token_dispatcher_type=flex, or this false"))
    if not moe:
        return problems
    if device_type == "cpu" and dispatcher in ("alltoall", "flex"):
        problems.append((f"{okey}.moe_token_dispatcher_type", dispatcher,
                         "needs CUDA (" + ("DeepEP's kernels" if dispatcher == "flex" else "it makes CUDA streams "
                                                                                         "when it is built")
                         + "); on trainer.device=cpu: allgather or null"))
    elif device_type == "cuda" and dispatcher == "flex" and deep_ep is False:
        problems.append((f"{okey}.moe_token_dispatcher_type", "flex",
                         "needs DeepEP (the deep_ep package), which does not import here: install it, or use "
                         "alltoall or null"))
    return problems


def megatron_config_notes(overrides: Mapping[str, Any], *, key: str, moe: bool | None,
                          deep_ep: bool | None) -> list[str]:
    """What the plan says of ``<key>.override_transformer_config``: the dispatcher's settings on a dense model do
    nothing (one note); flex on an MoE model planned for another machine needs deep_ep there (not checked here)."""
    okey = f"{key}.override_transformer_config"
    set_ = [f"{k}={overrides[k]}" for k in MOE_DISPATCH if k in overrides]
    if set_ and moe is False:
        return [f"{okey}: {', '.join(set_)} do nothing: the model is dense (no MoE layer to dispatch tokens to)"]
    if moe and overrides.get("moe_token_dispatcher_type") == "flex" and deep_ep is None:
        return [f"{okey}.moe_token_dispatcher_type=flex: the GPU machines need DeepEP (the deep_ep package); not "
                "checked while planning"]
    return []
