"""grpo_deepseek_v3_tiny and its warm start sft_deepseek_v3_tiny: both recipes plan in an empty cache, and
``build_if_missing: tiny_deepseek_v3`` builds what they claim — DeepSeek-V3's features at tiny widths."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open

from hybridrl.bootstrap import ensure_model
from hybridrl.cli import main
from hybridrl.config.compose import compose_config
from hybridrl.config.validate import validate_sft
from hybridrl.hf.arch import HFArch


def test_the_grpo_recipe_validates_before_its_warm_start_exists(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """R3 on the hf engine with a DeepSeek-V3 start model that the run builds first (sft:sft_deepseek_v3_tiny)."""
    monkeypatch.setenv("HYBRIDRL_CACHE_DIR", str(tmp_path))
    capsys.readouterr()
    code = main(["validate", "recipe=grpo_deepseek_v3_tiny"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "the run builds it first (build_if_missing=sft:sft_deepseek_v3_tiny)" in out.out + out.err, out.out


def test_the_sft_recipe_validates_before_its_model_exists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDRL_CACHE_DIR", str(tmp_path))
    cfg = compose_config(["recipe=sft_deepseek_v3_tiny"], config_name="sft")
    assert cfg.model.build_if_missing == "tiny_deepseek_v3"
    validate_sft(cfg, before_bootstrap=True)


def test_tiny_deepseek_v3_has_the_real_architectures_features(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDRL_CACHE_DIR", str(tmp_path))
    out = tmp_path / "tiny" / "random-deepseek-v3"
    ensure_model("tiny_deepseek_v3", str(out))
    arch = HFArch.from_hf(out)
    assert arch.family == "deepseek_v3" and not arch.tie_word_embeddings
    assert arch.mla is not None and arch.mla.q_lora_rank is not None  # MLA with the query LoRA
    moe = arch.moe
    assert moe is not None
    assert moe.sparse_layers == (False, True, True, True)  # first_k_dense_replace 1
    assert moe.score_function == "sigmoid" and moe.expert_bias
    assert (moe.num_groups, moe.group_topk, moe.top_k, moe.num_experts) == (2, 1, 2, 8)
    assert moe.scaling_factor == 2.5 and moe.shared_ffn_hidden_size > 0 and not moe.shared_expert_gate
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert "model.layers.1.mlp.gate.e_score_correction_bias" in set(f.keys())
