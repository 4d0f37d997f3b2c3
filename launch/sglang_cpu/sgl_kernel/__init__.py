"""Stand-in for ``sgl_kernel`` (SGLang's compiled kernels) on machines where no build of it exists.

Installed into site-packages by ``launch/install_sglang_cpu.sh`` on CPU-only machines and nowhere else.
PyPI has no CPU build of ``sgl-kernel``/``sglang-kernel`` (the PyPI one is a CUDA build that fails to
load with ``libnvrtc.so.12: cannot open shared object file``), yet SGLang 0.5.21 imports names from
it at module level on every platform (e.g. ``from sgl_kernel import copy_all_layer_kv_cache_cpu``).
On a CPU without AMX, SGLang's CPU engine calls none of them (RMSNorm/SiLU/attention use torch), so
a module whose every attribute is a placeholder that *raises when called* is enough: any code path
that does need a real kernel fails loudly with the kernel's name, never silently.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, NoReturn

__version__ = "0.0.0+hybridrl.cpu.standin"
IS_STANDIN = True


class MissingKernel:
    """A placeholder for one compiled kernel: importable, raises when used."""

    def __init__(self, qualname: str) -> None:
        self.qualname = qualname

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"{self.qualname} is a compiled SGLang kernel, and this is hybridrl's CPU stand-in for "
            "sgl_kernel (launch/sglang_cpu/sgl_kernel): no build of sgl_kernel exists for this machine. "
            "Use an SGLang option that avoids the kernel (CPU engine: attention_backend='torch_native', "
            "sampling_backend='pytorch') or install the real sglang-kernel on a GPU machine."
        )

    def __getattr__(self, name: str) -> MissingKernel:
        if name.startswith("__"):
            raise AttributeError(name)
        return MissingKernel(f"{self.qualname}.{name}")

    def __repr__(self) -> str:
        return f"<missing kernel {self.qualname}>"


def _module_getattr(module_name: str) -> Any:
    def __getattr__(name: str) -> MissingKernel:
        if name.startswith("__"):  # keep Python's own protocol lookups (e.g. __path__, __file__) honest
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        return MissingKernel(f"{module_name}.{name}")

    return __getattr__


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Any ``sgl_kernel.<sub>`` import yields a stand-in module of the same kind."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


__getattr__ = _module_getattr(__name__)
if not any(isinstance(f, _SubmoduleFinder) for f in sys.meta_path):
    sys.meta_path.append(_SubmoduleFinder())
