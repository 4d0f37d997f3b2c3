"""Reading the Megatron-relevant architecture from HF configs (transformers 4.x and 5.x layouts)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import LlamaConfig, Qwen2Config, Qwen3Config

from hybridrl.megatron.hf_config import HFArch, Llama3RopeScaling

SMALL: dict[str, Any] = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def test_qwen2_from_pretrained_config() -> None:
    arch = HFArch.from_hf(Qwen2Config(**SMALL, tie_word_embeddings=True))
    assert (arch.family, arch.qkv_bias, arch.qk_layernorm, arch.tie_word_embeddings) == ("qwen2", True, False, True)
    assert (arch.head_dim, arch.heads_per_group, arch.rope_theta) == (16, 2, 10000.0)


def test_qwen3_head_dim_and_qk_norm() -> None:
    arch = HFArch.from_hf(Qwen3Config(**SMALL, head_dim=32, rope_parameters={"rope_type": "default",
                                                                            "rope_theta": 1e6}))
    assert (arch.head_dim, arch.qk_layernorm, arch.qkv_bias, arch.rope_theta) == (32, True, False, 1e6)


def test_rope_theta_in_transformers_4_layout(tmp_path: Path) -> None:
    cfg = {**SMALL, "model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 5e5,
           "rope_scaling": None, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert HFArch.from_hf(tmp_path).rope_theta == 5e5


def test_llama3_rope_scaling() -> None:
    rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    arch = HFArch.from_hf(LlamaConfig(**{**SMALL, "max_position_embeddings": 16384}, rope_parameters=rope))
    assert arch.rope_scaling == Llama3RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                  original_max_position_embeddings=8192)
    with pytest.raises(NotImplementedError, match="supports only"):
        HFArch.from_hf(LlamaConfig(**{**SMALL, "max_position_embeddings": 16384},
                                   rope_parameters={**rope, "high_freq_factor": 2.0}))


@pytest.mark.parametrize(("change", "match"), [
    ({"model_type": "gpt2"}, r"model_type='gpt2' is not supported; valid: \('qwen2', 'qwen3', 'llama'\)"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported; valid: 'silu'"),
    ({"use_sliding_window": True}, "use_sliding_window=True is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type='yarn' is not supported"),
    ({"tie_word_embeddings": None}, "missing key 'tie_word_embeddings'"),
])
def test_unsupported_configs_name_the_key(change: dict[str, Any], match: str) -> None:
    cfg = {**SMALL, "model_type": "qwen2", "hidden_act": "silu", "rms_norm_eps": 1e-6,
           "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "tie_word_embeddings": True}
    cfg.update(change)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises((KeyError, NotImplementedError), match=match):
        HFArch.from_hf(cfg, source="x/config.json")


def test_check_split_names_the_parallel_key() -> None:
    arch = HFArch.from_hf(Qwen2Config(**SMALL))
    arch.check_split(tp=2, pp=2)
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=4 .* num_key_value_heads=2"):
        arch.check_split(tp=4, pp=1)
    with pytest.raises(ValueError, match=r"pipeline_model_parallel_size=3 .* num_hidden_layers=2"):
        arch.check_split(tp=1, pp=3)
    with pytest.raises(ValueError, match=r"pipeline_model_parallel_size × virtual_pipeline_model_parallel_size "
                                         r"= 2×2 does not divide the model's num_hidden_layers=2"):
        arch.check_split(tp=1, pp=2, vpp=2)
