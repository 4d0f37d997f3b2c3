"""GRPO on images end to end (``grpo_vlm_tiny``'s path on a small random Qwen2.5-VL): the dots task's images reach
the ``hf`` engine and the actor's vision tower, the tower trains and its weights reach the engine in place (the
engine's and the actor's log-probs stay equal after every update), and a VLM run's settings that do not carry images
yet are refused before anything is built, each naming its key."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.e2e import TRAIN, read_metrics

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
    model = make_tiny_vlm(tmp / "model", text=TinyModelSpec(hidden=64, layers=2, heads=2, kv_heads=2, seed=4))
    data = write_dots_splits(tmp / "dots", DotsTaskConfig(num_train=32, num_test=16, seed=3))
    return {"model": model, **data}


def _overrides(task: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return ["recipe=grpo_vlm_tiny", f"actor_rollout_ref.model.path={task['model']}",
            "actor_rollout_ref.model.build_if_missing=null", f"data.train_files=[{task['train']}]",
            f"data.val_files=[{task['test']}]", "data.build_if_missing=null", f"trainer.output_dir={out}",
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
@pytest.mark.parametrize("engine", ["hf"])
def test_grpo_on_images_keeps_engine_and_actor_equal(torchrun, vlm_task: dict[str, Path], tmp_path: Path,
                                                     engine: str) -> None:
    """Two steps of 2 optimizer steps at lr 1e-2 with an entropy bonus (a gradient whatever the rewards of a random
    model: the tower moves): the engine's log-probs of its own samples equal the actor's at step 2 too, which they
    would not if the tower's new weights missed the engine. hf ~15 s; vllm ~50 s (its engine start)."""
    out = tmp_path / "run"
    # verl's geo3k scripts' vLLM key: vLLM starts with mm_processor_cache_gb=0
    verl_key = ["actor_rollout_ref.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache=True"] * (engine == "vllm")
    torchrun([TRAIN, *_overrides(vlm_task, out, f"actor_rollout_ref.rollout.name={engine}", *verl_key)], nproc=1)
    rows = [r for r in read_metrics(out) if "rollout/logprob_abs_diff" in r]
    assert len(rows) == 2 and rows[0]["actor/grad_norm"] > 0
    for r in rows:
        assert r["rollout/logprob_abs_diff"] <= 1e-5, r  # measured ~1e-7
        assert 0.0 <= r["reward/mean"] <= 1.0
    assert any("eval/accuracy" in r for r in read_metrics(out))


def test_settings_without_images_are_refused_by_key(vlm_task: dict[str, Path], tmp_path: Path) -> None:
    cfg = compose_config(_overrides(
        vlm_task, tmp_path, "actor_rollout_ref.actor.megatron.context_parallel_size=2",
        "actor_rollout_ref.model.lora_rank=4",
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.actor.use_prefix_grouper=true", "trainer.n_gpus_per_node=4"))
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    text = str(e.value)
    for key in ("actor_rollout_ref.actor.megatron.context_parallel_size", "actor_rollout_ref.model.lora_rank",
                "critic.enable", "actor_rollout_ref.actor.use_prefix_grouper"):
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
