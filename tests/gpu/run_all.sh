#!/usr/bin/env bash
# The GPU checks, run by hand on a CUDA machine (CPU CI skips them: it has no GPU).
#   pip install torch -e '.[test,sglang]' && bash tests/gpu/run_all.sh [pytest args]
# Runs every `gpu`-marked test under tests/gpu and prints a short summary of what they measured.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python}"
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
  || { echo "run_all.sh: no CUDA device visible to torch; run this on a GPU machine"; exit 1; }
report="$(mktemp -d)/gpu_report.jsonl"
export HYBRIDRL_GPU_REPORT="$report"
start=$(date +%s)
"$PY" -m pytest -m gpu tests/gpu -v -rA -p no:cacheprovider "$@"
rc=$?
echo
echo "== GPU summary ($(( $(date +%s) - start )) s, pytest exit $rc) =="
"$PY" -c 'import torch; print("device:", torch.cuda.get_device_name(0), "| torch", torch.__version__)'
if [ -s "$report" ]; then
  while IFS= read -r line; do echo "  $line"; done < "$report"
else
  echo "  (no measurements recorded)"
fi
exit $rc
