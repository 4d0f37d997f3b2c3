"""CPU adaptations of Megatron's optimizers: fp32, bf16/fp16 and distributed, grad clipping, the loss scaler."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from hybridrl.megatron.cpu.proxies import _MARK, _tensor_cuda_is_identity, _TorchWithCpuFactories


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
