#!/usr/bin/env bash
# The GPU checks, on one CUDA machine, ending with one line per check: name | pass/fail | figure.
#   bash tests/gpu/run_all.sh [--dry-run] [--wheels DIR] [--full]
# --wheels DIR  install offline first from DIR (filled by tests/gpu/fetch_wheels.sh on a networked
#               machine): the pins of tests/gpu/wheels.txt, then this checkout (pip install -e . --no-deps).
#               Without it, the environment must already have hybridrl and its dependencies.
# --full        also the checks for a full GPU environment (Transformer Engine and SGLang installed).
# --dry-run     no GPU, nothing installed or run: checks that every command resolves (recipes compose
#               with each check's overrides, files exist, the wheel list is the one fetch_wheels.sh
#               fetches, the check modules import) and prints what would run.
# The checks themselves, their overrides and time limits: tests/gpu/gpu_checks.py; tests/gpu/README.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
dry=0 full=() wheels=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --full) full=(--full) ;;
    --wheels) [ $# -ge 2 ] || { echo "run_all.sh: --wheels needs a folder" >&2; exit 2; }; wheels="$2"; shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "run_all.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

if [ "$dry" = 1 ]; then
  exec "$PY" tests/gpu/gpu_checks.py dry-run "${full[@]}" ${wheels:+--wheels "$wheels"}
fi

start=$(date +%s)
if [ -n "$wheels" ]; then
  echo "== installing offline from $wheels: tests/gpu/wheels.txt, then this checkout (no deps)"
  # what the box lacks, each pin resolved against what it has (torch, numpy, packaging, PyYAML, ...)
  "$PY" -m pip install -q --no-index --find-links "$wheels" -r tests/gpu/wheels.txt
  # the code under test is this checkout; its build requirements come from $wheels too
  "$PY" -m pip install -q --no-index --find-links "$wheels" --no-deps -e .
fi
"$PY" - <<'EOF'
# hybridrl's own requirements, installed --no-deps: each present at a version it accepts (wandb aside:
# imported only with trainer.logger=[..., wandb])
from importlib.metadata import PackageNotFoundError, requires, version
from packaging.requirements import Requirement

bad = []
for req in map(Requirement, requires("hybridrl") or []):
    if req.marker is not None and not req.marker.evaluate({"extra": ""}) or req.name == "wandb":
        continue
    try:
        if not req.specifier.contains(version(req.name), prereleases=True):
            bad.append(f"{req} (installed: {version(req.name)})")
    except PackageNotFoundError:
        bad.append(f"{req} (not installed)")
if bad:
    raise SystemExit("run_all.sh: hybridrl needs " + "; ".join(bad) + ". Without --wheels DIR install hybridrl's "
                     "dependencies first; with it, what tests/gpu/wheels.txt does not list must be on the box already")
EOF
echo "== installed in $(( $(date +%s) - start )) s"
HYBRIDRL_GPU_START="$start" exec "$PY" tests/gpu/gpu_checks.py run "${full[@]}"
