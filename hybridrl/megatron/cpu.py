"""Every adaptation that lets megatron-core 0.16.1 run on a CPU-only torch build, in one place.

megatron-core assumes CUDA in a handful of spots (PLATFORM.md lists them). Where Megatron takes an
explicit argument that avoids the CUDA path we pass it (:func:`causal_attention_mask`,
:func:`cpu_model_parallel_kwargs`, :func:`cpu_distributed_optimizer_checkpoint_metadata`), where it has
a helper we call it (:func:`init_distributed_optimizer_state`); the rest are patches, installed by
:func:`apply_cpu_adaptations`, which is idempotent and does nothing when CUDA is available. Each
function's docstring names the upstream file and behaviour it works around;
``tests/megatron/test_cpu_adaptations.py`` runs each upstream behaviour without its adaptation and fails
once upstream no longer needs it.

Not adapted (not used yet; it fails loudly if reached): ``torch.cuda.Event`` in the inference controller.
(The fp32 optimizer and gradient clipping are adapted: :func:`use_cpu_in_optimizer`; the bf16/fp16 optimizer
and fp16's loss scaler: :func:`use_cpu_in_float16_optimizer`, :func:`use_cpu_in_grad_scaler`; the distributed
optimizer: :func:`use_cpu_in_distributed_optimizer`,
:func:`cpu_distributed_optimizer_checkpoint_metadata`, :func:`init_distributed_optimizer_state` and
:func:`load_torch_adam_step_in_distributed_optimizer`; the CP RoPE slice: :func:`use_cpu_in_cp_rope`.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.pipeline_parallel import schedules
from megatron.core.tensor_parallel import random as mcore_random

_MARK = "_hybridrl_cpu_adaptation"


def cuda_available() -> bool:
    return torch.cuda.is_available()


def apply_cpu_adaptations() -> None:
    """Install every CPU patch below (once; a no-op when CUDA is available)."""
    if cuda_available():
        return
    use_cpu_as_current_device()
    use_cpu_rng_tracker()
    use_cpu_in_pipeline_schedules()
    use_cpu_in_tied_embedding_setup()
    use_cpu_in_optimizer()
    use_cpu_in_float16_optimizer()
    use_cpu_in_grad_scaler()
    use_cpu_in_distributed_optimizer()
    load_torch_adam_step_in_distributed_optimizer()
    use_cpu_in_cp_rope()
    use_cpu_in_dist_checkpointing()
    use_cpu_in_p2p_shape_exchange()


# --- explicit arguments (preferred: no patch) ---------------------------------------------------


def causal_attention_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """The causal mask to pass to ``GPTModel.forward(attention_mask=...)``; None on CUDA.

    Works around ``transformer/utils.py:get_default_causal_mask``, which Megatron's local
    ``FusedScaleMaskSoftmax`` calls when no mask is given and which allocates with ``device="cuda"``.
    Shape ``[1, 1, s, s]``, True = masked (Megatron's convention), broadcast over batch and heads.
    """
    if cuda_available():
        return None
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(1)[None, None]


def cpu_model_parallel_kwargs() -> dict[str, Any]:
    """``ModelParallelConfig`` fields to set on CPU (empty on CUDA).

    - ``batch_p2p_comm=False``: with it True, ``pipeline_parallel/p2p_communication.py``
      (``P2PCommunicator._communicate``) calls ``torch.cuda.synchronize()`` after
      ``batch_isend_irecv`` when ``batch_p2p_sync`` is True, and unconditionally in
      ``_communicate_shapes`` (variable sequence lengths). Worse, the interleaved schedule's gradients
      come out silently wrong on gloo: at PP = 2 the previous and next stage are the same rank, and
      ``_batched_p2p_ops`` posts one batch as (send_prev, recv_prev, send_next, recv_next), which gloo
      pairs with the peer's batch in posting order, so an activation and a gradient between the same
      two ranks are swapped. ``_p2p_ops`` (unbatched) orders them by rank parity and, at PP = 2, sends
      the two directions over two different process groups.
    - ``batch_p2p_sync=False``: the flag that guards that synchronize, for anyone who turns
      ``batch_p2p_comm`` back on.
    """
    if cuda_available():
        return {}
    return {"batch_p2p_comm": False, "batch_p2p_sync": False}


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


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def use_cpu_as_current_device() -> None:
    """Make ``torch.cuda.current_device()`` return ``torch.device("cpu")``.

    megatron-core uses ``torch.cuda.current_device()`` as a device in ~30 places on the paths we run:
    ``models/common/embeddings/rotary_pos_embedding.py`` (``RotaryEmbedding.get_emb`` moves
    ``inv_freq`` "to GPU once at the first micro-batch"), ``tensor_parallel/mappings.py``
    (``_gather_along_last_dim`` and friends allocate their output there), ``utils.py``
    (``GlobalMemoryBuffer.get_tensor``, used by the local ``DotProductAttention``),
    ``pipeline_parallel/p2p_communication.py`` (receive buffers). On a CPU build each raises
    ``AssertionError: Torch not compiled with CUDA enabled``. A global patch, because the calls are
    spread over many modules; on a CPU build nothing else can call the original successfully.
    """
    if not getattr(torch.cuda.current_device, _MARK, False):
        setattr(_cpu_current_device, _MARK, True)
        torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]


class CpuRNGStatesTracker(mcore_random.CudaRNGStatesTracker):
    """Megatron's named RNG states (``model-parallel-rng``, …) kept as CPU generator states."""

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")  # same errors as upstream
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def _no_cuda_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _set_no_cuda_rng_state(*args: Any, **kwargs: Any) -> None:
    return None


def use_cpu_rng_tracker() -> None:
    """Keep Megatron's tracked RNG states on the CPU generator.

    ``tensor_parallel/random.py``: ``CudaRNGStatesTracker.add`` (called by
    ``model_parallel_cuda_manual_seed``) reads ``torch.cuda.get_rng_state()`` → ``AssertionError:
    Torch not compiled with CUDA enabled``; without a seeded tracker the first forward fails in
    ``transformer/dot_product_attention.py`` (``get_cuda_rng_tracker().fork()`` around attention
    dropout) with ``Exception: cuda rng state model-parallel-rng is not added``. Activation
    recomputation (``CheckpointFunction``) saves/restores ``_get_cuda_rng_state()``, which fails the
    same way; there is no CUDA state on CPU, so those two become no-ops (the CPU state and the
    tracker's states are still saved and restored by upstream).
    ``initialize_rng_tracker`` builds the tracker from the module attribute ``CudaRNGStatesTracker``,
    so rebinding it makes every (re)initialisation, including ``force_reset_rng``, CPU-backed.
    """
    if getattr(mcore_random.CudaRNGStatesTracker, _MARK, False):
        return
    setattr(CpuRNGStatesTracker, _MARK, True)
    mcore_random.CudaRNGStatesTracker = CpuRNGStatesTracker  # type: ignore[misc]
    mcore_random._get_cuda_rng_state = _no_cuda_rng_state
    mcore_random._set_cuda_rng_state = _set_no_cuda_rng_state
    if not isinstance(mcore_random._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker):
        mcore_random.initialize_rng_tracker(force_reset=True)


class _TorchWithCpuFactories:
    """``torch`` as seen by one Megatron module, with ``device="cuda"`` factory calls sent to CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*size: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        if device == "cuda":
            device = "cpu"
        return torch.zeros(*size, device=device, **kwargs)

    @staticmethod
    def tensor(data: Any, *, device: Any = None, **kwargs: Any) -> torch.Tensor:
        if device == "cuda":
            device = "cpu"
        return torch.tensor(data, device=device, **kwargs)


def use_cpu_in_pipeline_schedules() -> None:
    """Send ``pipeline_parallel/schedules.py``'s literal ``device="cuda"`` tensors to CPU.

    ``forward_backward_no_pipelining`` and both pipelined schedules start with
    ``total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")`` → ``AssertionError:
    Torch not compiled with CUDA enabled`` (or ``RuntimeError`` about CUDA). The module's ``torch``
    name is replaced by a proxy whose ``zeros`` maps ``"cuda"`` to ``"cpu"``; everything else is torch.
    """
    if not isinstance(schedules.torch, _TorchWithCpuFactories):
        schedules.torch = _TorchWithCpuFactories()  # type: ignore[assignment]


@contextlib.contextmanager
def _tensor_cuda_is_identity() -> Iterator[None]:
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]


def use_cpu_in_tied_embedding_setup() -> None:
    """Keep the tied output weight on CPU while Megatron syncs it across pipeline stages.

    ``models/common/language_module/language_module.py``:
    ``LanguageModule.setup_embeddings_and_output_layer`` (run by ``GPTModel.__init__``) does
    ``weight.data = weight.data.cuda()`` before all-reducing the shared embedding over the embedding
    group when PP > 1 and embeddings are tied → ``AssertionError: Torch not compiled with CUDA
    enabled``. The method is wrapped so that ``Tensor.cuda`` is the identity during that call only.
    """
    method = LanguageModule.setup_embeddings_and_output_layer
    if getattr(method, _MARK, False):
        return

    def setup_embeddings_and_output_layer(self: LanguageModule) -> None:
        with _tensor_cuda_is_identity():
            method(self)

    setattr(setup_embeddings_and_output_layer, _MARK, True)
    LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer  # type: ignore[method-assign]


def _clip_grad_by_total_norm_fp32_cpu(parameters: Any, max_norm: float, total_norm: float,
                                      use_decoupled_grad: bool = False) -> None:
    """``clip_grads.clip_grad_by_total_norm_fp32`` without its CUDA-only grad-type assertion."""
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def use_cpu_in_optimizer() -> None:
    """Let Megatron's fp32 optimizer, grad-norm and grad clipping run on CPU tensors.

    - ``optimizer/optimizer.py``: ``FP32Optimizer.__init__`` does
      ``self._scale = torch.tensor([1.0], dtype=torch.float, device='cuda')`` (and
      ``MixedPrecisionOptimizer`` allocates ``found_inf`` the same way) → ``AssertionError: Torch not
      compiled with CUDA enabled`` when ``get_megatron_optimizer`` builds the optimizer.
    - ``optimizer/clip_grads.py``: ``get_grad_norm_fp32`` allocates ``dummy_overflow_buf`` with
      ``device='cuda'``, and ``utils.py``'s ``local_multi_tensor_l2_norm`` (the no-apex fallback it
      calls) returns ``torch.tensor(..., device="cuda")`` → same error at ``optimizer.step()``.
    - ``clip_grad_by_total_norm_fp32`` asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``
      (a CPU grad is ``'torch.FloatTensor'``) → ``AssertionError`` when the norm exceeds clip_grad.
    The three modules' ``torch`` becomes the CPU-factory proxy; the optimizer module's reference
    to the clip function is rebound to :func:`_clip_grad_by_total_norm_fp32_cpu`.
    """
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer

    for module in (mcore_optimizer, clip_grads, mcore_utils):
        if not isinstance(module.torch, _TorchWithCpuFactories):
            module.torch = _TorchWithCpuFactories()  # type: ignore[assignment]
    mcore_optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32_cpu  # type: ignore[assignment]


@contextlib.contextmanager
def _cpu_tensors_named_as_cuda() -> Iterator[None]:
    """``Tensor.type()`` (no arguments: the type's name only) says ``torch.cuda.X`` for a CPU ``torch.X``."""
    original = torch.Tensor.type

    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = original(self, *args, **kwargs)
        if args or kwargs or self.device.type != "cpu":
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = type_  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.Tensor.type = original  # type: ignore[method-assign]


def use_cpu_in_distributed_optimizer() -> None:
    """Let Megatron's distributed optimizer shard CPU parameters.

    ``optimizer/distrib_optimizer.py``: ``DistributedOptimizer.__init__`` sorts the parameters by their
    type name against CUDA names only: ``_build_model_and_main_param_groups`` raises ``TypeError: Wrapped
    parameters must be one of torch.cuda.FloatTensor,  torch.cuda.HalfTensor, or
    torch.cuda.BFloat16Tensor. Received torch.FloatTensor`` when ``get_megatron_optimizer`` builds it
    for CPU parameters (and its 16-bit test would miss a CPU bf16 parameter). The constructor is
    wrapped so that, during that call only, ``Tensor.type()`` names a CPU tensor's type as its CUDA
    twin (``torch.FloatTensor`` → ``torch.cuda.FloatTensor``); with arguments (a conversion) it is
    untouched. The rest of the distributed optimizer (reduce-scatter of the grad buffers, all-gather
    of the updated parameters) runs on gloo as it is.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    init = DistributedOptimizer.__init__
    if getattr(init, _MARK, False):
        return

    def __init__(self: DistributedOptimizer, *args: Any, **kwargs: Any) -> None:
        with _cpu_tensors_named_as_cuda():
            init(self, *args, **kwargs)

    setattr(__init__, _MARK, True)
    DistributedOptimizer.__init__ = __init__  # type: ignore[method-assign]


def use_cpu_in_float16_optimizer() -> None:
    """Let Megatron's bf16/fp16 optimizer (fp32 main weights) wrap CPU parameters.

    ``optimizer/optimizer.py``: ``Float16OptimizerWithFloat16Params.__init__`` sorts the parameters by
    their type name against CUDA names only (``param.type() in ['torch.cuda.HalfTensor',
    'torch.cuda.BFloat16Tensor']``, else ``== 'torch.cuda.FloatTensor'``) → ``TypeError: Wrapped parameters
    must be one of torch.cuda.FloatTensor,  torch.cuda.HalfTensor, or torch.cuda.BFloat16Tensor. Received
    torch.BFloat16Tensor`` when ``get_megatron_optimizer`` builds it (``bf16``/``fp16`` without the
    distributed optimizer). As for the distributed optimizer, the constructor is wrapped so that, during
    that call only, ``Tensor.type()`` names a CPU tensor's type as its CUDA twin. (Its other CUDA
    literals, ``found_inf`` and ``_scale_one``, are the optimizer module's: :func:`use_cpu_in_optimizer`.)
    """
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    init = Float16OptimizerWithFloat16Params.__init__
    if getattr(init, _MARK, False):
        return

    def __init__(self: Float16OptimizerWithFloat16Params, *args: Any, **kwargs: Any) -> None:
        with _cpu_tensors_named_as_cuda():
            init(self, *args, **kwargs)

    setattr(__init__, _MARK, True)
    Float16OptimizerWithFloat16Params.__init__ = __init__  # type: ignore[method-assign]


def use_cpu_in_grad_scaler() -> None:
    """Keep fp16's loss scale on CPU.

    ``optimizer/grad_scaler.py``: ``MegatronGradScaler.__init__`` allocates the scale with
    ``device='cuda'`` (and ``DynamicGradScaler`` its min scale and growth/backoff factors) → ``AssertionError:
    Torch not compiled with CUDA enabled`` when ``get_megatron_optimizer`` builds an fp16 optimizer;
    ``DynamicGradScaler.load_state_dict`` moves the loaded scale with ``.cuda(torch.cuda.current_device())``
    → ``RuntimeError: Invalid device, must be cuda device`` on resume (the current device being the CPU,
    :func:`use_cpu_as_current_device`). The module's ``torch`` becomes the CPU-factory proxy, and
    ``load_state_dict`` runs with ``Tensor.cuda`` the identity (the scale stays where it was saved: CPU).
    """
    from megatron.core.optimizer import grad_scaler

    if not isinstance(grad_scaler.torch, _TorchWithCpuFactories):
        grad_scaler.torch = _TorchWithCpuFactories()  # type: ignore[assignment]
    load = grad_scaler.DynamicGradScaler.load_state_dict
    if getattr(load, _MARK, False):
        return

    def load_state_dict(self: Any, state_dict: dict[str, Any]) -> None:
        with _tensor_cuda_is_identity():
            load(self, state_dict)

    setattr(load_state_dict, _MARK, True)
    grad_scaler.DynamicGradScaler.load_state_dict = load_state_dict  # type: ignore[method-assign]


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


def _pos_emb_on_this_cp_rank_cpu(pos_emb: torch.Tensor, seq_dim: int, cp_group: Any) -> torch.Tensor:
    """Upstream ``get_pos_emb_on_this_cp_rank`` with its chunk index made on ``pos_emb``'s device."""
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1:])
    pos_emb = pos_emb.index_select(seq_dim, index)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])


def use_cpu_in_cp_rope() -> None:
    """Slice the RoPE table for this CP rank without pinned memory or ``.cuda()``.

    ``models/common/embeddings/rope_utils.py``: ``get_pos_emb_on_this_cp_rank`` (called by
    ``RotaryEmbedding.forward`` when CP > 1) builds its index with ``torch.tensor(..., device="cpu",
    pin_memory=True).cuda(non_blocking=True)`` → ``RuntimeError: pin_memory=True requires a CUDA or
    other accelerator backend ...``. The modules that imported the function by name get
    :func:`_pos_emb_on_this_cp_rank_cpu`, which selects the same chunks (r and 2·CP−1−r).
    """
    from megatron.core.models.common.embeddings import (
        rope_utils,
        rotary_pos_embedding,
        yarn_rotary_pos_embedding,
    )

    if getattr(rotary_pos_embedding.get_pos_emb_on_this_cp_rank, _MARK, False):
        return
    setattr(_pos_emb_on_this_cp_rank_cpu, _MARK, True)
    for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):
        module.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank_cpu  # type: ignore[attr-defined]


class _CudaWithoutStreams:
    """``torch.cuda`` as seen by one Megatron module, with ``synchronize`` a no-op (no streams on CPU)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None


class _TorchWithoutCudaStreams:
    """``torch`` whose ``cuda`` attribute is :class:`_CudaWithoutStreams`; everything else is torch."""

    cuda = _CudaWithoutStreams()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


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


def use_cpu_in_p2p_shape_exchange() -> None:
    """Let the pipeline exchange activation shapes on CPU (variable shapes between micro-batches).

    ``pipeline_parallel/p2p_communication.py``: with ``config.variable_seq_lengths`` (set by the policy
    when token-budget micro-batches differ in shape), ``P2PCommunicator._communicate_shapes`` sends
    each activation's shape before the activation and then calls ``torch.cuda.synchronize()``
    unconditionally (unlike ``_communicate``, where ``batch_p2p_sync`` guards it) → ``AssertionError:
    Torch not compiled with CUDA enabled`` at the first send. The module's ``torch`` becomes the proxy
    whose ``cuda.synchronize`` does nothing (the requests were already waited on).
    """
    from megatron.core.pipeline_parallel import p2p_communication

    if not isinstance(p2p_communication.torch, _TorchWithoutCudaStreams):
        p2p_communication.torch = _TorchWithoutCudaStreams()  # type: ignore[assignment]
