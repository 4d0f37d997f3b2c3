"""Writing an RL checkpoint: every rank its shards and RNG state, rank 0 the rest, then the commit."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from omegaconf import OmegaConf

from hybridrl.checkpoint.hashing import sha256_collective
from hybridrl.checkpoint.layout import _step_name, checkpoint_root, commit, remove_scratch
from hybridrl.checkpoint.state import _model_and_optimizer_state, _rng_state
from hybridrl.config.schema import RLConfig
from hybridrl.distributed import host_group
from hybridrl.hf.write import copy_side_files, save_hf_checkpoint
from hybridrl.lora.checkpoint import write_record
from hybridrl.megatron.checkpoint_compat import install_results_queue, install_worker_death_signal
from hybridrl.megatron.policy import MegatronPolicy
from hybridrl.megatron.runner import MegatronRunner


def save_checkpoint(*, cfg: RLConfig, step: int, policy: MegatronPolicy, weight_version: int,
                    sampler_state: dict[str, int], model_dir: str, rollout_state: dict[str, Any] | None = None,
                    kl_ctrl_state: dict[str, float] | None = None, critic: MegatronRunner | None = None) -> Path:
    root = checkpoint_root(cfg)
    final, tmp = root / _step_name(step), root / f".tmp_{_step_name(step)}"
    rank = dist.get_rank()
    if rank == 0:
        remove_scratch(root)
        (tmp / "rng").mkdir(parents=True)
        (tmp / "megatron").mkdir()
        if critic is not None:
            (tmp / "critic").mkdir()
    dist.barrier()
    install_results_queue()  # Megatron's writer keeps a helper process: make it die with this rank
    install_worker_death_signal()  # and forks workers for each save: them too
    dist_checkpointing.save(_model_and_optimizer_state(policy, loading=False), str(tmp / "megatron"))
    if critic is not None:
        dist_checkpointing.save(_model_and_optimizer_state(critic, loading=False), str(tmp / "critic"))
    torch.save(_rng_state(), tmp / "rng" / f"rank_{rank:05d}.pt")
    if rank == 0:
        assert policy.scheduler is not None and (critic is None or critic.scheduler is not None)
        torch.save({"step": step, "weight_version": weight_version, "scheduler": policy.scheduler.state_dict(),
                    "critic_scheduler": critic.scheduler.state_dict() if critic and critic.scheduler else None,
                    "sampler": sampler_state, "kl_ctrl": kl_ctrl_state, "rollout": rollout_state,
                    "world_size": dist.get_world_size()},
                   tmp / "trainer_state.pt")
        (tmp / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(asdict(cfg))))
        if policy.lora is not None:  # the base this checkpoint's adapters belong to
            write_record(tmp, cfg=policy.lora.cfg, base_model=model_dir,
                         dtype=cfg.actor_rollout_ref.actor.megatron.dtype)
    if cfg.trainer.save_hf_weights:  # collective: every rank streams, rank 0 writes
        save_hf_checkpoint(policy.export_weights(bucket_bytes=512 << 20), tmp / "hf", source_dir=model_dir,
                           key="trainer.save_hf_weights")
    elif rank == 0:
        (tmp / "hf").mkdir()
        copy_side_files(model_dir, tmp / "hf")
    dist.barrier()  # every rank's files are closed: all hash a share of them, rank 0 commits
    digests = sha256_collective(tmp, group=host_group.get())
    if rank == 0:
        commit(tmp, final, step=step, keep=cfg.trainer.max_checkpoints_to_keep, digests=digests)
    dist.barrier()
    return final
