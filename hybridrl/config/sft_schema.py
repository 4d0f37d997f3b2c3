"""Typed config of an SFT run (``launch/sft.py``; registered in Hydra's ConfigStore as ``hybridrl_sft_schema``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridrl.config.schema import MegatronConfig, ModelConfig, OptimConfig


@dataclass(kw_only=True, slots=True)
class SFTDataConfig:
    train_files: list[str] = field(default_factory=list)  # parquet / jsonl
    val_files: list[str] = field(default_factory=list)  # held-out pairs: `val/loss` every trainer.test_freq steps
    prompt_key: str = "prompt"
    response_key: str = "ground_truth"  # the target text; EOS is appended
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
    output_dir: str = "outputs/sft"
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])  # entries of hybridrl.tracking.LOGGERS
    project_name: str = "hybridrl"
    experiment_name: str = "sft"
    nnodes: int = 1
    n_gpus_per_node: int = 1  # ranks per node (CPU processes on a CPU machine)
    save_path: str = "outputs/sft/hf"  # the HF checkpoint written at the end
    # replace whatever is at save_path (default: refuse a non-empty directory that is not an earlier
    # hybridrl snapshot written to this same path)
    overwrite_save_path: bool = False


@dataclass(kw_only=True, slots=True)
class SFTConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4))
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    trainer: SFTTrainerConfig = field(default_factory=SFTTrainerConfig)
