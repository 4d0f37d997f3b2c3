"""Debug mode ``HYBRIDRL_CHECK_COLLECTIVES=1``: every collective checks that its tensors live on its group's device.

NCCL groups take CUDA tensors and gloo groups CPU tensors; a CPU tensor handed to an NCCL group (or the
reverse) fails on a GPU machine, often only at scale or as a hang. With the variable set,
``init_parallel`` wraps the tensor collectives of ``torch.distributed`` (looked up by attribute at call
time, as hybridrl and Megatron call them) so that a mismatch raises at once, naming the collective, the
group's backend and the tensor's device; ``report()`` says how many calls were checked. It runs in the
e2e test on CPU (where every group is gloo: it then proves the bookkeeping collectives get CPU tensors)
and in the GPU check script (where it proves the NCCL ones get CUDA tensors).
"""

from __future__ import annotations

import functools
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

ENV = "HYBRIDRL_CHECK_COLLECTIVES"
# collective -> positions/names of its tensor arguments (each a tensor or a list of tensors)
_TENSOR_ARGS: dict[str, tuple[tuple[int, str], ...]] = {
    "all_reduce": ((0, "tensor"),),
    "broadcast": ((0, "tensor"),),
    "reduce": ((0, "tensor"),),
    "all_gather": ((0, "tensor_list"), (1, "tensor")),
    "all_gather_into_tensor": ((0, "output_tensor"), (1, "input_tensor")),
    "reduce_scatter_tensor": ((0, "output"), (1, "input")),
    "gather": ((0, "tensor"),),
    "scatter": ((0, "tensor"),),
    "send": ((0, "tensor"),),
    "recv": ((0, "tensor"),),
    "isend": ((0, "tensor"),),
    "irecv": ((0, "tensor"),),
}
CHECKED: Counter[str] = Counter()


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def install() -> None:
    """Wrap the collectives (idempotent)."""
    for name, args in _TENSOR_ARGS.items():
        fn = getattr(dist, name)
        if not getattr(fn, "_hybridrl_checked", False):
            setattr(dist, name, _checked(name, fn, args))


def report() -> str:
    total = sum(CHECKED.values())
    top = ", ".join(f"{k} {v}" for k, v in CHECKED.most_common())
    return f"collective device check: {total} calls checked ({top}), each on its group's device"


def _checked(name: str, fn: Callable[..., Any], args: tuple[tuple[int, str], ...]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*a: Any, **kw: Any) -> Any:
        group = kw.get("group")
        backend = dist.get_backend(group)
        want = "cuda" if backend == "nccl" else "cpu"
        for pos, key in args:
            value = kw[key] if key in kw else (a[pos] if pos < len(a) else None)
            for t in value if isinstance(value, list | tuple) else [value]:
                if isinstance(t, torch.Tensor) and t.device.type != want:
                    raise RuntimeError(f"{ENV}: dist.{name} on a {backend} group got a tensor on {t.device} "
                                       f"(shape {tuple(t.shape)}, {t.dtype}); {backend} groups take {want} tensors")
        CHECKED[name] += 1
        return fn(*a, **kw)

    wrapper._hybridrl_checked = True  # type: ignore[attr-defined]
    return wrapper
