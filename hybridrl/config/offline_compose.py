"""Composing the offline trainers' recipes (DPO, reward model) into their typed configs: ``recipes/<root>.yaml`` +
overrides → the root's dataclass, every missing value reported at once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hybridrl.config.compose import hydra_error
from hybridrl.config.errors import ConfigError, ConfigIssue
from hybridrl.paths import recipes_dir

C = TypeVar("C")


def compose_offline(root: str, schema: type[C], overrides: Sequence[str] = ()) -> C:
    """``recipes/<root>.yaml`` + ``overrides`` (e.g. ``recipe=rm_tiny``) as a ``schema``; its schema must be
    registered in Hydra's ConfigStore first."""
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(recipes_dir()), version_base="1.3"):
            cfg = compose(config_name=root, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        raise hydra_error(e) from e
    return to_typed_offline(cfg, schema)


def to_typed_offline(cfg: DictConfig, schema: type[C]) -> C:
    """A composed DictConfig as a ``schema``; every missing value is reported."""
    cfg = OmegaConf.masked_copy(cfg, [str(k) for k in cfg if k != "hydra"]) if "hydra" in cfg else cfg
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError([ConfigIssue(key=k, value="???", message="is required and has no value") for k in missing])
    try:
        obj: Any = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise hydra_error(e) from e
    assert isinstance(obj, schema), type(obj)
    return obj
