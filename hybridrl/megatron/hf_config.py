"""The part of a Hugging Face config that decides the Megatron model, read without importing torch.

Supported: the dense decoder families Qwen2/Qwen2.5 (QKV bias), Qwen3 (QK RMSNorm) and Llama
(RMSNorm, SwiGLU, GQA, RoPE, tied or untied embeddings). Anything else is an error that names the
config key, its value and what would be valid, so an unsupported checkpoint fails before any
process group or model is built.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Family = Literal["qwen2", "qwen3", "llama"]
FAMILIES: tuple[Family, ...] = ("qwen2", "qwen3", "llama")


@dataclass(slots=True, kw_only=True, frozen=True)
class Llama3RopeScaling:
    """Llama-3.1-style frequency scaling (``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(slots=True, kw_only=True, frozen=True)
class HFArch:
    """Architecture of a dense HF causal LM, in Megatron's terms."""

    family: Family
    vocab_size: int  # true vocab (the checkpoint's rows); Megatron may pad it, exports never do
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int  # KV heads
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Llama3RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2: q/k/v projections have biases
    qk_layernorm: bool  # Qwen3: RMSNorm over each head of q and k

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    def check_split(self, *, tp: int, pp: int, vpp: int | None = None) -> None:
        """Raise if ``tp``/``pp``(×``vpp``) don't split this model evenly (whole KV groups per TP rank)."""
        if vpp is not None and self.num_layers % (pp * vpp):
            raise ValueError(f"pipeline_model_parallel_size × virtual_pipeline_model_parallel_size = {pp}×{vpp} "
                             f"does not divide the model's num_hidden_layers={self.num_layers} (each model "
                             "chunk holds an equal number of layers)")
        checks = [
            ("num_key_value_heads", self.num_query_groups, "tensor_model_parallel_size", tp,
             " (each TP rank holds whole KV groups)"),
            ("num_attention_heads", self.num_attention_heads, "tensor_model_parallel_size", tp, ""),
            ("intermediate_size", self.ffn_hidden_size, "tensor_model_parallel_size", tp, ""),
            ("num_hidden_layers", self.num_layers, "pipeline_model_parallel_size", pp,
             " (stages hold equal numbers of layers)"),
        ]
        for hf_key, value, key, size, why in checks:
            if value % size:
                raise ValueError(f"{key}={size} does not divide the model's {hf_key}={value}{why}")

    @classmethod
    def from_hf(cls, config: Any, *, source: str = "config") -> HFArch:
        """From a ``transformers.PretrainedConfig``, a config.json dict, or a checkpoint directory."""
        if isinstance(config, str | Path):
            path = Path(config)
            path = path / "config.json" if path.is_dir() else path
            if not path.is_file():
                raise FileNotFoundError(f"{path}: no such file; a HF checkpoint dir holds config.json")
            return cls.from_hf(json.loads(path.read_text()), source=str(path))
        if not isinstance(config, Mapping):
            config = config.to_dict()  # PretrainedConfig: carries its class defaults
        return _parse(config, source)


def _parse(cfg: Mapping[str, Any], source: str) -> HFArch:
    def need(key: str) -> Any:
        if key not in cfg:
            raise KeyError(f"{source}: missing key {key!r} (needed to build the Megatron model)")
        return cfg[key]

    def expect(key: str, valid: object, default: object) -> None:
        value = cfg.get(key, default)  # absent means the HF default, which is the valid value
        if value != valid:
            raise NotImplementedError(f"{source}: {key}={value!r} is not supported; valid: {valid!r}")

    family = need("model_type")
    if family not in FAMILIES:
        raise NotImplementedError(f"{source}: model_type={family!r} is not supported; valid: {FAMILIES}")
    expect("hidden_act", "silu", "silu")
    expect("use_sliding_window", False, False)
    expect("mlp_bias", False, False)
    if family != "qwen2":  # Qwen2's q/k/v bias is fixed in its modeling code; this key adds o_proj's
        expect("attention_bias", False, False)

    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)  # absent/None: multi-head attention
    if heads % kv_heads:
        raise ValueError(f"{source}: num_attention_heads={heads} is not a multiple of "
                         f"num_key_value_heads={kv_heads}")
    head_dim = cfg.get("head_dim") or hidden // heads
    theta, scaling = _rope(cfg, source)
    return HFArch(
        family=family,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        ffn_hidden_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_attention_heads=heads,
        num_query_groups=kv_heads,
        head_dim=int(head_dim),
        rms_norm_eps=float(need("rms_norm_eps")),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(need("max_position_embeddings")),
        tie_word_embeddings=bool(need("tie_word_embeddings")),
        qkv_bias=family == "qwen2",
        qk_layernorm=family == "qwen3",
    )


def _rope(cfg: Mapping[str, Any], source: str) -> tuple[float, Llama3RopeScaling | None]:
    """transformers 5.x keeps θ and scaling in ``rope_parameters``; 4.x in ``rope_theta``/``rope_scaling``."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "rope_theta" in params:
        theta = params["rope_theta"]
    elif "rope_theta" in cfg:
        theta = cfg["rope_theta"]
    else:
        raise KeyError(f"{source}: missing key 'rope_parameters.rope_theta' (or 'rope_theta')")
    key = "rope_parameters" if "rope_parameters" in cfg else "rope_scaling"
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type == "llama3":
        scaling = Llama3RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
        # Megatron's RotaryEmbedding._apply_scaling fixes these three; only the factor is an argument.
        fixed = Llama3RopeScaling(factor=scaling.factor, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=8192)
        if scaling != fixed:
            raise NotImplementedError(f"{source}: {key}={params!r}: Megatron's llama3 RoPE scaling "
                                      f"supports only {fixed}")
        return float(theta), scaling
    raise NotImplementedError(f"{source}: {key}.rope_type={rope_type!r} is not supported; "
                              "valid: 'default', 'llama3'")
