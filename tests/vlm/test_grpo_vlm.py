"""GRPO on images end to end (``grpo_vlm_tiny``'s path on a small random Qwen2.5-VL and Qwen3-VL): the dots task's
images reach
the ``hf`` engine and the actor's vision tower, the tower trains and its weights reach the engine in place (the
engine's and the actor's log-probs stay equal after every update), and a VLM run's settings that do not carry images
yet are refused before anything is built, each naming its key."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.e2e import TRAIN, read_metrics

from hybridrl.cli import main
from hybridrl.config.compose import compose_config
from hybridrl.config.errors import ConfigError
from hybridrl.config.validate import validate
from hybridrl.data.dots import DotsTaskConfig, write_dots_splits
from hybridrl.models.tiny import TinyModelSpec
from hybridrl.models.tiny_vlm import make_tiny_vlm


@pytest.fixture(scope="module")
def vlm_task(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("grpo_vlm")
    # head_dim 32: the smallest vLLM's CPU attention takes
    text = TinyModelSpec(hidden=64, layers=2, heads=2, kv_heads=2, seed=4)
    model = make_tiny_vlm(tmp / "model", text=text)
    qwen3 = make_tiny_vlm(tmp / "qwen3", text=text, family="qwen3_vl")  # DeepStack after layer 0
    data = write_dots_splits(tmp / "dots", DotsTaskConfig(num_train=32, num_test=16, seed=3))
    return {"model": model, "qwen3_vl": qwen3, **data}


def _overrides(task: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return ["recipe=grpo_vlm_tiny", f"actor_rollout_ref.model.path={task['model']}",
            "actor_rollout_ref.model.build_if_missing=null", f"data.train_files=[{task['train']}]",
            f"data.val_files=[{task['test']}]", "data.build_if_missing=null", f"trainer.output_dir={out}",
            "trainer.save_freq=2",
            "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.optim.lr=1e-2", "actor_rollout_ref.actor.entropy_coeff=0.01",
            "data.val_batch_size=16", "trainer.total_training_steps=2",
            "trainer.test_freq=2", *extra]


@pytest.mark.e2e
# vllm and sglang: tests/rollout/engines/test_{vllm,sglang}_engine_images.py check each engine's generate(images=)
# against transformers and its in-place swap under the checkpoint names this stream sends (the tower's included); the
# rollout's way of handing images to an engine is the same for every engine. The CI budget keeps one engine here (a
# vllm run of this test: 45 s, engine/actor ≤ 1e-5 after the tower moved, measured Dec 7 2026)
# Qwen2.5-VL trains its tower (its sync is checked); Qwen3-VL runs LoRA (its tower, DeepStack mergers included, is
# frozen with the base; the tower's stream is one code path for both families). A third case costs ~15 s of CI.
@pytest.mark.parametrize(("engine", "family", "lora"), [("hf", "qwen2_5_vl", False), ("hf", "qwen3_vl", True)])
def test_grpo_on_images_keeps_engine_and_actor_equal(torchrun, vlm_task: dict[str, Path], tmp_path: Path,
                                                     engine: str, family: str, lora: bool) -> None:
    """Two steps of 2 optimizer steps at lr 1e-2 with an entropy bonus (a gradient whatever the rewards of a random
    model: the tower moves): the engine's log-probs of its own samples equal the actor's at step 2 too, which they
    would not if the tower's new weights missed the engine. hf ~15 s; vllm
    ~50 s (its engine start). With LoRA (tower frozen with the base): the merged weights reach the engine and the
    exported peft adapter names the checkpoint's language-model modules."""
    out = tmp_path / "run"
    # verl's geo3k scripts' vLLM key: vLLM starts with mm_processor_cache_gb=0
    verl_key = ["actor_rollout_ref.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache=True"] * (engine == "vllm")
    model = [f"actor_rollout_ref.model.path={vlm_task['qwen3_vl']}"] if family == "qwen3_vl" else []
    # the recipe freezes its tiny tower (it collapses when trained); here it trains, so that its sync is checked.
    # LoRA freezes it with the base weights (a note says so)
    lora_keys = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
                 "actor_rollout_ref.model.target_modules=all-linear"] if lora else []
    lora_keys.append("actor_rollout_ref.actor.freeze_vision_tower=false")
    torchrun([TRAIN, *_overrides(vlm_task, out, f"actor_rollout_ref.rollout.name={engine}", *verl_key, *model,
                                 *lora_keys)], nproc=1)
    rows = [r for r in read_metrics(out) if "rollout/logprob_abs_diff" in r]
    assert len(rows) == 2 and rows[0]["actor/grad_norm"] > 0
    for r in rows:
        assert r["rollout/logprob_abs_diff"] <= 1e-5, r  # measured ~1e-7
        assert 0.0 <= r["reward/mean"] <= 1.0
    assert any("eval/accuracy" in r for r in read_metrics(out))
    base = vlm_task["qwen3_vl" if family == "qwen3_vl" else "model"]
    _check_the_export(out / "checkpoints" / "step_00000002", tmp_path, base, tower_trained=not lora)
    if lora:
        _check_the_peft_adapter(out / "checkpoints" / "step_00000002", tmp_path, base)


def _check_the_export(ckpt: Path, tmp_path: Path, base: Path, *, tower_trained: bool) -> None:
    """``hybridrl export-hf`` writes every tensor of the checkpoint's model, the vision tower's included: trained,
    or (LoRA) as the base model's."""
    import torch
    from safetensors.torch import load_file

    assert main(["export-hf", str(ckpt), str(tmp_path / "merged")]) == 0
    exported, start = load_file(tmp_path / "merged" / "model.safetensors"), load_file(base / "model.safetensors")
    assert exported.keys() == start.keys()
    tower = [k for k in start if ".visual." in k or k.startswith("visual.")]
    assert tower and any(not torch.equal(exported[k], start[k]) for k in tower) == tower_trained

def _check_the_peft_adapter(ckpt: Path, tmp_path: Path, base: Path) -> None:
    """peft loads the exported adapter onto the base Qwen3-VL (its module names: ``model.language_model.layers.*``)
    and gives the merged export's logits on an image."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    assert main(["export-hf", str(ckpt), str(tmp_path / "adapter"), "--adapter"]) == 0
    names = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert names and all(".model.language_model.layers." in n for n in names), sorted(names)[:3]
    peft = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(base), tmp_path / "adapter").eval()
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged").eval()
    cfg = merged.config
    ids = torch.tensor([[5, cfg.vision_start_token_id, *[cfg.image_token_id] * 4, cfg.vision_end_token_id, 7, 8]])
    kw = dict(input_ids=ids, pixel_values=torch.randn(16, 3 * 2 * 16 * 16), image_grid_thw=torch.tensor([[1, 4, 4]]),
              mm_token_type_ids=(ids == cfg.image_token_id).int())
    with torch.no_grad():
        assert float((peft(**kw).logits - merged(**kw).logits).abs().max()) <= 1e-4


def test_settings_without_images_are_refused_by_key(vlm_task: dict[str, Path], tmp_path: Path) -> None:
    cfg = compose_config(_overrides(
        vlm_task, tmp_path, "algorithm.adv_estimator=gae",
        "actor_rollout_ref.actor.use_prefix_grouper=true", "trainer.n_gpus_per_node=4"))
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    text = str(e.value)
    for key in ("critic.enable", "actor_rollout_ref.actor.use_prefix_grouper"):
        assert key in text and "not with a vision-language model yet" in text, key


def test_vlm_plan_runs_padded_rows_without_sequence_parallelism(vlm_task: dict[str, Path], tmp_path: Path) -> None:
    """verl's Qwen2.5-VL scripts set use_remove_padding=true and its Megatron recipe sequence_parallel=true: the run
    takes padded rows and no sequence parallelism, and says so."""
    plan = validate(compose_config(_overrides(vlm_task, tmp_path,
                                              "actor_rollout_ref.actor.megatron.use_remove_padding=true",
                                              "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                                              "actor_rollout_ref.actor.megatron.sequence_parallel=true",
                                              "trainer.n_gpus_per_node=2")))
    assert not plan.batch.update.packed and not plan.batch.update.shared_prompts
    assert any("padded rows" in n for n in plan.notes)
    assert plan.config.actor_rollout_ref.actor.megatron.sequence_parallel is False
    assert any("sequence_parallel=true is off for a vision-language model" in n for n in plan.notes)
