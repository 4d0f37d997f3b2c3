"""What a checkpoint holds of a model and a rank: sharded model + optimizer state, and the RNG states."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from megatron.core.tensor_parallel import get_cuda_rng_tracker

from hybridrl.megatron.cpu import cpu_distributed_optimizer_checkpoint_metadata, init_distributed_optimizer_state
from hybridrl.megatron.lora import is_lora_name
from hybridrl.megatron.model import unwrap_model
from hybridrl.megatron.policy import MegatronPolicy
from hybridrl.megatron.runner import MegatronRunner


def _model_state(policy: MegatronRunner) -> dict[str, Any]:
    """The model's sharded state: one chunk's, or ``chunk<v>`` per model chunk under VPP.

    The nesting is only this dict's shape: on disk each tensor is stored under its Megatron key with
    global layer offsets, so a checkpoint written with any number of chunks loads with any other.
    """
    chunks = [unwrap_model(c) for c in policy.chunks]
    states = [_adapters_only(policy, c.sharded_state_dict()) for c in chunks]
    if len(chunks) == 1:
        return states[0]
    return {f"chunk{v}": state for v, state in enumerate(states)}


def _adapters_only(policy: MegatronRunner, state: dict[str, Any]) -> dict[str, Any]:
    """With LoRA only the adapters are saved (the frozen base is the model directory's, checked by hash)."""
    if not isinstance(policy, MegatronPolicy) or policy.lora is None:
        return state
    return {k: v for k, v in state.items() if is_lora_name(k)}


def _load_model_state(policy: MegatronRunner, state: dict[str, Any]) -> None:
    chunks = [unwrap_model(c) for c in policy.chunks]
    states = [state] if len(chunks) == 1 else [state[f"chunk{v}"] for v in range(len(chunks))]
    lora = isinstance(policy, MegatronPolicy) and policy.lora is not None
    for chunk, chunk_state in zip(chunks, states, strict=True):
        result = chunk.load_state_dict(chunk_state, strict=not lora)
        if lora and (result.unexpected_keys or any(is_lora_name(k) for k in result.missing_keys)):
            raise ValueError(f"the checkpoint's adapters do not fit this model: missing "
                             f"{[k for k in result.missing_keys if is_lora_name(k)][:4]}, "
                             f"unexpected {result.unexpected_keys[:4]}")


def _model_and_optimizer_state(policy: MegatronRunner, *, loading: bool) -> dict[str, Any]:
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
    """Tensors and plain Python values only, so it loads with ``torch.load(weights_only=True)``."""
    kind, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)  # type: ignore[misc]
    state = {"python": random.getstate(),
             "numpy": {"kind": kind, "key": torch.from_numpy(np.asarray(key, dtype=np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)},
             "torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
