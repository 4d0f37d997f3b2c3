"""``import megatron.core`` without the modules a run never uses (a workaround for two upstream behaviours).

megatron-core 0.16.1, at ``import megatron.core``:

- ``megatron/core/jit.py`` sets ``jit_fuser = torch.compile`` and the fusion modules (``fusions/
  fused_bias_geglu.py``, ``fused_bias_swiglu.py``, …) decorate their functions with it at import time.
  ``torch.compile(fn)`` imports ``torch._dynamo`` and ``torch._inductor`` right away, although it compiles
  nothing before the function's first call, and those fusions are only called with the bias/activation
  fusions on (never on CPU; on a GPU only when configured). That import is ~65 MiB of resident memory and
  ~1 s on every rank.
- ``inference/contexts/dynamic_context.py`` imports ``wandb`` (which pulls ``tensorboard`` where installed)
  for its own inference-time logging, which hybridrl never uses: ~30 MiB more where they are installed.

:func:`install` (called by ``hybridrl/__init__.py``, before anything imports Megatron) adds a meta-path hook
that runs megatron.core's own import (once, the first time anything imports it) with ``torch.compile``
replaced by :func:`_deferred_compile` — the same ``torch.compile`` call, made at the decorated function's
first call instead of at decoration (the result is the same compiled function) — and with ``wandb`` and
``tensorboard`` hidden (Megatron catches the ``ImportError`` and sets them to None), unless something
imported them before. After it both are importable as usual (hybridrl's ``trainer.logger`` import their own).

``tests/megatron/test_lean_import.py`` checks that plain ``import megatron.core`` still imports them all
(remove this module when it fails) and that with it none is imported and a deferred fusion still computes.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

HIDDEN = ("wandb", "tensorboard")


def install() -> None:
    """Add the hook (idempotent; nothing to do when megatron.core is already imported)."""
    if "megatron.core" in sys.modules or any(isinstance(f, _MegatronCoreFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _MegatronCoreFinder())


def _deferred_compile(real_compile: Callable[..., Any], model: Callable[..., Any] | None = None,
                      **kwargs: Any) -> Any:
    """``real_compile`` (``torch.compile``) used as a decorator, called (and so dynamo imported) at the
    decorated function's first call instead of at decoration."""
    if model is None:  # @torch.compile(mode=...) form
        return lambda fn: _deferred_compile(real_compile, fn, **kwargs)
    compiled: Callable[..., Any] | None = None

    @functools.wraps(model)
    def call(*args: Any, **kw: Any) -> Any:
        nonlocal compiled
        if compiled is None:
            compiled = real_compile(model, **kwargs)
        return compiled(*args, **kw)

    call.hybridrl_deferred_compile = True  # type: ignore[attr-defined]
    return call


@contextmanager
def _lean() -> Iterator[None]:
    import torch

    hidden = [name for name in HIDDEN if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # `import name` raises ImportError
    real_compile = torch.compile
    torch.compile = functools.partial(_deferred_compile, real_compile)  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compile = real_compile  # type: ignore[assignment]
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


class _LeanLoader(importlib.abc.Loader):
    """megatron.core's own loader, its module body run inside :func:`_lean`."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        with _lean():
            self._loader.exec_module(module)

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, … of the real loader
        return getattr(self._loader, name)


class _MegatronCoreFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "megatron.core":
            return None
        sys.meta_path.remove(self)  # once: the rest of the import (and any later one) is Python's own
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _LeanLoader(spec.loader)
        return spec
