"""Save and resume an RL run: atomic, reshardable checkpoints.

Layout of ``<trainer.output_dir>/checkpoints/step_<k>/``:
- ``megatron/``: actor model + optimizer in Megatron's ``dist_checkpointing`` format (every rank
  writes its shards in parallel; loading at another TP/PP/VPP/DP layout reshards; the vocab rows are
  saved with Megatron's ``allow_shape_mismatch`` so a TP-dependent vocab padding does not matter). The
  distributed optimizer's state is saved in Megatron's ``fully_reshardable`` format: per parameter, in
  model space, like the plain optimizer's, so it loads at any DP size;
- ``trainer_state.pt``: step, weight version, LR scheduler, data-sampler position;
- ``rng/rank_<r>.pt``: each rank's Python/NumPy/torch(/CUDA)/Megatron-tracker RNG states;
- ``hf/``: config.json, generation config and tokenizer of the model (``export-hf`` needs nothing else),
  plus the actor's full weights as safetensors when ``trainer.save_hf_weights`` (a ready HF checkpoint);
- ``config.yaml``: the resolved run config.

Atomicity: everything is written to ``.tmp_step_<k>`` and renamed to ``step_<k>`` by rank 0 only after
every rank has finished, so a crash (even SIGKILL) mid-save leaves the previous checkpoints intact
and ``resume=auto`` (which only looks at ``step_*``) never picks a partial one. Stale ``.tmp_*`` dirs
are removed at the next save.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from omegaconf import OmegaConf

from hybridrl.config.schema import RLConfig
from hybridrl.hf_checkpoint import copy_side_files, save_hf_checkpoint
from hybridrl.megatron.cpu import cpu_distributed_optimizer_checkpoint_metadata, init_distributed_optimizer_state
from hybridrl.megatron.model import unwrap_model
from hybridrl.megatron.policy import MegatronPolicy

_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_root(cfg: RLConfig) -> Path:
    return Path(cfg.trainer.output_dir) / "checkpoints"


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def resolve_resume(cfg: RLConfig) -> Path | None:
    """``trainer.resume``: ``never`` → None; ``auto`` → newest complete checkpoint (or None); else a path."""
    mode = cfg.trainer.resume
    if mode == "never":
        return None
    if mode == "auto":
        dirs = step_dirs(checkpoint_root(cfg))
        return dirs[-1][1] if dirs else None
    path = Path(mode)
    if not (path / "trainer_state.pt").is_file():
        raise FileNotFoundError(f"trainer.resume={mode!r}: {path} is not a complete hybridrl checkpoint "
                                f"(no trainer_state.pt); valid: auto, never, or a checkpoints/step_<k> dir")
    return path


def _model_state(policy: MegatronPolicy) -> dict[str, Any]:
    """The model's sharded state: one chunk's, or ``chunk<v>`` per model chunk under VPP.

    The nesting is only this dict's shape: on disk each tensor is stored under its Megatron key with
    global layer offsets, so a checkpoint written with any number of chunks loads with any other.
    """
    chunks = [unwrap_model(c) for c in policy.chunks]
    if len(chunks) == 1:
        return chunks[0].sharded_state_dict()
    return {f"chunk{v}": c.sharded_state_dict() for v, c in enumerate(chunks)}


def _load_model_state(policy: MegatronPolicy, state: dict[str, Any]) -> None:
    chunks = [unwrap_model(c) for c in policy.chunks]
    states = [state] if len(chunks) == 1 else [state[f"chunk{v}"] for v in range(len(chunks))]
    for chunk, chunk_state in zip(chunks, states, strict=True):
        chunk.load_state_dict(chunk_state)


def _model_and_optimizer_state(policy: MegatronPolicy, *, loading: bool) -> dict[str, Any]:
    model_sd = _model_state(policy)
    assert policy.optimizer is not None
    if loading:
        init_distributed_optimizer_state(policy.optimizer)
    # read by the distributed optimizer only; its default (fully_sharded_model_space) is deprecated
    # and dist_checkpointing no longer accepts its flattened ranges
    metadata = {"distrib_optim_sharding_type": "fully_reshardable", **cpu_distributed_optimizer_checkpoint_metadata()}
    return {"model": model_sd,
            "optimizer": policy.optimizer.sharded_state_dict(model_sd, is_loading=loading, metadata=metadata)}


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(*, cfg: RLConfig, step: int, policy: MegatronPolicy, weight_version: int,
                    sampler_state: dict[str, int], model_dir: str) -> Path:
    root = checkpoint_root(cfg)
    final, tmp = root / f"step_{step:08d}", root / f".tmp_step_{step:08d}"
    rank = dist.get_rank()
    if rank == 0:
        for stale in root.glob(".tmp_step_*") if root.is_dir() else []:
            shutil.rmtree(stale)
        (tmp / "rng").mkdir(parents=True)
        (tmp / "megatron").mkdir()
    dist.barrier()
    dist_checkpointing.save(_model_and_optimizer_state(policy, loading=False), str(tmp / "megatron"))
    torch.save(_rng_state(), tmp / "rng" / f"rank_{rank:05d}.pt")
    if rank == 0:
        assert policy.scheduler is not None
        torch.save({"step": step, "weight_version": weight_version, "scheduler": policy.scheduler.state_dict(),
                    "sampler": sampler_state, "world_size": dist.get_world_size()}, tmp / "trainer_state.pt")
        (tmp / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(asdict(cfg))))
    if cfg.trainer.save_hf_weights:  # collective: every rank streams, rank 0 writes
        save_hf_checkpoint(policy.export_weights(bucket_bytes=512 << 20), tmp / "hf", source_dir=model_dir)
    elif rank == 0:
        (tmp / "hf").mkdir()
        copy_side_files(model_dir, tmp / "hf")
    dist.barrier()
    if rank == 0:
        if final.exists():  # a re-run of the same step: replace only now that the new one is whole
            shutil.rmtree(final)
        os.rename(tmp, final)
        _prune(root, keep=cfg.trainer.max_checkpoints_to_keep)
    dist.barrier()
    return final


def _prune(root: Path, *, keep: int) -> None:
    if keep <= 0:
        return
    for _, path in step_dirs(root)[:-keep]:
        shutil.rmtree(path)


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


def load_checkpoint(path: Path, *, policy: MegatronPolicy) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and this rank's RNG; return the trainer state."""
    _check_optimizer_kind(path, policy)
    sharded = _model_and_optimizer_state(policy, loading=True)
    loaded = dist_checkpointing.load(sharded, str(path / "megatron"))
    _load_model_state(policy, loaded["model"])
    assert policy.optimizer is not None and policy.scheduler is not None
    policy.optimizer.load_state_dict(loaded["optimizer"])
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    policy.scheduler.load_state_dict(state["scheduler"])
    rng_file = path / "rng" / f"rank_{dist.get_rank():05d}.pt"
    if state["world_size"] == dist.get_world_size() and rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return state
