"""Builds and loads the C++ CPU kernels of ``csrc/`` at first use, or says once why it can't.

``torch.utils.cpp_extension.load`` compiles ``csrc/logprob_entropy.cpp`` with ninja and the system C++
compiler (``$CXX``, default ``c++``) into ``<hybridrl cache>/torch_extensions/hybridrl_ops_<hash>/``; the hash
covers the source, the compiler flags and the torch version, so a build is reused by every later process
(and by concurrent ones: torch's build lock) until one of those changes. A process whose
``$HYBRIDRL_CACHE_DIR`` points elsewhere (a test's own cache) reuses the same build of the default cache
(``~/.cache/hybridrl``) when there is one, so a test session compiles once. ~10 CPU-seconds with gcc.
The ops register as ``torch.ops.hybridrl_ops.row_stats`` / ``row_grad``.

When the build is impossible (no compiler, no ninja, sources not shipped, ``HYBRIDRL_DISABLE_CPP_OPS=1``)
or fails, :func:`load_cpu_ops` warns once, naming the cause, and returns ``False``: callers then take the
pure-PyTorch path.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import warnings
from pathlib import Path

import torch

from hybridrl.paths import cache_dir

DISABLE_ENV = "HYBRIDRL_DISABLE_CPP_OPS"
SOURCES = ("logprob_entropy.cpp",)
CFLAGS = ("-O3", "-fopenmp")
LDFLAGS = ("-fopenmp",)
DEFAULT_CACHE = Path.home() / ".cache" / "hybridrl"  # hybridrl.paths.cache_dir() without $HYBRIDRL_CACHE_DIR


def csrc_dir() -> Path:
    """``csrc/`` of this source checkout (hybridrl is installed editable from it)."""
    return Path(__file__).resolve().parents[2] / "csrc"


def build_problem() -> str | None:
    """Why the extension can't be built here, or None."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return f"{DISABLE_ENV}={os.environ[DISABLE_ENV]}"
    cxx = os.environ.get("CXX") or "c++"
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} from $CXX, default 'c++', is not on PATH)"
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    if missing := [s for s in SOURCES if not (csrc_dir() / s).is_file()]:
        return f"kernel sources {missing} not found in {csrc_dir()} (install hybridrl from a source checkout)"
    return None


def build_name() -> tuple[str, Path]:
    """The extension's name and build directory, both keyed by source, flags and torch version: an existing
    build in the default cache when this process's cache has none, else this process's cache."""
    h = hashlib.sha256(torch.__version__.encode() + repr((CFLAGS, LDFLAGS)).encode())
    for s in SOURCES:
        h.update((csrc_dir() / s).read_bytes())
    name = f"hybridrl_ops_{h.hexdigest()[:12]}"
    mine, default = (Path(d) / "torch_extensions" / name for d in (cache_dir(), DEFAULT_CACHE))
    return name, default if not (mine / f"{name}.so").is_file() and (default / f"{name}.so").is_file() else mine


@functools.cache
def load_cpu_ops() -> bool:
    """Build (once per source version) and load the CPU kernels; False, with one warning, when impossible."""
    why = build_problem()
    if why is None:
        try:
            from torch.utils.cpp_extension import load

            name, build_dir = build_name()
            build_dir.mkdir(parents=True, exist_ok=True)
            load(name=name, sources=[str(csrc_dir() / s) for s in SOURCES], extra_cflags=list(CFLAGS),
                 extra_ldflags=list(LDFLAGS), build_directory=str(build_dir), is_python_module=False)
            return True
        except Exception as e:  # a compiler that fails is a reason to fall back, not to stop a run
            why = f"building {csrc_dir() / SOURCES[0]} failed: {type(e).__name__}: {str(e).strip()[-500:]}"
    warnings.warn(f"hybridrl fused log-prob/entropy kernels unavailable, using the pure-PyTorch path: {why}",
                  RuntimeWarning, stacklevel=2)
    return False
