"""Memory phases of a colocated run: a policy's state waits in host memory while the engine generates.

Which state (verl's keys, :class:`~hybridrl.config.schema.MegatronConfig`): ``param_offload`` (the
parameters), ``grad_offload`` (the gradient buffers), ``optimizer_offload`` (the optimizer's fp32 main
parameters, when it keeps its own, and its state: Adam's ``exp_avg``, ``exp_avg_sq``, ``step``). The ref
has only parameters (``ref.megatron.param_offload``); the critic has all three (``critic.megatron.*``).

How: by storage, not by tensor. Megatron's DDP keeps parameters and gradients in contiguous buffers
(``DistributedDataParallel.buffers`` / ``expert_parallel_buffers``: ``param_data`` when it keeps a param
buffer — with the distributed optimizer —, always ``grad_data``); each parameter is a view into
``param_data`` and each ``main_grad`` a view into ``grad_data``, the distributed optimizer's fp32 shards
are views into the parameters, and the buckets and the optimizer hold references to all of these. Moving
a tensor (``p.data = p.data.cpu()``) would cut those views off. Instead each *storage* under a tensor
of the kind is copied whole to a host buffer and its device memory freed with
``untyped_storage().resize_(0)``; reloading resizes it back and copies the bytes in. Every tensor keeps
its storage object, offset and strides, so every view, the optimizer's references and the weight export
see the restored data. (The device address of a restored storage is whatever the allocator returns:
nothing here caches raw pointers across phases — no CUDA graphs, no registered NCCL user buffers.)
Parameters outside any buffer (the plain optimizer's, or the frozen ref's, which has no DDP) are the
same case: each one's own storage. A storage belongs to the first kind that reaches it (parameters,
then gradients, then the optimizer), so offloading the optimizer alone never frees the parameters that
an fp32 optimizer updates in place. Storages elsewhere than on the model's device (torch Adam's CPU
``step`` on a GPU run) are left where they are.

On CUDA the host buffers are pinned, kept across steps (one per storage, reallocated only if its
size changes), and filled/drained with ``non_blocking`` copies followed by one synchronize before the
device memory is freed or used, then ``empty_cache`` hands the freed memory back for the engine. On a
CPU run "host" and "device" are the same memory, but the same path runs (copy out to a separate
buffer, free, restore): offload → reload round-trips bitwise, which the CPU tests check.

Both calls are idempotent per kind: offloading what is already on the host, or reloading what is on
the device, does nothing. They return the bytes moved per kind.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

import torch

if TYPE_CHECKING:
    from hybridrl.megatron.runner import MegatronRunner

Kind = Literal["params", "grads", "optimizer"]
KINDS: tuple[Kind, ...] = get_args(Kind)


@dataclass(slots=True, frozen=True)
class _Moved:
    storage: torch.UntypedStorage  # on the device, size 0 while offloaded
    host: torch.UntypedStorage  # its bytes


class PolicyOffload:
    """Moves the kinds of a policy's state chosen at construction to host memory and back."""

    def __init__(self, policy: MegatronRunner, *, params: bool = False, grads: bool = False,
                 optimizer: bool = False) -> None:
        self.policy = policy
        self.kinds = tuple(k for k, on in zip(KINDS, (params, grads, optimizer), strict=True) if on)
        self.device = next(policy.parameters()).device
        self._offloaded: dict[Kind, list[_Moved]] = {}
        self._host: dict[Kind, dict[int, torch.UntypedStorage]] = {}  # kept across steps, by storage

    @torch.no_grad()
    def offload(self) -> dict[Kind, int]:
        """Move the configured kinds to host memory; the bytes moved per kind (none if already there)."""
        kinds = [k for k in self.kinds if k not in self._offloaded]
        if not kinds:
            return {}
        moved = {k: self._copy_out(k) for k in kinds}
        self._synchronize()  # the copies are done before the device memory goes
        for m in (m for ms in moved.values() for m in ms):
            m.storage.resize_(0)
        self._offloaded.update(moved)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the engine runs in another process: give the memory back
        return {k: sum(m.host.nbytes() for m in ms) for k, ms in moved.items()}

    @torch.no_grad()
    def reload(self, *kinds: Kind) -> dict[Kind, int]:
        """Bring ``kinds`` (default: all) back to the device; the bytes moved per kind."""
        back = {k: self._offloaded.pop(k) for k in kinds or KINDS if k in self._offloaded}
        for m in (m for ms in back.values() for m in ms):
            m.storage.resize_(m.host.nbytes())
            m.storage.copy_(m.host, non_blocking=True)
        if back:
            self._synchronize()  # the data is in place before anyone reads it
        return {k: sum(m.host.nbytes() for m in ms) for k, ms in back.items()}

    def _copy_out(self, kind: Kind) -> list[_Moved]:
        pool, kept = self._host.get(kind, {}), {}
        out = []
        for key, storage in self._storages(kind).items():
            if not storage.nbytes():
                continue
            host = pool.get(key)
            if host is None or host.nbytes() != storage.nbytes():
                host = torch.empty(storage.nbytes(), dtype=torch.uint8,
                                   pin_memory=self.device.type == "cuda").untyped_storage()
            host.copy_(storage, non_blocking=True)
            kept[key] = host
            out.append(_Moved(storage, host))
        self._host[kind] = kept  # storages gone since (a checkpoint load replaced them) drop their buffers
        return out

    def _storages(self, kind: Kind) -> dict[int, torch.UntypedStorage]:
        """This kind's device storages, by identity, without those of the kinds before it."""
        taken = {key for earlier in KINDS[:KINDS.index(kind)] for key in self._storages(earlier)}
        out: dict[int, torch.UntypedStorage] = {}
        for t in self._tensors(kind):
            storage = t.untyped_storage()
            if storage.device == self.device and storage._cdata not in taken:
                out.setdefault(storage._cdata, storage)
        return out

    def _tensors(self, kind: Kind) -> Iterator[torch.Tensor]:
        params = list(self.policy.parameters())
        leaves = self._torch_optimizers()
        if kind == "params":
            yield from params
        elif kind == "grads":  # DDP's main_grad views; any .grad of a leaf (the optimizer's main params' too)
            for p in params + [q for opt in leaves for g in opt.param_groups for q in g["params"]]:
                yield from (g for g in (getattr(p, "main_grad", None), p.grad if p.is_leaf else None) if g is not None)
        else:  # the parameters the torch optimizer updates (fp32 main params, or the model's), its state
            for opt in leaves:
                yield from (q for g in opt.param_groups for q in g["params"])
                yield from (v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor))

    def _torch_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers under Megatron's wrappers (a ``ChainedOptimizer`` holds several)."""
        opt = self.policy.optimizer
        if opt is None:
            return []
        return [o.optimizer for o in getattr(opt, "chained_optimizers", [opt])]

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
