"""Typed config of a DPO run (``launch/dpo.py``; registered in Hydra's ConfigStore as ``hybridrl_dpo_schema``).

``model``, ``megatron``, ``optim`` and ``trainer`` are SFT's own dataclasses (the same keys, checks and
policy build); ``data`` counts **pairs** (each pair is two sequences, chosen and rejected, that always
share a micro-batch); ``algorithm`` holds the loss (:mod:`hybridrl.algorithms.dpo_loss`; TRL's key names).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from hybridrl.algorithms.dpo_loss import DPO_LOSS_TYPES
from hybridrl.config.compose import register_configs
from hybridrl.config.errors import ConfigError, ConfigIssue
from hybridrl.config.offline_compose import compose_offline, to_typed_offline
from hybridrl.config.schema import MegatronConfig, ModelConfig, OptimConfig
from hybridrl.config.sft_schema import SFTConfig, SFTDataConfig, SFTTrainerConfig
from hybridrl.config.validate import validate_sft

DPO_SCHEMA_NAME = "hybridrl_dpo_schema"


@dataclass(kw_only=True, slots=True)
class DPODataConfig:
    train_files: list[str] = field(default_factory=list)  # parquet / jsonl rows (prompt, chosen, rejected)
    val_files: list[str] = field(default_factory=list)  # held-out pairs: val/ metrics every trainer.test_freq steps
    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    apply_chat_template: bool = True
    max_prompt_length: int = 64  # longer prompts are dropped
    max_response_length: int = 64  # longer responses are truncated (EOS kept)
    train_batch_size: int = 32  # pairs per optimizer step, over all DP ranks
    micro_batch_size_per_gpu: int = 8  # pairs per forward/backward (2 × this many sequences)
    shuffle: bool = True
    build_if_missing: str | None = None  # e.g. "arithmetic_preference": write the files when they don't exist


@dataclass(kw_only=True, slots=True)
class DPOAlgorithmConfig:
    beta: float = 0.1  # β: scale of the implicit reward β (log π − log π_ref)
    label_smoothing: float = 0.0  # cDPO's ε in [0, 0.5): the chance that a label is flipped (sigmoid only)
    loss_type: str = "sigmoid"  # one of DPO_LOSS_TYPES: sigmoid (DPO, cDPO), ipo


@dataclass(kw_only=True, slots=True)
class DPOConfig:
    model: ModelConfig = field(default_factory=ModelConfig)  # the policy, and the frozen reference
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))
    data: DPODataConfig = field(default_factory=DPODataConfig)
    algorithm: DPOAlgorithmConfig = field(default_factory=DPOAlgorithmConfig)
    trainer: SFTTrainerConfig = field(default_factory=lambda: SFTTrainerConfig(
        output_dir="outputs/dpo", experiment_name="dpo", save_path="outputs/dpo/hf"))


def register_dpo_configs() -> None:
    """Register the DPO schema (and everything :func:`register_configs` registers); idempotent."""
    register_configs()
    ConfigStore.instance().store(name=DPO_SCHEMA_NAME, node=DPOConfig)


def compose_dpo(overrides: Sequence[str] = ()) -> DPOConfig:
    """Compose ``recipes/dpo.yaml`` + overrides (e.g. ``recipe=dpo_tiny``) into a typed ``DPOConfig``."""
    register_dpo_configs()
    return compose_offline("dpo", DPOConfig, overrides)


def to_typed_dpo(cfg: DictConfig) -> DPOConfig:
    """A composed DictConfig as a ``DPOConfig``; every missing value is reported."""
    return to_typed_offline(cfg, DPOConfig)


class PairRun(Protocol):
    """What :func:`sft_view` reads: a run on preference pairs (DPO, the reward model)."""

    model: ModelConfig
    megatron: MegatronConfig
    optim: OptimConfig
    data: DPODataConfig
    trainer: SFTTrainerConfig


def sft_view(cfg: PairRun) -> SFTConfig:
    """The SFT config with the same model, parallelism, optimizer, data sizes and trainer: SFT's static
    checks apply to a DPO (or reward-model) run unchanged (in pairs where SFT counts samples), under the same keys."""
    d = cfg.data
    return SFTConfig(model=cfg.model, megatron=cfg.megatron, optim=cfg.optim, trainer=cfg.trainer, data=SFTDataConfig(
        train_files=d.train_files, val_files=d.val_files, prompt_key=d.prompt_key, response_key=d.chosen_key,
        apply_chat_template=d.apply_chat_template, max_prompt_length=d.max_prompt_length,
        max_response_length=d.max_response_length, train_batch_size=d.train_batch_size,
        micro_batch_size_per_gpu=d.micro_batch_size_per_gpu, shuffle=d.shuffle, build_if_missing=d.build_if_missing))


def dpo_problems(cfg: DPOConfig) -> list[ConfigIssue]:
    """What is wrong with ``algorithm`` and the pair columns (the rest is SFT's to check)."""
    a, d = cfg.algorithm, cfg.data
    issues = []
    if cfg.trainer.target_accuracy is not None:
        issues.append(ConfigIssue(key="trainer.target_accuracy", value=cfg.trainer.target_accuracy,
                                  message="is SFT's (held-out greedy accuracy); a DPO run trains "
                                          "trainer.total_training_steps steps: set it to null"))
    if a.loss_type not in DPO_LOSS_TYPES:
        issues.append(ConfigIssue(key="algorithm.loss_type", value=a.loss_type,
                                  message=f"valid: {', '.join(DPO_LOSS_TYPES)}"))
    if not a.beta > 0:
        issues.append(ConfigIssue(key="algorithm.beta", value=a.beta, message="must be > 0 (e.g. 0.1)"))
    if not 0 <= a.label_smoothing < 0.5:
        issues.append(ConfigIssue(key="algorithm.label_smoothing", value=a.label_smoothing,
                                  message="must be in [0, 0.5) (cDPO's flip probability; 0 = DPO)"))
    elif a.label_smoothing and a.loss_type == "ipo":
        issues.append(ConfigIssue(key="algorithm.label_smoothing", value=a.label_smoothing,
                                  message="applies to loss_type=sigmoid only; set it to 0 for ipo"))
    return issues + pair_column_problems(d)


def pair_column_problems(d: DPODataConfig, **more: str | None) -> list[ConfigIssue]:
    """What is wrong with the pair columns' names (and ``more``: other columns the run reads, by key)."""
    issues = []
    keys = {"data.prompt_key": d.prompt_key, "data.chosen_key": d.chosen_key, "data.rejected_key": d.rejected_key}
    for key, value in keys.items():
        if not value:
            issues.append(ConfigIssue(key=key, value=value, message="must name a column"))
    if len(set(keys.values())) < len(keys):
        issues.append(ConfigIssue(key="data.rejected_key", value=d.rejected_key,
                                  message=f"the prompt, chosen and rejected columns must differ, got {keys}"))
    for key, value in more.items():
        if value is not None and value in keys.values():
            issues.append(ConfigIssue(key=key, value=value, message=f"must differ from the pair's columns {keys}"))
    return issues


def validate_dpo(cfg: DPOConfig, *, world_size: int | None = None, before_bootstrap: bool = False,
                model_config: Path | None = None) -> None:
    """Every static problem of a DPO run at once (ConfigError), before any model is built."""
    issues = dpo_problems(cfg)
    try:
        validate_sft(sft_view(cfg), world_size=world_size, before_bootstrap=before_bootstrap,
                     model_config=model_config, takes_images=False)
    except ConfigError as e:
        issues = [*e.issues, *issues]
    if issues:
        raise ConfigError(issues)
