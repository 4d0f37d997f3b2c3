"""Loading an RL checkpoint into this run: its state, with this run's optimizer and LR-schedule settings."""

from __future__ import annotations

from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from omegaconf import DictConfig, OmegaConf

from hybridrl.checkpoint.state import _load_model_state, _model_and_optimizer_state, _set_rng_state
from hybridrl.config.schema import OptimConfig, RLConfig
from hybridrl.lora.checkpoint import check_base, read_record
from hybridrl.megatron.policy import MegatronPolicy
from hybridrl.megatron.runner import MegatronRunner
from hybridrl.tracking import say


def _restore(model: MegatronRunner, directory: Path, scheduler_state: dict[str, Any]) -> int:
    """Load ``model``'s weights and optimizer state from ``directory`` and its scheduler's position, keeping this
    run's optimizer settings and schedule shape; return the saved LR decay length."""
    assert model.optimizer is not None and model.scheduler is not None
    configured = [{k: v for k, v in g.items() if k != "params"} for g in model.optimizer.param_groups]
    loaded = dist_checkpointing.load(_model_and_optimizer_state(model, loading=True), str(directory))
    _load_model_state(model, loaded["model"])
    model.optimizer.load_state_dict(loaded["optimizer"])
    for group, settings in zip(model.optimizer.param_groups, configured, strict=True):
        group.update(settings)  # the loaded groups carry the saved max_lr, betas, eps, …: this run's win
    scheduler = model.scheduler
    # Megatron's semantics: the schedule's shape from the config, only its position from the checkpoint
    scheduler.override_opt_param_scheduler, scheduler.use_checkpoint_opt_param_scheduler = True, False
    scheduler.load_state_dict(scheduler_state)
    return int(scheduler_state["lr_decay_steps"])


def _check_optimizer_kind(path: Path, policy: MegatronPolicy) -> None:
    """Megatron's distributed and plain optimizers save their state in different formats (0.16.1 fails
    deep in ``load_state_dict`` with ``KeyError: 'pre_wd_mult'``): name the key to keep instead."""
    key = "actor_rollout_ref.actor.megatron.use_distributed_optimizer"
    saved = bool(OmegaConf.select(OmegaConf.load(path / "config.yaml"), key))
    chained = getattr(policy.optimizer, "chained_optimizers", [policy.optimizer])
    now = any(isinstance(o, DistributedOptimizer) for o in chained)
    if saved != now:
        was, setting = str(saved).lower(), str(now).lower()  # as written in the config
        raise ValueError(f"{key}={setting}: {path} was saved with {key}={was}, whose optimizer state the other "
                         f"optimizer can't load; resume with {key}={was}")


def _check_expert_layout(path: Path, policy: MegatronPolicy) -> None:
    """An MoE model's optimizer is a chain of two (dense and expert parameters) at every EP (``moe_compat`` item 2),
    so its checkpoints reshard between any EP layouts. Checkpoints saved at EP = 1 before that hold one optimizer,
    which the chain can't load (a ``KeyError`` deep in dist_checkpointing): name the way out instead."""
    chained = len(getattr(policy.optimizer, "chained_optimizers", ())) > 1  # not with LoRA: frozen experts
    if policy.arch.moe is None or not chained:
        return
    common = dist_checkpointing.load_common_state_dict(str(path / "megatron"))
    if 0 not in common["optimizer"]:  # ChainedOptimizer.sharded_state_dict: one entry per optimizer, keys 0, 1
        key = "actor_rollout_ref.actor.megatron.expert_model_parallel_size"
        raise ValueError(f"{path} holds an MoE model's optimizer state as one optimizer (an EP = 1 checkpoint of "
                         f"hybridrl before experts had their own optimizer at every {key}), which this version "
                         f"can't load; start a new run from its weights (hybridrl export-hf {path} DIR, then "
                         "actor_rollout_ref.model.path=DIR, trainer.resume=never)")


_OPTIM = "actor_rollout_ref.actor.optim"
# the settings resume compares; every one is applied from the saved step except those in _FIXED
RESUME_SETTINGS = (*(f"{_OPTIM}.{f.name}" for f in fields(OptimConfig)), "trainer.total_training_steps")
_FIXED = {f"{_OPTIM}.optimizer": "its saved state (e.g. Adam's moments) does not fit another optimizer"}


def changed_settings(saved: DictConfig, cfg: RLConfig, *, path: Path) -> list[tuple[str, Any, Any]]:
    """``(key, saved value, this run's value)`` for each of :data:`RESUME_SETTINGS` that differs between the
    checkpoint's config and ``cfg``; raises ``ValueError`` naming a key that can't change on resume."""
    now = OmegaConf.create(asdict(cfg))
    changes = [(k, OmegaConf.select(saved, k), OmegaConf.select(now, k)) for k in RESUME_SETTINGS]
    changes = [(k, old, new) for k, old, new in changes if old != new]
    for key, old, new in changes:
        if key in _FIXED:
            raise ValueError(f"{key}={new}: {path} was saved with {key}={old} and {_FIXED[key]}; resume with "
                             f"{key}={old}, or start a new run (trainer.resume=never)")
    return changes


def load_checkpoint(path: Path, *, cfg: RLConfig, policy: MegatronPolicy,
                    critic: MegatronRunner | None = None) -> dict[str, Any]:
    """Restore model, optimizer state, the scheduler's position (the actor's, and the critic's when given) and
    this rank's RNG; return the trainer state.

    Optimizer and LR-schedule *settings* are this run's (``cfg``), applied from the saved step: the
    checkpoint's param groups (lr, betas, eps, …) and schedule are replaced by the configured ones."""
    _check_optimizer_kind(path, policy)
    _check_expert_layout(path, policy)
    check_base(path, read_record(path), lora=None if policy.lora is None else policy.lora.cfg,
               base_model=cfg.actor_rollout_ref.model.path)
    changes = changed_settings(OmegaConf.load(path / "config.yaml"), cfg, path=path)  # type: ignore[arg-type]
    state = torch.load(path / "trainer_state.pt", weights_only=True)
    saved_decay = _restore(policy, path / "megatron", state["scheduler"])
    assert policy.optimizer is not None and policy.scheduler is not None
    scheduler = policy.scheduler
    if changes or saved_decay != scheduler.lr_decay_steps:
        shown = "; ".join(f"{k}: {old} → {new}" for k, old, new in changes)
        say(f"resume from {path}: changed settings applied from optimizer step {scheduler.num_steps}: {shown}"
            f"{'; ' if shown else ''}LR decay over {scheduler.lr_decay_steps} optimizer steps (saved: {saved_decay}); "
            f"the learning rate is now {policy.optimizer.param_groups[0]['lr']:.4g}")
    if critic is not None:
        if state.get("critic_scheduler") is None:
            raise ValueError(f"{path} was saved without a critic; resume it with the critic off, or start a new run "
                             "(trainer.resume=never)")
        _restore(critic, path / "critic", state["critic_scheduler"])  # critic.optim.* settings: this run's too
    rng_file = path / "rng" / f"rank_{dist.get_rank():05d}.pt"
    if state["world_size"] == dist.get_world_size() and rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=True))
    return state
