"""Build megatron-core ``GPTModel``s (this rank's pipeline stage or model chunks) from a Hugging Face config.

Qwen2/Qwen2.5, Qwen3 and Llama map onto one Megatron configuration: RMSNorm, SwiGLU (``fc1 =
[gate; up]``), GQA (``num_query_groups``), RoPE θ (+ Llama-3 scaling; over part of each head for GLM-4.5),
QKV bias (Qwen2, GLM-4.5's ``attention_bias``), per-head QK RMSNorm (Qwen3, GLM-4.5's ``use_qk_norm``), tied or
untied embeddings; the MoE families add :func:`moe_config_kwargs`; DeepSeek-V3 replaces the attention with Megatron's
multi-latent attention (``MLATransformerConfig``, :func:`mla_config_kwargs`). Transformer Engine's layer spec is used
when ``transformer_engine`` imports (GPU), Megatron's local spec otherwise (CPU), whose core
attention is :class:`~hybridrl.megatron.context_parallel.ContextParallelAttention` when CP > 1.

The vocabulary is padded to a multiple of ``vocab_multiple × TP`` (VocabParallelEmbedding needs equal
shards). Padded rows are zero and never leave this package: :func:`gather_vocab_logits` and the weight
export slice back to the true vocab. Code that reads TP-local logits directly (vocab-parallel
log-softmax) must mask the padded columns itself: their logits are 0, not -inf.

Under the interleaved pipeline schedule (VPP) a rank holds ``VPP`` model chunks, built by
:func:`build_model_chunks` with Megatron's ``vp_stage``: chunk v of PP rank r holds layer block
``v·PP + r`` (Megatron's ``get_transformer_layer_offset``), the embedding lives in chunk 0 of the first
stage and the output layer in the last chunk of the last stage. All chunks share one TransformerConfig,
which the schedule reads from chunk 0. The end stages may hold other layer counts than the rest
(``num_layers_in_first/last_pipeline_stage`` in ``override_transformer_config``, with or without VPP;
:mod:`hybridrl.megatron.stages`): Megatron builds each stage's layers with their global numbers, which the weight
converters read, so no converter depends on the split.

Precision (``megatron.dtype``, :data:`~hybridrl.megatron.transformer_overrides.DTYPES`) is Megatron's own, as
Megatron-LM's ``get_model`` does it: with bfloat16/float16 the TransformerConfig says ``bf16``/``fp16`` and
``params_dtype``, the parameters are created in that dtype and each chunk is wrapped in ``Float16Module``
(casts float inputs on the first stage). The optimizer keeps fp32 main weights and grads
(:mod:`hybridrl.megatron.policy`). ``megatron.override_transformer_config`` sets TransformerConfig fields
verbatim (activation recompute); its rules live in :mod:`~hybridrl.megatron.transformer_overrides`.

The model is built without initialising weights (``perform_initialization=False``): call
:func:`hybridrl.megatron.weights.load_hf_weights` next.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.module import Float16Module, MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from hybridrl.hf.arch import HFArch
from hybridrl.megatron.config import expert_tp
from hybridrl.megatron.context_parallel import ContextParallelAttention
from hybridrl.megatron.cpu import (
    MLADotProductAttention,
    cpu_model_parallel_kwargs,
    use_mla_without_transformer_engine,
)
from hybridrl.megatron.moe_compat import apply_moe_adaptations, mark_expert_weights
from hybridrl.megatron.packed_attention import PackedDotProductAttention
from hybridrl.megatron.parallel import ParallelConfig
from hybridrl.megatron.stages import stage_sizes
from hybridrl.megatron.transformer_overrides import DTYPES, megatron_config_problems
from hybridrl.vlm.mrope import use_interleaved_mrope

__all__ = [
    "TORCH_DTYPES",
    "ParallelConfig",
    "build_model_chunks",
    "gather_vocab_logits",
    "padded_vocab_size",
    "transformer_config",
    "unwrap_model",
    "use_transformer_engine",
]


TORCH_DTYPES = dict(zip(DTYPES, (torch.float32, torch.bfloat16, torch.float16), strict=True))


@functools.cache
def use_transformer_engine() -> bool:
    """True when Transformer Engine's torch extension imports (i.e. on a GPU machine with TE)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # TE's meta package raises (not only ImportError) where it can't load
        return False
    return True


def padded_vocab_size(vocab_size: int, tp: int, *, multiple: int = 128) -> int:
    """Smallest multiple of ``multiple × tp`` that holds ``vocab_size`` rows (Megatron-LM's rule)."""
    step = multiple * tp
    return -(-vocab_size // step) * step


def _check_supported(arch: HFArch, parallel: ParallelConfig, overrides: Mapping[str, Any]) -> None:
    first, last = stage_sizes(overrides)
    arch.check_split(tp=parallel.tensor_model_parallel_size, pp=parallel.pipeline_model_parallel_size,
                     vpp=parallel.virtual_pipeline_model_parallel_size, ep=parallel.expert_model_parallel_size,
                     etp=expert_tp(parallel), first=first, last=last)
    if not use_transformer_engine():
        if parallel.sequence_parallel:
            raise NotImplementedError(
                "sequence_parallel=True is not supported with Megatron's torch norms (no Transformer "
                "Engine here); use sequence_parallel=False")
    if arch.mla is not None and parallel.context_parallel_size > 1:
        raise NotImplementedError(f"context_parallel_size={parallel.context_parallel_size} is not supported for "
                                  f"{arch.family} (multi-latent attention) yet; valid: 1")


def transformer_config(arch: HFArch, parallel: ParallelConfig, *, dtype: str = "float32",
                       overrides: Mapping[str, Any] | None = None) -> TransformerConfig:
    """Megatron's TransformerConfig for ``arch`` under ``parallel`` in ``dtype`` (a name of
    :data:`~hybridrl.megatron.transformer_overrides.DTYPES`); ``overrides`` (``override_transformer_config``)
    are set verbatim once :func:`~hybridrl.megatron.transformer_overrides.megatron_config_problems` accepts them."""
    overrides = dict(overrides or {})
    if problems := megatron_config_problems(dtype, overrides, key="megatron", moe=arch.moe is not None,
                                            device_type="cuda" if torch.cuda.is_available() else "cpu",
                                            deep_ep=importlib.util.find_spec("deep_ep") is not None):
        raise ValueError("; ".join(f"{key}={value!r}: {message}" for key, value, message in problems))
    _check_supported(arch, parallel, overrides)
    params_dtype = TORCH_DTYPES[dtype]
    kwargs: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tp(parallel),
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,  # the activations sent between stages
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        perform_initialization=False,  # weights come from the HF checkpoint
        **cpu_model_parallel_kwargs(),
    )
    if arch.mrope_section is not None:  # a VLM's language model: multimodal RoPE (hybridrl.hf.vlm)
        kwargs["mrope_section"] = list(arch.mrope_section)
    kwargs.update(moe_config_kwargs(arch, overrides))
    kwargs.update(mla_config_kwargs(arch))
    kwargs.update(overrides)
    return (MLATransformerConfig if arch.mla is not None else TransformerConfig)(**kwargs)


def mla_config_kwargs(arch: HFArch) -> dict[str, Any]:
    """``MLATransformerConfig``'s fields for DeepSeek-V3's attention (none for the others): the latent ranks and head
    dims, plain RoPE θ over the rope dims (``rope_type="rope"``; MLA de-interleaves them as transformers'
    ``rope_interleave`` does), softmax scale 1/sqrt(nope + rope) (no YaRN mscale), the latent norms
    (``qk_layernorm``), ``kv_channels`` = ``v_head_dim`` (the context's head width)."""
    mla = arch.mla
    if mla is None:
        return {}
    rope: dict[str, Any] = dict(rope_type="rope")
    if mla.yarn is not None:
        factor, original, beta_fast, beta_slow, mscale, mscale_all_dim = mla.yarn
        rope = dict(rope_type="yarn", rotary_scaling_factor=factor, original_max_position_embeddings=original,
                    beta_fast=beta_fast, beta_slow=beta_slow, mscale=mscale, mscale_all_dim=mscale_all_dim)
    return dict(multi_latent_attention=True, q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank,
                qk_head_dim=mla.qk_nope_head_dim, qk_pos_emb_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim,
                kv_channels=mla.v_head_dim, qk_layernorm=True, rotary_base=arch.rope_theta,
                rotary_percent=1.0, apply_rope_fusion=False, **rope)


def moe_config_kwargs(arch: HFArch, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Megatron's MoE settings for ``arch`` (none for a dense model): its routing (:class:`~hybridrl.hf.arch.MoE`:
    an fp32 softmax router, top-k, renormalised or not; or GLM-4.5's sigmoid one with the expert bias, grouped
    top-k and scaled weights, the bias kept as the checkpoint's — ``moe_router_bias_update_rate`` 0 — unless
    ``overrides`` set a rate for Megatron's aux-loss-free balancing), no load-balancing or z-loss unless ``overrides``
    (``override_transformer_config``) set their weights (the RL default: off, as the peers run it; a
    ``moe_aux_loss_coeff`` > 0 turns on Megatron's ``aux_loss`` unless ``moe_router_load_balancing_type`` says
    which), the experts as one MLP each (``SequentialMLP``); the all-gather token dispatcher on CPU (the
    all-to-all one makes CUDA streams at build), the all-to-all one on GPU, unless ``overrides`` name one
    (``moe_token_dispatcher_type``, set over these by :func:`transformer_config`)."""
    moe = arch.moe
    if moe is None:
        return {}
    overrides = overrides or {}
    balancing = "aux_loss" if (overrides.get("moe_aux_loss_coeff") or 0) > 0 else "none"
    return dict(num_moe_experts=moe.num_experts, moe_router_topk=moe.top_k, moe_ffn_hidden_size=moe.ffn_hidden_size,
                moe_layer_freq=moe.layer_freq,
                moe_router_pre_softmax=moe.score_function == "softmax" and not moe.norm_topk_prob,
                moe_router_score_function=moe.score_function, moe_router_dtype="fp32",
                moe_router_enable_expert_bias=moe.expert_bias, moe_router_bias_update_rate=0.0,
                moe_router_num_groups=moe.num_groups, moe_router_group_topk=moe.group_topk,
                moe_router_topk_scaling_factor=moe.scaling_factor,
                moe_shared_expert_intermediate_size=moe.shared_ffn_hidden_size or None,
                moe_shared_expert_gate=moe.shared_expert_gate, moe_router_load_balancing_type=balancing,
                moe_aux_loss_coeff=0.0, moe_grouped_gemm=False,
                moe_token_dispatcher_type="alltoall" if torch.cuda.is_available() else "allgather")


def layer_spec(arch: HFArch, parallel: ParallelConfig, config: TransformerConfig | None = None,
               vp_stage: int | None = None) -> ModuleSpec | TransformerBlockSubmodules:
    """TE's layer spec when TE imports; else the local spec, with our core attention (CP's when CP > 1, else one that
    also takes packed sequences). An MoE model
    gets Megatron's block spec (its layers' MLPs differ: the MoE or a dense MLP by ``moe_layer_freq``)."""
    te = use_transformer_engine()
    if arch.moe is not None:
        assert config is not None, "an MoE model's block spec is built from its TransformerConfig"
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization="RMSNorm",
                                           vp_stage=vp_stage)
        for spec in block.layer_specs:
            attention = spec.submodules.self_attention.submodules  # type: ignore[union-attr]
            if arch.mla is not None:
                _mla_submodules(attention, te)
            elif not te:  # the local DotProductAttention takes neither CP nor packed sequences
                attention.core_attention = ContextParallelAttention if parallel.context_parallel_size > 1 \
                    else PackedDotProductAttention
        return block
    if te:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_layernorm)
    spec = get_gpt_layer_local_spec(qk_layernorm=arch.qk_layernorm, normalization="RMSNorm")
    # the local DotProductAttention takes neither CP nor packed sequences (packed_attention.py)
    spec.submodules.self_attention.submodules.core_attention = (  # type: ignore[union-attr]
        ContextParallelAttention if parallel.context_parallel_size > 1 else PackedDotProductAttention)
    return spec


def _mla_submodules(attention: Any, te: bool) -> None:
    """One layout of MLA's weights on both specs (:mod:`hybridrl.megatron.convert`): the latent down projections
    column-parallel (TE's spec has them duplicated on every TP rank, the local one column-parallel; MLA takes either),
    and on the local spec a core attention that accepts MLA's head widths (:class:`MLADotProductAttention`) and no
    check for TE's layers (:func:`use_mla_without_transformer_engine`)."""
    if te:
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear

        attention.linear_q_down_proj = attention.linear_kv_down_proj = TEColumnParallelLinear
    else:
        attention.core_attention = MLADotProductAttention
        use_mla_without_transformer_engine()


def build_model_chunks(
    arch: HFArch,
    parallel: ParallelConfig,
    *,
    dtype: str = "float32",
    overrides: Mapping[str, Any] | None = None,
    vocab_multiple: int = 128,
) -> list[MegatronModule]:
    """This rank's model chunks in ``vp_stage`` order (one without VPP), sharing one TransformerConfig;
    each a ``GPTModel``, wrapped in Megatron's ``Float16Module`` when ``dtype`` is bfloat16/float16
    (:func:`unwrap_model` reaches the GPTModel); uninitialised weights; needs :func:`init_parallel` first."""
    config = transformer_config(arch, parallel, dtype=dtype, overrides=overrides)
    if arch.moe is not None:
        apply_moe_adaptations()
    vpp = parallel.virtual_pipeline_model_parallel_size
    stages: list[int | None] = list(range(vpp)) if vpp else [None]
    vocab = padded_vocab_size(arch.vocab_size, parallel.tensor_model_parallel_size, multiple=vocab_multiple)
    chunks: list[MegatronModule] = [_gpt_chunk(arch, parallel, config, vocab_size=vocab, vp_stage=v) for v in stages]
    if config.bf16 or config.fp16:
        return [Float16Module(config, chunk) for chunk in chunks]
    return chunks


def _gpt_chunk(arch: HFArch, parallel: ParallelConfig, config: TransformerConfig, *, vocab_size: int,
               vp_stage: int | None) -> GPTModel:
    scaling = arch.rope_scaling
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(arch, parallel, config, vp_stage),
        vocab_size=vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        # ignore_virtual=False: with VPP only chunk 0 of the first stage embeds and only the last
        # chunk of the last stage has the output layer
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope" if arch.mrope_section is None else "mrope",
        rotary_percent=arch.rotary_percent,  # the leading dims, rotate-half (HF's partial_rotary_factor)
        rotary_base=arch.rope_theta,  # type: ignore[arg-type]  # annotated int, used as a float
        rope_scaling=scaling is not None,
        rope_scaling_factor=scaling.factor if scaling is not None else 8.0,
        vp_stage=vp_stage,
    )
    if arch.vision is not None and arch.vision.mrope_interleaved:  # Qwen3-VL's channel layout (hybridrl.vlm.mrope)
        use_interleaved_mrope(model)
    _mark_tensor_parallel_weights(model)
    if arch.moe is not None:
        mark_expert_weights(model)  # one optimizer layout at every EP (moe_compat item 2)
    return model


def _mark_tensor_parallel_weights(model: torch.nn.Module) -> None:
    """Tag the TP-sharded weights as such, which Megatron skips under ``perform_initialization=False``.

    ``tensor_parallel/layers.py`` sets ``tensor_model_parallel=True`` on the weights of
    ``VocabParallelEmbedding`` / ``ColumnParallelLinear`` / ``RowParallelLinear`` only inside its
    weight-init helpers. Without the tag, the optimizer's grad norm (``get_main_grads_for_grad_norm``
    → ``param_is_not_tensor_parallel_duplicate``) takes each sharded weight from TP rank 0 only, so at
    TP > 1 the norm is too small and clipping is wrong. (Megatron-Bridge keeps initialisation on for
    the same reason, NVIDIA-NeMo/Megatron-Bridge#992.) TE's layers set the tag themselves.
    """
    for module in model.modules():
        if isinstance(module, (VocabParallelEmbedding, ColumnParallelLinear, RowParallelLinear)):
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.nn.Parameter) and not hasattr(weight, "tensor_model_parallel"):
                dim = 1 if isinstance(module, RowParallelLinear) else 0
                set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=1)


def unwrap_model(model: torch.nn.Module) -> GPTModel:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while not isinstance(model, GPTModel):
        inner = getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            raise TypeError(f"{type(model).__name__} is not a GPTModel and wraps none (.module)")
        model = inner
    return model


def gather_vocab_logits(logits_BSv: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """TP-local logits ``[b, s, Vpad/TP]`` → full logits ``[b, s, vocab_size]`` (padding sliced off)."""
    full_BSV = tensor_parallel.gather_from_tensor_model_parallel_region(logits_BSv)
    return full_BSV[..., :vocab_size]
