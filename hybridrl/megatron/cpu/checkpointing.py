"""CPU adaptations of Megatron's checkpoints: the distributed optimizer's state, dist_checkpointing's writer."""

from __future__ import annotations

from typing import Any

import torch

from hybridrl.megatron.cpu.proxies import _MARK, _TorchWithoutCudaStreams, cuda_available

# --- explicit arguments (preferred: no patch) ---------------------------------------------------


def cpu_distributed_optimizer_checkpoint_metadata() -> dict[str, Any]:
    """``metadata`` entries for ``DistributedOptimizer.sharded_state_dict`` on CPU (empty on CUDA).

    ``optimizer/distrib_optimizer.py``: the ``fully_reshardable`` checkpoint format gathers every DP
    rank's optimizer shard (``get_parameter_state_dp_zero``); by default it moves each shard to the GPU
    (``send_tensor.cuda()``) and all-gathers it there → ``AssertionError: Torch not compiled with CUDA
    enabled`` at the first save. ``distrib_optim_fully_reshardable_mem_efficient=True`` selects its
    gloo path instead: the shards are gathered on DP rank 0 in CPU memory and rank 0 writes them
    (Megatron treats checkpoints written either way as interchangeable).
    """
    if cuda_available():
        return {}
    return {"distrib_optim_fully_reshardable_mem_efficient": True}


def init_distributed_optimizer_state(optimizer: Any) -> None:
    """Give a fresh distributed optimizer the per-parameter Adam state that loading a checkpoint reads.

    ``optimizer/distrib_optimizer.py``: ``sharded_state_dict(is_loading=True)`` starts with
    ``DistributedOptimizer.state_dict()``, which, when neither Transformer Engine nor apex is installed
    (torch's Adam; always so on CPU), takes Adam's step from the per-parameter state; before the first
    step there is none → ``AssertionError`` (``assert len(steps) == 1``) on resume. Upstream's own
    ``_init_optimizer_states_with_dummy_values`` (which it runs for its FSDP format only) creates that
    state with one zero-gradient step; loading then overwrites the states, the step and the parameters.
    A no-op with TE/apex, for other optimizers, and once the state exists.
    """
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, distrib_optimizer.DistributedOptimizer) and not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


# --- patches ------------------------------------------------------------------------------------


def load_torch_adam_step_in_distributed_optimizer() -> None:
    """Give each parameter its own Adam step when the distributed optimizer loads a checkpoint into
    torch's Adam (no TE/apex: always so on CPU).

    ``optimizer/distrib_optimizer.py``, ``DistributedOptimizer.load_state_dict`` treats Adam's step as
    one value, but torch's Adam keeps a step tensor per parameter and increments each in place:
    - it stores one ``step`` tensor object in every parameter's state (torch's ``load_state_dict`` does
      not copy a ``step``), so each optimizer step after a resume adds 1 per parameter to the shared
      tensor: the bias corrections run ahead and the resumed run silently diverges (upstream clones
      the step per parameter only for its ``HybridDeviceOptimizer``);
    - ``_set_main_param_and_optimizer_states`` copies every key of the destination state, ``step``
      included, while the model-space loaders (``load_parameter_state_from_fully_reshardable``,
      ``..._fs_model_space``) leave ``step`` out of the source → ``KeyError: 'step'`` on resume.
    The wrapper runs for each loaded parameter: it replaces the shared step by the parameter's own
    copy and hands that copy in as the source (a no-op copy); upstream copies the other states as before.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    method = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(method, _MARK, False):
        return

    def _set_main_param_and_optimizer_states(self: DistributedOptimizer, model_param: torch.nn.Parameter,
                                             tensors: dict[str, torch.Tensor]) -> None:
        if not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
            if "step" in state:
                state["step"] = state["step"].clone()
                tensors = {"step": state["step"], **tensors}
        method(self, model_param, tensors)

    setattr(_set_main_param_and_optimizer_states, _MARK, True)
    DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states  # type: ignore[method-assign]


def use_cpu_in_dist_checkpointing() -> None:
    """Let ``dist_checkpointing.save`` write CPU tensors.

    ``dist_checkpointing/strategies/filesystem_async.py``: ``FileSystemWriterAsync.preload_tensors``
    calls ``torch.cuda.synchronize()`` before staging the shards to write → ``AssertionError: Torch
    not compiled with CUDA enabled`` on every save (the default ``torch_dist`` strategy goes through
    it even when saving synchronously). The module's ``torch`` becomes a proxy whose
    ``cuda.synchronize`` does nothing; there is no CUDA stream to wait for on a CPU build.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not isinstance(filesystem_async.torch, _TorchWithoutCudaStreams):
        filesystem_async.torch = _TorchWithoutCudaStreams()  # type: ignore[assignment]
