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

from hybridrl.interfaces import RolloutEngine, SamplingParams
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


def serves_as_transformers(engine: RolloutEngine, path: Path) -> float:
    """Greedy: ``engine`` generates transformers' tokens from ``path``; returns the worst |Δ log-prob| of them."""
    prompts = [[5, 17, 33, 8, 21], [40, 2]]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    worst = 0.0
    for gen in engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=10)):
        prompt = prompts[gen.prompt_index]
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt):]
            logits = hf(torch.tensor([prompt + gen.token_ids])).logits[0, len(prompt) - 1:-1]
        assert gen.token_ids == expected.tolist(), (path.name, prompt)
        want = logits.log_softmax(-1).gather(-1, torch.tensor(gen.token_ids)[:, None])[:, 0]
        worst = max(worst, float((torch.tensor(gen.logprobs) - want).abs().max()))
    return worst


@pytest.fixture(scope="session")
def serves() -> Callable[[RolloutEngine, Path], float]:
    """:func:`serves_as_transformers`, for the MoE families' engine checks."""
    return serves_as_transformers


MOE_LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "ep2": (1, 2)}  # tp, ep: the MoE families' verify-model layouts


def verify_exact(models: dict[str, Path], layout: str) -> None:
    """``verify-model`` on ``models`` at one of :data:`MOE_LAYOUTS`, all in one launch: logits ≤ 1e-4 of transformers'
    (fp32) and every exported tensor bit-identical to the checkpoint's; prints each max logit diff."""
    from hybridrl.megatron.verify import run_verification

    tp, ep = MOE_LAYOUTS[layout]
    reports = run_verification(list(models.values()), tp=tp, ep=ep, bucket_bytes=20_000)
    for name, r in zip(models, reports, strict=True):
        print(f"{name} {layout}: max_abs_logit_diff={r.max_abs_logit_diff:.3g}")
        assert r.max_abs_logit_diff <= 1e-4, (name, layout, r)
        assert r.roundtrip_exact, (name, layout, r.mismatches)
        assert r.n_tensors == len(load_file(models[name] / "model.safetensors")), (name, layout)


@pytest.fixture(scope="session")
def verified() -> Callable[[dict[str, Path], str], None]:
    """:func:`verify_exact`, for the MoE families' tests."""
    return verify_exact
