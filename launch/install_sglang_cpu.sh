#!/usr/bin/env bash
# Install the real SGLang engine (0.5.21) into the current Python environment on a CPU-only machine.
#
#   bash launch/install_sglang_cpu.sh        # PYTHON=... to pick the interpreter (default: python)
#
# SGLang's declared dependencies pull CUDA stacks (flashinfer, sglang-kernel, cuda-python, ...) and a
# CUDA torch, so this installs `sglang --no-deps` plus, by hand and pinned, the pure-Python packages it
# imports on the CPU engine path, `triton` (imported unconditionally) with --no-deps, and closes two
# CPU gaps (see launch/sglang_cpu/ and hybridrl/rollout/engines/sglang_compat.py):
#   - torchvision from PyPI is a CUDA build: its C extension is removed and its fake-kernel
#     registration guarded (launch/sglang_cpu/patch_torchvision.py);
#   - there is no CPU build of sgl_kernel: a stand-in whose kernels raise when called is copied into
#     site-packages (launch/sglang_cpu/sgl_kernel/).
# torch, transformers and numpy are held at the installed versions (a pip constraint file), so the
# CPU torch is never replaced. Idempotent: a second run only checks package metadata (~1 s).
# On a GPU machine use `pip install 'hybridrl[sglang]'` instead.
set -euo pipefail

PY="${PYTHON:-python}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
say() { echo "[install_sglang_cpu] $*"; }

NODEPS=(  # packages whose declared deps would pull CUDA or another torch
  sglang==0.5.21
  triton==3.9.0
  torchvision==0.28.0
  compressed-tensors==0.17.0
  gguf==0.19.0
)
DEPS=(  # pure-Python (or self-contained wheel) deps that sglang 0.5.21 imports on the CPU engine path
  aiohttp==3.14.5
  dill==0.4.1
  einops==0.8.2
  fastapi==0.136.3
  interegular==0.3.3
  ipython==8.12.3
  loguru==0.7.3
  msgspec==0.23.0
  openai==3.57.0
  orjson==3.8.3
  partial-json-parser==0.2.1.1.post7
  pillow==13.0.0
  prometheus-client==0.26.0
  psutil==7.2.2
  pybase64==1.5.1
  python-multipart==0.0.34
  pyzmq==27.3.0
  sentencepiece==0.2.1
  setproctitle==1.3.8
  uvicorn==0.54.0
  uvloop==0.23.0
)

start=$(date +%s)
torch_before="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)" || {
  say "torch is not importable with $PY; install the CPU build first: pip install torch==2.13.0"; exit 1; }
case "$torch_before" in
  *+cpu) ;;
  *) say "torch $torch_before is not a CPU build; this harness is for CPU machines (GPU: pip install 'hybridrl[sglang]')"
     exit 1 ;;
esac

if "$PY" "$HERE/sglang_cpu/check_install.py" "${NODEPS[@]}" "${DEPS[@]}" >/dev/null; then
  say "already installed (sglang 0.5.21 CPU stack, torch $torch_before); nothing to do"
  exit 0
fi
say "to install:"
"$PY" "$HERE/sglang_cpu/check_install.py" "${NODEPS[@]}" "${DEPS[@]}" || true

constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
"$PY" - "$constraints" <<'PYEOF'
import sys
from importlib import metadata
with open(sys.argv[1], "w") as f:
    for name in ("torch", "transformers", "tokenizers", "numpy"):
        try:
            f.write(f"{name}=={metadata.version(name)}\n")
        except metadata.PackageNotFoundError:
            pass
PYEOF
say "holding: $(tr '\n' ' ' < "$constraints")"

say "pip install (with deps, constrained): ${DEPS[*]}"
"$PY" -m pip install --quiet --disable-pip-version-check -c "$constraints" "${DEPS[@]}"
say "pip install --no-deps: ${NODEPS[*]}"
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps -c "$constraints" "${NODEPS[@]}"

say "patching torchvision for a CPU torch"
"$PY" "$HERE/sglang_cpu/patch_torchvision.py"

site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if "$PY" -c 'import sgl_kernel, sys; sys.exit(0 if getattr(sgl_kernel, "IS_STANDIN", False) else 1)' 2>/dev/null \
   || ! "$PY" -c 'import sgl_kernel' 2>/dev/null; then
  say "installing the sgl_kernel CPU stand-in into $site/sgl_kernel"
  rm -rf "$site/sgl_kernel"
  cp -r "$HERE/sglang_cpu/sgl_kernel" "$site/sgl_kernel"
  find "$site/sgl_kernel" -name __pycache__ -prune -exec rm -rf {} +
else
  say "a real sgl_kernel is installed; leaving it (the CPU engine may fail to load it)"
fi

torch_after="$("$PY" -c 'import torch; print(torch.__version__)')"
if [ "$torch_after" != "$torch_before" ]; then
  say "FAILED: torch changed from $torch_before to $torch_after"; exit 1
fi
say "checking: import sglang's engine with SGLANG_USE_CPU_ENGINE=1"
SGLANG_USE_CPU_ENGINE=1 "$PY" -c 'from sglang.srt.entrypoints.engine import Engine; import sglang; print("sglang", sglang.__version__)'
"$PY" "$HERE/sglang_cpu/check_install.py" "${NODEPS[@]}" "${DEPS[@]}"
say "done in $(( $(date +%s) - start )) s; torch is still $torch_after"
