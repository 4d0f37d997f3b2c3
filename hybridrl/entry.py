"""What ``launch/train.py`` and ``launch/sft.py`` run once Hydra has composed the config."""

from __future__ import annotations

import sys

from omegaconf import DictConfig

from hybridrl.bootstrap import ensure_data, ensure_model
from hybridrl.config.compose import to_typed
from hybridrl.config.errors import ConfigError
from hybridrl.config.schema import RLConfig
from hybridrl.config.sft_schema import SFTConfig
from hybridrl.config.validate import validate, validate_sft
from hybridrl.tracking import say


def _world_size() -> int:
    import os

    return int(os.environ.get("WORLD_SIZE", "1"))


def run_rl(dcfg: DictConfig) -> dict[str, float]:
    try:
        cfg = to_typed(dcfg)
        assert isinstance(cfg, RLConfig)
        validate(cfg, world_size=_world_size(), before_bootstrap=True)  # fail fast, before any build
        ensure_data(cfg.data.build_if_missing, cfg.data.train_files, cfg.data.val_files)
        ensure_model(cfg.actor_rollout_ref.model.build_if_missing, cfg.actor_rollout_ref.model.path)
        topology = validate(cfg, world_size=_world_size())
    except ConfigError as e:
        print(f"hybridrl: {e}", file=sys.stderr)
        sys.exit(2)
    say("config OK\n" + topology.render())
    from hybridrl.components import build_components  # heavy imports (Megatron) only after validation
    from hybridrl.megatron.parallel import destroy_parallel
    from hybridrl.trainer import fit

    c = build_components(cfg, topology)
    try:
        return fit(c)
    finally:
        c.close()
        destroy_parallel()


def run_sft(dcfg: DictConfig) -> dict[str, float]:
    try:
        cfg = to_typed(dcfg)
        assert isinstance(cfg, SFTConfig)
        validate_sft(cfg, world_size=_world_size(), before_bootstrap=True)
        ensure_data(cfg.data.build_if_missing, cfg.data.train_files, cfg.data.val_files)
        ensure_model(cfg.model.build_if_missing, cfg.model.path)
        validate_sft(cfg, world_size=_world_size())
    except ConfigError as e:
        print(f"hybridrl: {e}", file=sys.stderr)
        sys.exit(2)
    from hybridrl.megatron.parallel import destroy_parallel
    from hybridrl.sft import fit_sft

    try:
        return fit_sft(cfg)
    finally:
        destroy_parallel()
