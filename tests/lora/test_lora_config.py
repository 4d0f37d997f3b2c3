"""LoRA config (verl's keys under ``actor_rollout_ref.model`` / SFT's ``model``): target names, and the static
checks that report bad values with their keys before any model is built."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridrl.config.compose import compose_config
from hybridrl.config.errors import ConfigError
from hybridrl.config.validate import validate, validate_sft
from hybridrl.lora.config import HF_PROJECTIONS, LoRAConfig, resolve_targets
from hybridrl.models.tiny import make_tiny_model


def test_targets_accept_hf_and_megatron_names_and_all_linear() -> None:
    assert resolve_targets("all-linear") == tuple(HF_PROJECTIONS)
    assert resolve_targets(["v_proj", "q_proj"]) == ("q_proj", "v_proj")  # HF order, whatever the given order
    assert resolve_targets(["linear_fc1", "o_proj"]) == ("o_proj", "gate_proj", "up_proj")
    assert resolve_targets(["linear_qkv"]) == ("q_proj", "k_proj", "v_proj")
    with pytest.raises(ValueError, match="unknown target module 'qkv_proj'; valid: all-linear, q_proj"):
        resolve_targets(["qkv_proj"])


def test_rank_zero_is_off_and_scaling_is_alpha_over_rank() -> None:
    cfg = compose_config(["recipe=grpo_tiny"])
    assert LoRAConfig.from_model(cfg.actor_rollout_ref.model) is None  # lora_rank 0: full fine-tuning
    lora = compose_config(["recipe=grpo_lora_tiny", "actor_rollout_ref.model.target_modules=[q_proj,v_proj]"])
    got = LoRAConfig.from_model(lora.actor_rollout_ref.model)
    assert got == LoRAConfig(rank=16, alpha=32.0, dropout=0.0, projections=("q_proj", "v_proj"))
    assert got.scaling == 2.0
    sft = compose_config(["recipe=sft_lora_tiny"], config_name="sft")
    assert LoRAConfig.from_model(sft.model) == LoRAConfig(rank=16, alpha=32.0, projections=tuple(HF_PROJECTIONS))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lora_cfg") / "m"
    make_tiny_model(out, hidden=64, layers=2, heads=4, kv_heads=2, max_positions=128)
    return out


def test_rl_validation_names_every_bad_lora_key(model: Path) -> None:
    cfg = compose_config(["recipe=grpo_lora_tiny", f"actor_rollout_ref.model.path={model}",
                          "actor_rollout_ref.model.build_if_missing=null", "actor_rollout_ref.model.lora_rank=-2",
                          "actor_rollout_ref.model.lora_alpha=0", "actor_rollout_ref.model.lora_dropout=1.5",
                          "actor_rollout_ref.model.target_modules=[q_proj,attn]"])
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=1, before_bootstrap=True)
    text = str(e.value)
    for needle in ("actor_rollout_ref.model.lora_rank=-2: must be an integer ≥ 0 (0 = LoRA off)",
                   "actor_rollout_ref.model.lora_alpha=0",
                   "actor_rollout_ref.model.lora_dropout=1.5: must be in [0, 1)",
                   "actor_rollout_ref.model.target_modules=['q_proj', 'attn']: unknown module(s) ['attn']; valid: "
                   "all-linear, q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, linear_qkv"):
        assert needle in text, text


def test_sft_validation_names_the_sft_key(model: Path) -> None:
    cfg = compose_config(["recipe=sft_lora_tiny", f"model.path={model}", "model.build_if_missing=null",
                          "model.target_modules=[]"], config_name="sft")
    with pytest.raises(ConfigError, match=r"model.target_modules=\[\]: must name at least one module"):
        validate_sft(cfg, world_size=1, before_bootstrap=True)
