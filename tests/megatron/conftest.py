"""Tiny HF checkpoints for the Megatron tests, made once per session.

``make_tiny_model`` draws norms = 1 and biases = 0, which would hide a misplaced norm or QKV bias, so
every 1-D tensor is redrawn here (norms ≈ 1 ± 0.2, biases ≈ ±0.1); and with its N(0, 0.02²) matrices
attention is nearly uniform, which would hide a wrong RoPE θ or scaling (Llama-3 scaling moved the
logits by only 2e-5), so q/k projections are scaled ×8 (then 1e-3). Two cases make_tiny_model can't
express (Qwen3 with head_dim ≠ hidden/heads; Llama-3 RoPE scaling with θ = 5e5) are built with
transformers directly. The Llama checkpoint is re-saved sharded (index.json + 3 files).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen3Config

from hybridrl.models.tiny import make_tiny_model

MODELS: dict[str, Callable[[Path], Path]] = {
    "qwen2_tied": lambda d: make_tiny_model(d, arch="qwen2", tie=True, seed=0),
    "qwen2_untied": lambda d: make_tiny_model(d, arch="qwen2", tie=False, seed=1),
    "qwen3": lambda d: make_tiny_model(d, arch="qwen3", tie=True, seed=2),
    "llama_sharded": lambda d: make_tiny_model(d, arch="llama", tie=False, seed=3),
    "odd_vocab": lambda d: make_tiny_model(d, arch="qwen2", tie=False, vocab=131, seed=4),
    "heads8_kv4": lambda d: make_tiny_model(d, arch="qwen2", heads=8, kv_heads=4, tie=True, seed=5),
    "qwen3_head_dim": lambda d: from_config(d, Qwen3Config(
        vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=128, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "llama3_rope": lambda d: from_config(d, LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16384, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
}

SHARDED = {"llama_sharded"}


def from_config(out: Path, config: PretrainedConfig) -> Path:
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return out


def shard(model_dir: Path, *, parts: int) -> Path:
    single = model_dir / "model.safetensors"
    state = load_file(single)
    names = sorted(state)
    weight_map = {}
    for i in range(parts):
        file = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        chunk = names[i::parts]
        save_file({n: state[n] for n in chunk}, model_dir / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, file))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
             "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    single.unlink()
    return model_dir


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory,
                     discriminate: Callable[[Path, int], Path]) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    out = {}
    for seed, (name, make) in enumerate(MODELS.items()):
        model_dir = root / name
        model_dir.mkdir()
        out[name] = make(model_dir)
        discriminate(out[name], seed)
        if name in SHARDED:
            shard(out[name], parts=3)
    return out
