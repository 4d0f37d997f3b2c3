"""hybridrl/hf/{arch,tensors,write}.py: the architecture (transformers 4.x and 5.x layouts), how
TP/PP/VPP may split it, a checkpoint directory's problems, safetensors headers and reads (single and sharded), EOS
ids, writing."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, Qwen2Config, Qwen3Config

from hybridrl.hf import write as hf_write
from hybridrl.hf.arch import HFArch, Llama3RopeScaling, eos_token_ids, inspect_model_dir
from hybridrl.hf.tensors import SafetensorsReader, checkpoint_shapes, tensor_files
from hybridrl.hf.write import save_hf_checkpoint
from hybridrl.models.tiny import make_tiny_model

SMALL: dict[str, Any] = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
QWEN2_JSON: dict[str, Any] = {**SMALL, "model_type": "qwen2", "hidden_act": "silu", "rms_norm_eps": 1e-6,
                              "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
                              "tie_word_embeddings": True}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden=32, layers=2, heads=4, kv_heads=2)


def test_import_needs_no_torch() -> None:
    code = ("import sys, hybridrl.hf.arch, hybridrl.hf.tensors, hybridrl.hf.write; "
            "print(sorted({'torch', 'transformers'} & set(sys.modules)))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


# --- architecture -------------------------------------------------------------------------------


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


UNSUPPORTED = [
    ({"model_type": "gpt2"},
     r"model_type='gpt2' is not supported; valid: \('qwen2', 'qwen3', 'llama', 'qwen3_moe', 'qwen2_moe', 'mixtral', "
     r"'glm4_moe', 'deepseek_v3', 'kimi_k2'\)"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported; valid: 'silu'"),
    ({"use_sliding_window": True}, "use_sliding_window=True is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type='yarn' is not supported"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, r"missing key 'rope_parameters.factor'"),
    ({"tie_word_embeddings": None}, "missing key 'tie_word_embeddings'"),
    ({"num_hidden_layers": "two"}, r"num_hidden_layers='two' must be an integer ≥ 1"),
    ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
]


@pytest.mark.parametrize(("change", "match"), UNSUPPORTED)
def test_unsupported_configs_name_the_key(change: dict[str, Any], match: str) -> None:
    cfg = {k: v for k, v in {**QWEN2_JSON, **change}.items() if v is not None}
    with pytest.raises((KeyError, ValueError, NotImplementedError), match=match):
        HFArch.from_hf(cfg, source="x/config.json")


# --- how TP/PP/VPP split it ---------------------------------------------------------------------

TP, PP, VPP = "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size"


def arch_of(**change: int) -> HFArch:
    return HFArch.from_hf({**QWEN2_JSON, **change})


def test_split_problems_name_the_size_and_the_valid_values() -> None:
    arch = arch_of(num_attention_heads=8, num_key_value_heads=2, intermediate_size=96, num_hidden_layers=6)
    assert arch.split_problems(tp=2, pp=3) == []
    assert arch.split_problems(tp=4, pp=1) == [
        (TP, 4, "must divide the model's 2 KV heads (GQA groups) (valid: [1, 2])")]
    assert arch.split_problems(tp=1, pp=4) == [(PP, 4, "must divide the model's 6 layers (valid: [1, 2, 3, 6]), or "
                                                      "set override_transformer_config.num_layers_in_first_pipeline_"
                                                      "stage / num_layers_in_last_pipeline_stage (uneven end stages)")]
    assert arch.split_problems(tp=1, pp=4, first=3, last=1) == []  # 3 + 1 + 1 + 1 (hybridrl.megatron.stages)
    assert [(k, v) for k, v, _ in arch.split_problems(tp=64, pp=1)] == [(TP, 64), (TP, 64), (TP, 64)]
    assert arch.split_problems(tp=64, pp=1)[0][2] == ("must divide the model's 8 attention heads "
                                                      "(valid: [1, 2, 4, 8])")


def test_split_problems_intermediate_size() -> None:
    arch = arch_of(num_attention_heads=8, num_key_value_heads=8, intermediate_size=100)
    (problem,) = arch.split_problems(tp=8, pp=1)
    assert problem[:2] == (TP, 8)
    assert "intermediate_size=100" in problem[2] and problem[2].endswith("(valid for this model: [1, 2, 4])")


def test_split_problems_virtual_pipeline() -> None:
    arch = arch_of(num_hidden_layers=8)
    assert arch.split_problems(tp=1, pp=2, vpp=2) == []
    assert arch.split_problems(tp=1, pp=2, vpp=3) == [
        (VPP, 3, "PP×VPP = 2×3 = 6 must divide the model's 8 layers (each chunk holds equal layers); "
                 "valid at PP=2: null or [2, 4]")]
    assert arch.split_problems(tp=1, pp=3, vpp=2)[-1][2].endswith("valid at PP=3: null or none")


def test_check_split_raises_the_same_problems() -> None:
    arch = HFArch.from_hf(Qwen2Config(**SMALL))
    arch.check_split(tp=2, pp=2)
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=4: must divide the model's 2 KV heads"):
        arch.check_split(tp=4, pp=1)
    with pytest.raises(ValueError, match=r"pipeline_model_parallel_size=3: must divide the model's 2 layers"):
        arch.check_split(tp=1, pp=3)
    with pytest.raises(ValueError, match=r"virtual_pipeline_model_parallel_size=2: PP×VPP = 2×2 = 4"):
        arch.check_split(tp=1, pp=2, vpp=2)


# --- the directory ------------------------------------------------------------------------------


def copy_of(model: Path, dst: Path, *, skip: tuple[str, ...] = ()) -> Path:
    dst.mkdir()
    for f in model.iterdir():
        if f.name not in skip:
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_inspect_a_good_dir(tiny: Path) -> None:
    arch, problems = inspect_model_dir(tiny)
    assert problems == [] and arch == HFArch.from_hf(tiny)


@pytest.mark.parametrize(("change", "match"), UNSUPPORTED[:4])
def test_inspect_reports_what_the_model_builder_would_refuse(tiny: Path, tmp_path: Path, change: dict[str, Any],
                                                             match: str) -> None:
    d = copy_of(tiny, tmp_path / "m")
    (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), **change}))
    arch, problems = inspect_model_dir(d)
    assert arch is None and len(problems) == 1, problems
    assert problems[0].startswith(f"{d / 'config.json'}: ") and re.search(match, problems[0]), problems


def test_inspect_reports_missing_files(tiny: Path, tmp_path: Path) -> None:
    assert inspect_model_dir(tmp_path / "nope") == (
        None, [f"directory {tmp_path / 'nope'} does not exist (an HF checkpoint: config.json + *.safetensors + "
               "tokenizer)"])
    d = copy_of(tiny, tmp_path / "m", skip=("config.json", "model.safetensors", "tokenizer.json",
                                            "tokenizer_config.json"))
    (d / "pytorch_model.bin").write_bytes(b"")
    arch, problems = inspect_model_dir(d)
    assert arch is None
    assert problems == [
        f"{d / 'config.json'} is missing",
        f"{d} holds no model.safetensors or model.safetensors.index.json (only *.bin weights: hybridrl reads "
        "safetensors; re-save with safe_serialization=True)",
        f"{d} holds no tokenizer (one of tokenizer.json, tokenizer_config.json, tokenizer.model, vocab.json)",
    ]
    (d / "config.json").write_text("{not json")
    assert "config.json is not a usable HF checkpoint file (JSONDecodeError" in inspect_model_dir(d)[1][0]
    assert inspect_model_dir(d, tokenizer_path=tiny)[1][-1].startswith(f"{d} holds no model.safetensors")


# --- safetensors and EOS ------------------------------------------------------------------------


def test_checkpoint_shapes_single_file(tiny: Path) -> None:
    shapes = checkpoint_shapes(tiny)
    state = load_file(tiny / "model.safetensors")
    assert "lm_head.weight" not in state  # tied: the stream may still name the output layer
    assert shapes == {**{k: tuple(v.shape) for k, v in state.items()},
                      "lm_head.weight": tuple(state["model.embed_tokens.weight"].shape)}


def test_sharded_save_reads_back_the_same(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = load_file(tiny / "model.safetensors")
    monkeypatch.setattr(hf_write, "SHARD_BYTES", 20_000)
    out = tmp_path / "sharded"
    save_hf_checkpoint([list(state.items())[:5], list(state.items())[5:]], out, source_dir=tiny)
    assert (out / "model.safetensors.index.json").is_file() and not (out / "model.safetensors").exists()
    assert len(set(tensor_files(out).values())) > 1
    assert checkpoint_shapes(out) == checkpoint_shapes(tiny)
    assert {f.name for f in out.iterdir()} >= {"config.json", "generation_config.json", "tokenizer.json"}
    with SafetensorsReader(out) as reader:
        for name, tensor in state.items():
            assert torch.equal(reader.read(name), tensor)
        assert torch.equal(reader.read("model.embed_tokens.weight", (slice(2, 5),)),
                           state["model.embed_tokens.weight"][2:5])
        with pytest.raises(KeyError, match="has no tensor 'nope'"):
            reader.read("nope")


def test_shapes_name_the_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}: no model.safetensors or "):
        checkpoint_shapes(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors file"):
        checkpoint_shapes(tmp_path)


def test_eos_token_ids(tiny: Path, tmp_path: Path) -> None:
    config_eos = json.loads((tiny / "config.json").read_text())["eos_token_id"]
    assert eos_token_ids(tiny) == json.loads((tiny / "generation_config.json").read_text())["eos_token_id"]
    d = copy_of(tiny, tmp_path / "m", skip=("generation_config.json",))
    assert eos_token_ids(d) == [config_eos]
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=f"{d}: no config.json"):
        eos_token_ids(d)
