"""Hydra composition of ``recipes/`` into a typed ``RLConfig``.

The schema is registered in Hydra's ConfigStore as ``hybridrl_schema`` and is the first entry of
``recipes/config.yaml``'s defaults list, so Hydra type-checks every recipe and override against it.
Hydra stops at the first unknown key or wrong type, so the overrides are checked whole first
(``overrides.py``: every problem at once, verl's keys translated); what Hydra still refuses is re-raised as
``ConfigError`` naming the key, with the closest valid keys. Everything else is checked by ``validate.py``.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hybridrl.config.errors import ConfigError, ConfigIssue
from hybridrl.config.overrides import CheckedOverrides, apply_engine_settings, check_overrides, schema_keys
from hybridrl.config.schema import RLConfig
from hybridrl.config.sft_schema import SFTConfig
from hybridrl.config.verl_joint import apply_joint
from hybridrl.paths import cache_dir, recipes_dir
from hybridrl.tracking import say

SCHEMA_NAME = "hybridrl_schema"
SFT_SCHEMA_NAME = "hybridrl_sft_schema"


REQUIRED = "${hybridrl_required:}"  # a recipe's "???" for a key whose schema has a default (merging ??? keeps it)


def register_configs() -> None:
    """Register the schemas in Hydra's ConfigStore and the ``${hybridrl_cache:}`` and ``${hybridrl_required:}``
    resolvers (idempotent)."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=RLConfig)
    ConfigStore.instance().store(name=SFT_SCHEMA_NAME, node=SFTConfig)
    OmegaConf.register_new_resolver("hybridrl_cache", cache_dir, replace=True)
    OmegaConf.register_new_resolver("hybridrl_required", _required, replace=True)


def _required() -> str:
    return "???"  # to_typed reports the key as required before anything reads it


def available_recipes() -> list[str]:
    return sorted(p.stem for p in (recipes_dir() / "recipe").glob("*.yaml"))


def compose_config(overrides: Sequence[str] = (), *, config_name: str = "config",
                   config_dir: Path | None = None) -> Any:
    """Compose ``<config_name>.yaml`` + overrides (e.g. ``recipe=grpo_tiny``) into its typed config
    (``RLConfig`` for ``config``, ``SFTConfig`` for ``sft``). Every unknown key and bad value of the overrides
    is reported at once, and verl's keys are read as :mod:`hybridrl.config.verl_keys` says (RL runs), with a
    notice each."""
    register_configs()
    GlobalHydra.instance().clear()
    directory = config_dir or recipes_dir()
    rl, schema = config_name == "config", {"config": RLConfig, "sft": SFTConfig}.get(config_name)
    checked = (check_overrides(overrides, schema=schema, recipes=directory, verl=rl, collect=True)
               if schema is not None else CheckedOverrides(overrides=list(overrides)))
    issues = list(checked.issues)  # reported with what composition finds (their lines were left out)
    if not checked.composable:
        raise ConfigError(issues)
    try:
        with initialize_config_dir(config_dir=str(directory), version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=checked.overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(issues + hydra_error(e).issues) from e
    notices = list(checked.notices)
    try:
        typed = to_typed(cfg)
        if rl:
            notices += apply_engine_settings(typed, checked.engine_settings)
            notices += apply_joint(typed, checked.joint)
    except ConfigError as e:
        said = {i.key for i in issues}  # a key refused on the command line is not judged again without its value
        raise ConfigError(issues + [i for i in e.issues if i.key not in said]) from e
    if issues:
        raise ConfigError(issues)
    for line in dict.fromkeys(notices):
        say(f"note: {line}")
    return typed


def to_typed(cfg: DictConfig) -> Any:
    """Turn a composed DictConfig into its typed dataclass tree; every missing value is reported."""
    cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]) if "hydra" in cfg else cfg
    missing = sorted({*OmegaConf.missing_keys(cfg), *_required_keys(OmegaConf.to_container(cfg, resolve=False))})
    if missing:
        raise ConfigError([ConfigIssue(key=k, value="???", message="is required and has no value") for k in missing])
    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise hydra_error(e) from e
    assert isinstance(obj, RLConfig | SFTConfig), type(obj)
    return obj


def _required_keys(node: Any, prefix: str = "") -> list[str]:
    """The keys a recipe marks required (:data:`REQUIRED`) that nothing set."""
    if isinstance(node, dict):
        return [k for name, v in node.items() for k in _required_keys(v, f"{prefix}{name}.")]
    return [prefix.rstrip(".")] if node == REQUIRED else []


def hydra_error(e: Exception) -> ConfigError:
    """Name the key behind a Hydra/OmegaConf error and suggest the valid keys closest to it."""
    inner: BaseException = e
    while not isinstance(inner, OmegaConfBaseException) and inner.__cause__ is not None:
        inner = inner.__cause__
    key = getattr(inner, "full_key", None) or ""
    msg = str(inner).splitlines()[0] if str(inner) else type(inner).__name__
    if not key:
        msg = str(e).splitlines()[0]
        if "recipe/" in msg:
            msg += f"; available recipes: {', '.join(available_recipes()) or '(none)'}"
        return ConfigError([ConfigIssue(key="recipe" if "recipe/" in msg else "<overrides>", value=None, message=msg)])
    append = [line for line in str(e).splitlines() if line.startswith("To append to your config use")]
    if "not in struct" not in msg:  # a typed node: appending is impossible, only a valid key helps
        append = []
    if append:  # a new key in a free-form block (plugin kwargs) is added with +key=value, as in verl
        msg += f" ({append[0].strip()})"
    close = difflib.get_close_matches(key, list(schema_keys(RLConfig)), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(close)}?" if close and key not in close and not append else ""
    return ConfigError([ConfigIssue(key=key, value=getattr(inner, "value", None), message=msg + hint)])
