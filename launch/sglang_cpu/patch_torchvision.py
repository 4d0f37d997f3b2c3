"""Make PyPI's (CUDA) torchvision importable next to a CPU torch build. Idempotent.

PyPI's torchvision wheel is built against CUDA: its C extension (``_C.so``, ``image.so``) cannot load
next to ``torch+cpu``. torchvision then imports without its C ops, except ``_meta_registrations``,
which registers fake kernels for ``torchvision::nms``/``qnms`` unconditionally and dies with
``RuntimeError: operator torchvision::nms does not exist``. SGLang imports torchvision at start-up
(multimodal preprocessing; never used for a text-only model), so this script:

1. deletes the two ``.so`` files (so nothing half-loads them later), and
2. moves ``_meta_registrations.py`` to ``_meta_registrations_cuda.py`` and puts a stub in its place
   that imports it only when the C ops are present (``torchvision.extension._has_ops()``).
   (``_autograd_registrations`` already has that guard upstream.)

Usage: ``python patch_torchvision.py`` (prints what it did; exit 1 when torchvision still fails).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

MARK = "# patched by hybridrl launch/sglang_cpu/patch_torchvision.py"
STUB = f'''{MARK}
# The CUDA build's C ops cannot load next to a CPU torch; register the fake kernels only when they did.
from torchvision.extension import _has_ops

if _has_ops():
    from torchvision._meta_registrations_cuda import *  # noqa: F401,F403
'''


def main() -> int:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        print("patch_torchvision: torchvision is not installed; nothing to do")
        return 0
    root = Path(spec.origin).parent
    for name in ("_C.so", "image.so"):
        if (root / name).exists():
            (root / name).unlink()
            print(f"patch_torchvision: removed {root / name}")
    meta = root / "_meta_registrations.py"
    if MARK not in meta.read_text():
        meta.rename(root / "_meta_registrations_cuda.py")
        meta.write_text(STUB)
        print(f"patch_torchvision: guarded {meta} (original kept as _meta_registrations_cuda.py)")
    else:
        print("patch_torchvision: already patched")
    check = subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True, text=True)
    if check.returncode != 0:
        print(f"patch_torchvision: `import torchvision` still fails:\n{check.stderr[-2000:]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
