"""A vision-language run's plan: Qwen2.5-VL-7B's real config.json validates for 8 × 80 GB with its vision tower in the
plan and the memory; its parameter count is transformers'; a text recipe pointed at a VLM checkpoint, and the offline
trainers without an image path (DPO, the reward model), are refused before anything is built."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.tiny_vlm import make_tiny_qwen2_5_vl

from hybridrl.cli import main
from hybridrl.hf.vlm import vision_parameters

REPO = Path(__file__).resolve().parents[2]
VL7B = str(REPO / "recipes" / "model_configs" / "qwen2.5-vl-7b.json")
QWEN3_VL8B = str(REPO / "recipes" / "model_configs" / "qwen3-vl-8b.json")


def _memory_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("memory"))


def test_the_7b_recipe_plans_its_vision_tower_on_8_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "recipe=grpo_qwen2_5_vl_7b", "--model-config", VL7B]) == 0
    out = capsys.readouterr().out
    assert "vision  tower of 0.68 B parameters (32 blocks, hidden 1280, merge 2×2), replicated on every first-stage " \
           "rank, trained" in out
    assert "note: a vision-language model: its prompts' images go to the rollout engine" in out and "config OK" in out
    trained = _memory_line(out)
    train_gb = float(re.search(r"train ([\d.]+) GB", trained)[1])  # type: ignore[index]
    assert train_gb < 80
    # a frozen tower has no gradients or optimizer state: 0.68 B × (4 + 12 / DP 2) bytes ≈ 6.8 GB less
    assert main(["validate", "recipe=grpo_qwen2_5_vl_7b", "--model-config", VL7B,
                 "actor_rollout_ref.actor.freeze_vision_tower=true"]) == 0
    frozen = capsys.readouterr().out
    assert ", frozen (actor_rollout_ref.actor.freeze_vision_tower)" in frozen
    frozen_gb = float(re.search(r"train ([\d.]+) GB", _memory_line(frozen))[1])  # type: ignore[index]
    assert train_gb - frozen_gb == pytest.approx(0.6766 * (4 + 12 / 2), abs=0.15)


def test_vision_parameter_count_is_transformers() -> None:
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    config = dict(depth=3, hidden_size=40, intermediate_size=56, num_heads=2, patch_size=6, spatial_merge_size=3,
                  temporal_patch_size=2, out_hidden_size=72, window_size=36, fullatt_block_indexes=[2])
    tower = Qwen2_5_VisionTransformerPretrainedModel(Qwen2_5_VLVisionConfig(**config))
    assert vision_parameters(config) == sum(p.numel() for p in tower.parameters())


def test_what_does_not_take_images_is_refused_before_anything_is_built(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    model = make_tiny_qwen2_5_vl(tmp_path / "vl", tie=True)
    code = main(["validate", "recipe=grpo_tiny", f"actor_rollout_ref.model.path={model}",
                 "actor_rollout_ref.model.build_if_missing=null"])
    err = capsys.readouterr().err
    assert code == 2 and "data.apply_chat_template=False" in err and "renders a prompt's image parts" in err
    assert main(["validate", "recipe=dpo_tiny", f"model.path={model}", "model.build_if_missing=null"]) == 2
    assert "DPO and the reward model do not take images yet" in capsys.readouterr().err


def test_qwen3_vl_8b_plans_at_tp2_pp2_cp2_and_deepstack_needs_its_layers_on_the_first_stage(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Qwen3-VL-8B's real config.json (transformers 4's layout: ``rope_scaling.mrope_interleaved``) on verl's layout
    for it; a first stage of fewer layers than its three DeepStack layers is refused by key."""
    assert main(["validate", "recipe=grpo_qwen3_vl_8b", "--model-config", QWEN3_VL8B]) == 0
    out = capsys.readouterr().out
    assert "actor   TP=2 PP=2 CP=2 DP=1" in out and "model   qwen3: 36 layers" in out and "config OK" in out
    assert "vision  tower of 0.58 B parameters (27 blocks, hidden 1152, merge 2×2)" in out
    assert float(re.search(r"train ([\d.]+) GB", _memory_line(out))[1]) < 80  # type: ignore[index]
    key = "actor_rollout_ref.actor.megatron.override_transformer_config.num_layers_in_first_pipeline_stage"
    assert main(["validate", "recipe=grpo_qwen3_vl_8b", "--model-config", QWEN3_VL8B, f"+{key}=2"]) == 2
    err = capsys.readouterr().err
    assert f"{key}=2" in err and "DeepStack adds image features after layers 0..2" in err and "at least 3" in err
