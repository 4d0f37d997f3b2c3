"""Is the SGLang CPU stack installed as ``launch/install_sglang_cpu.sh`` pins it? Fast: reads metadata only.

Usage: ``python check_install.py NAME==VERSION ...``. Prints each thing that is missing or different and
exits 1 if any; exits 0 (silently) when the pins, the ``sgl_kernel`` stand-in and the torchvision guard
are all in place. Imports neither sglang nor torch.
"""

from __future__ import annotations

import filecmp
import importlib.util
import sys
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent


def problems(pins: list[str]) -> list[str]:
    out = []
    for pin in pins:
        name, _, want = pin.partition("==")
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            out.append(f"{name} is not installed (want {want})")
            continue
        if have != want:
            out.append(f"{name} {have} is installed, want {want}")
    spec = importlib.util.find_spec("sgl_kernel")
    if spec is None or spec.origin is None:
        out.append("sgl_kernel (hybridrl's CPU stand-in) is not installed")
    elif not filecmp.cmp(spec.origin, HERE / "sgl_kernel" / "__init__.py", shallow=False):
        out.append(f"sgl_kernel at {spec.origin} is not this repo's CPU stand-in")
    tv = importlib.util.find_spec("torchvision")
    if tv is not None and tv.origin is not None:
        meta = Path(tv.origin).parent / "_meta_registrations.py"
        if "patched by hybridrl" not in meta.read_text():
            out.append(f"torchvision is not patched for CPU torch ({meta})")
    return out


if __name__ == "__main__":
    found = problems(sys.argv[1:])
    for p in found:
        print(f"  missing: {p}")
    sys.exit(1 if found else 0)
