"""What ``launch/train.py`` and ``launch/sft.py`` run once Hydra has composed the config."""

from __future__ import annotations

import sys

from omegaconf import DictConfig

from hybridrl import dist_check
from hybridrl.bootstrap import ensure_data, ensure_model
from hybridrl.config.compose import to_typed
from hybridrl.config.errors import ConfigError
from hybridrl.config.schema import RLConfig
from hybridrl.config.sft_schema import SFTConfig
from hybridrl.config.validate import validate, validate_sft, world_from_env
from hybridrl.tracking import say


def run_rl(dcfg: DictConfig) -> dict[str, float]:
    try:
        cfg = to_typed(dcfg)
        assert isinstance(cfg, RLConfig)
        world, per_node = world_from_env()
        validate(cfg, world_size=world, ranks_per_node=per_node, before_bootstrap=True)  # fail fast, build nothing
        ensure_data(cfg.data.build_if_missing, cfg.data.train_files, cfg.data.val_files)
        ensure_model(cfg.actor_rollout_ref.model.build_if_missing, cfg.actor_rollout_ref.model.path)
        plan = validate(cfg, world_size=world, ranks_per_node=per_node)
    except ConfigError as e:
        print(f"hybridrl: {e}", file=sys.stderr)
        sys.exit(2)
    say("config OK\n" + plan.render())
    from hybridrl.components import build_components  # heavy imports (Megatron) only after validation
    from hybridrl.megatron.parallel import destroy_parallel
    from hybridrl.trainer import fit

    c = build_components(cfg, plan)
    try:
        return fit(c)
    finally:
        c.close()
        if dist_check.enabled():
            say(dist_check.report())
        destroy_parallel()


def run_sft(dcfg: DictConfig) -> dict[str, float]:
    try:
        cfg = to_typed(dcfg)
        assert isinstance(cfg, SFTConfig)
        world, _ = world_from_env()
        validate_sft(cfg, world_size=world, before_bootstrap=True)
        ensure_data(cfg.data.build_if_missing, cfg.data.train_files, cfg.data.val_files)
        ensure_model(cfg.model.build_if_missing, cfg.model.path)
        validate_sft(cfg, world_size=world)
    except ConfigError as e:
        print(f"hybridrl: {e}", file=sys.stderr)
        sys.exit(2)
    from hybridrl.megatron.parallel import destroy_parallel
    from hybridrl.sft import fit_sft

    try:
        return fit_sft(cfg)
    finally:
        destroy_parallel()
