"""Typed config of a reward-model run (``launch/rm.py``; registered in Hydra's ConfigStore as ``hybridrl_rm_schema``).

``model``, ``megatron``, ``optim`` and ``trainer`` are SFT's own dataclasses (the same keys, checks and parallel
layouts); ``data`` is DPO's (pairs: prompt, chosen, rejected; each pair's two sequences share a micro-batch) with an
optional margin column; ``algorithm`` holds the loss (:mod:`hybridrl.algorithms.rm_loss`; TRL's key names).
``trainer.target_accuracy`` is compared with the held-out ``eval/pair_accuracy``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from hybridrl.config.compose import register_configs
from hybridrl.config.dpo_schema import DPODataConfig, pair_column_problems, sft_view
from hybridrl.config.errors import ConfigError, ConfigIssue
from hybridrl.config.offline_compose import compose_offline, to_typed_offline
from hybridrl.config.schema import MegatronConfig, ModelConfig, OptimConfig
from hybridrl.config.sft_schema import SFTTrainerConfig
from hybridrl.config.validate import validate_sft

RM_SCHEMA_NAME = "hybridrl_rm_schema"


@dataclass(kw_only=True, slots=True)
class RMDataConfig(DPODataConfig):
    # a numeric column: the margin m each pair's scores must be apart by (Llama 2's; null: no margin)
    margin_key: str | None = None


@dataclass(kw_only=True, slots=True)
class RMAlgorithmConfig:
    center_rewards_coefficient: float = 0.0  # c ≥ 0: + c · (r_chosen + r_rejected)² pulls the scores to mean 0


@dataclass(kw_only=True, slots=True)
class RMConfig:
    model: ModelConfig = field(default_factory=ModelConfig)  # the trunk: a causal LM, or a reward model to go on with
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    data: RMDataConfig = field(default_factory=RMDataConfig)
    algorithm: RMAlgorithmConfig = field(default_factory=RMAlgorithmConfig)
    trainer: SFTTrainerConfig = field(default_factory=lambda: SFTTrainerConfig(
        output_dir="outputs/rm", experiment_name="rm", save_path="outputs/rm/hf"))


def register_rm_configs() -> None:
    """Register the reward-model schema (and everything :func:`register_configs` registers); idempotent."""
    register_configs()
    ConfigStore.instance().store(name=RM_SCHEMA_NAME, node=RMConfig)


def compose_rm(overrides: Sequence[str] = ()) -> RMConfig:
    """Compose ``recipes/rm.yaml`` + overrides (e.g. ``recipe=rm_tiny``) into a typed ``RMConfig``."""
    register_rm_configs()
    return compose_offline("rm", RMConfig, overrides)


def to_typed_rm(cfg: DictConfig) -> RMConfig:
    return to_typed_offline(cfg, RMConfig)


def rm_problems(cfg: RMConfig, *, model_config: Path | None = None) -> list[ConfigIssue]:
    """What is wrong with ``algorithm``, the pair columns and the model's head (the rest is SFT's to check)."""
    c = cfg.algorithm.center_rewards_coefficient
    issues = []
    if not (math.isfinite(c) and c >= 0):
        issues.append(ConfigIssue(key="algorithm.center_rewards_coefficient", value=c,
                                  message="must be a number ≥ 0 (0: no centring; TRL suggests 0.01)"))
    issues += pair_column_problems(cfg.data, **{"data.margin_key": cfg.data.margin_key})
    config = model_config if model_config is not None else Path(cfg.model.path) / "config.json"
    if (problem := sequence_classification_problem(config)) is not None:
        planned = model_config is not None
        issues.append(ConfigIssue(key="--model-config" if planned else "model.path",
                                  value=str(model_config) if planned else cfg.model.path, message=problem))
    return issues


def sequence_classification_problem(config: Path) -> str | None:
    """Why the model of this config.json cannot become an HF reward model (None: it can, or it is not there yet):
    its family needs a ``*ForSequenceClassification`` in transformers, which ``reward.name=model`` loads."""
    if not config.is_file():
        return None  # model.path's own check reports it (or build_if_missing builds it)
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES as HEADS

    family = json.loads(config.read_text()).get("model_type")
    if family in HEADS:
        return None
    return (f"is a {family!r} model, for which the installed transformers has no *ForSequenceClassification: the "
            "reward model could be trained but not exported as one that reward.name=model loads")


def validate_rm(cfg: RMConfig, *, world_size: int | None = None, before_bootstrap: bool = False,
                model_config: Path | None = None) -> None:
    """Every static problem of a reward-model run at once (ConfigError), before any model is built."""
    issues = rm_problems(cfg, model_config=model_config)
    try:
        validate_sft(sft_view(cfg), world_size=world_size, before_bootstrap=before_bootstrap,
                     model_config=model_config, takes_images=False)
    except ConfigError as e:
        issues = [*e.issues, *issues]
    if issues:
        raise ConfigError(issues)
