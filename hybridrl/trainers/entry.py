"""What ``launch/train.py``, ``launch/sft.py`` and ``launch/dpo.py`` run once Hydra has composed the config."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig

from hybridrl.bootstrap import ensure_data, ensure_model
from hybridrl.config.compose import available_recipes, compose_config, to_typed
from hybridrl.config.dpo_schema import DPOConfig, to_typed_dpo, validate_dpo
from hybridrl.config.errors import ConfigError
from hybridrl.config.plan import Plan
from hybridrl.config.schema import RLConfig
from hybridrl.config.sft_schema import SFTConfig
from hybridrl.config.validate import validate, validate_sft, world_from_env
from hybridrl.distributed import check as dist_check
from hybridrl.tracking import say

USAGE = "usage: torchrun --nproc-per-node N launch/train.py recipe=NAME [key=value ...]"


def run_rl_cli(argv: list[str]) -> int:
    """``launch/train.py``: compose ``argv`` (Hydra overrides) as ``hybridrl validate`` does, then run."""
    if any(a in ("-h", "--help") for a in argv):
        print(f"{USAGE}\n  recipes: {', '.join(available_recipes())}; check a config first with: hybridrl validate "
              "recipe=NAME [key=value ...]; verl's keys: docs/verl.md")
        return 0
    if flags := [a for a in argv if a.startswith("-")]:
        print(f"hybridrl: launch/train.py takes key=value overrides only, not {' '.join(flags)} (Hydra's "
              f"--config-path/--config-name: pick a recipe with recipe=NAME)\n{USAGE}", file=sys.stderr)
        return 2
    try:
        cfg = compose_config(argv)
    except ConfigError as e:
        print(f"hybridrl: {e}", file=sys.stderr)
        return 2
    run_rl(cfg)
    return 0


def run_rl(cfg: RLConfig) -> dict[str, float]:
    try:
        world, per_node = world_from_env()
        validate(cfg, world_size=world, ranks_per_node=per_node, before_bootstrap=True)  # fail fast, build nothing
        ensure_data(cfg.data.build_if_missing, cfg.data.train_files, cfg.data.val_files)
        ensure_model(cfg.actor_rollout_ref.model.build_if_missing, cfg.actor_rollout_ref.model.path)
        if (teacher := cfg.actor_rollout_ref.teacher.model).path is not None:  # on-policy distillation's
            ensure_model(teacher.build_if_missing, teacher.path, key="actor_rollout_ref.teacher.model")
        plan = validate(cfg, world_size=world, ranks_per_node=per_node)
    except ConfigError as e:
        print(f"hybridrl: {e}", file=sys.stderr)
        sys.exit(2)
    say("config OK\n" + plan.render())
    from hybridrl import preemption

    preempt = preemption.install(cfg.trainer.preempt_grace_s)  # a SIGTERM from now on: stop after the step, saved
    try:
        return _run_rl(cfg, plan)
    finally:
        preempt.finished()


def _run_rl(cfg: RLConfig, plan: Plan) -> dict[str, float]:
    from hybridrl.rollout import disaggregated

    if disaggregated.split_world(plan):  # an engine rank: serves the trainer, builds nothing of it
        disaggregated.serve(cfg, plan)
        return {}
    from hybridrl.megatron.parallel import destroy_parallel
    from hybridrl.trainers.components import build_components  # heavy imports (Megatron) only after validation
    from hybridrl.trainers.rl import fit

    c = build_components(cfg, plan)
    try:
        return fit(c)
    finally:
        c.close()
        if dist_check.enabled():
            say(dist_check.report())
        destroy_parallel()


def run_sft(dcfg: DictConfig) -> dict[str, float]:
    cfg = _typed(to_typed, dcfg)
    assert isinstance(cfg, SFTConfig)
    return _run_offline(cfg, validate_sft, "hybridrl.trainers.sft", "fit_sft")


def run_dpo(dcfg: DictConfig) -> dict[str, float]:
    cfg = _typed(to_typed_dpo, dcfg)
    assert isinstance(cfg, DPOConfig)
    return _run_offline(cfg, validate_dpo, "hybridrl.trainers.dpo", "fit_dpo")


def _typed(convert: Callable[[DictConfig], Any], dcfg: DictConfig) -> Any:
    try:
        return convert(dcfg)
    except ConfigError as e:
        print(f"hybridrl: {e}", file=sys.stderr)
        sys.exit(2)


def _run_offline(cfg: SFTConfig | DPOConfig, check: Callable[..., Any], module: str, fit: str) -> dict[str, float]:
    """SFT and DPO: check the config (all problems at once, before anything is built), build missing data and
    start model, check again, then train with ``module.fit`` (Megatron imported only once the config passed)."""
    import importlib

    try:
        world, _ = world_from_env()
        check(cfg, world_size=world, before_bootstrap=True)
        ensure_data(cfg.data.build_if_missing, cfg.data.train_files, cfg.data.val_files)
        ensure_model(cfg.model.build_if_missing, cfg.model.path)
        check(cfg, world_size=world)
    except ConfigError as e:
        print(f"hybridrl: {e}", file=sys.stderr)
        sys.exit(2)
    from hybridrl.megatron.parallel import destroy_parallel

    try:
        return getattr(importlib.import_module(module), fit)(cfg)
    finally:
        destroy_parallel()
