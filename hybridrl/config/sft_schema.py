"""Typed config of an SFT run (``launch/sft.py``; registered in Hydra's ConfigStore as ``hybridrl_sft_schema``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridrl.config.schema import MegatronConfig, ModelConfig, OptimConfig


@dataclass(kw_only=True, slots=True)
class SFTModelConfig(ModelConfig):
    # a vision-language model's vision tower (and merger) stays as loaded: no gradients, no optimizer state (the RL
    # trainer's actor_rollout_ref.actor.freeze_vision_tower)
    freeze_vision_tower: bool = False


@dataclass(kw_only=True, slots=True)
class SFTDataConfig:
    train_files: list[str] = field(default_factory=list)  # parquet / jsonl
    val_files: list[str] = field(default_factory=list)  # held-out pairs: `val/loss` every trainer.test_freq steps
    prompt_key: str = "prompt"
    response_key: str = "ground_truth"  # the target text; EOS is appended
    image_key: str = "images"  # a vision-language model's rows: the column of their images (hybridrl.data.multimodal)
    apply_chat_template: bool = True
    max_prompt_length: int = 64
    max_response_length: int = 64  # longer targets are truncated (EOS kept)
    train_batch_size: int = 32  # samples per optimizer step, over all DP ranks
    micro_batch_size_per_gpu: int = 8
    shuffle: bool = True
    build_if_missing: str | None = None  # e.g. "arithmetic": write the files when they don't exist


@dataclass(kw_only=True, slots=True)
class SFTTrainerConfig:
    total_training_steps: int = 100
    seed: int = 1
    test_freq: int = 100  # val/loss on data.val_files every N steps and at the end (0 = never)
    # stop once the held-out greedy accuracy (val/greedy_accuracy, checked every test_freq steps) reaches this;
    # total_training_steps is then the cap, and ending there below the target fails the run, saving nothing (SFT only;
    # null: train total_training_steps steps)
    target_accuracy: float | None = None
    output_dir: str = "outputs/sft"
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])  # entries of hybridrl.tracking.LOGGERS
    project_name: str = "hybridrl"
    experiment_name: str = "sft"
    nnodes: int = 1
    n_gpus_per_node: int = 1  # ranks per node (CPU processes on a CPU machine)
    device_memory_gb: float | None = None  # each GPU's memory for the plan's check (null: the visible GPU's, else 80)
    save_path: str = "outputs/sft/hf"  # the HF checkpoint written at the end
    # replace whatever is at save_path (default: refuse a non-empty directory that is not an earlier
    # hybridrl snapshot written to this same path)
    overwrite_save_path: bool = False


@dataclass(kw_only=True, slots=True)
class SFTConfig:
    model: SFTModelConfig = field(default_factory=SFTModelConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4))
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    trainer: SFTTrainerConfig = field(default_factory=SFTTrainerConfig)


def target_problems(t: SFTTrainerConfig, *, val_files: list[str]) -> list[tuple[str, object, str]]:
    """``(key, value, message)`` for what is wrong with ``trainer.target_accuracy`` (none when it is null)."""
    if t.target_accuracy is None:
        return []
    key, value = "trainer.target_accuracy", t.target_accuracy
    if not 0 < value <= 1:
        return [(key, value, "must be in (0, 1] (a held-out accuracy), or null for a fixed step count")]
    if not val_files:
        return [(key, value, "is measured on held-out pairs: set data.val_files (or trainer.target_accuracy=null)")]
    if t.test_freq <= 0:
        return [(key, value, f"is checked every trainer.test_freq steps, which is {t.test_freq}: set it > 0")]
    return []

