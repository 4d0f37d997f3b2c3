#!/usr/bin/env bash
# fetch_wheels.sh DIR — on a machine that reaches PyPI: fill DIR with the wheels a bare GPU box
# (Python 3.12, manylinux x86_64, no network) needs for tests/gpu/run_all.sh, and write
# DIR/MANIFEST.txt (name, version, sha256, bytes of each). Copy DIR to the box, then
#   bash tests/gpu/run_all.sh --wheels DIR
# What is fetched: the pins of tests/gpu/wheels.txt (no dependencies: the box has the rest), and
# hybridrl's build requirements from pyproject.toml's [build-system] with their dependencies, so the
# box can `pip install -e .` the checkout offline. antlr4-python3-runtime has only an sdist on PyPI:
# it is built here into a pure-Python wheel. Fails if DIR would exceed 64 MiB.
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: bash tests/gpu/fetch_wheels.sh DIR" >&2; exit 2; }
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
out="$1"
PY="${PYTHON:-python3}"
LIMIT=$((64 << 20))
# the box: CPython 3.12 on glibc ≥ 2.28 x86_64 (pip matches each manylinux tag exactly: name them all)
TARGET=(--python-version 3.12 --implementation cp --abi cp312 --only-binary=:all:
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)

mkdir -p "$out"
if [ -f "$out/MANIFEST.txt" ]; then  # an earlier fetch: replace exactly what it wrote
  awk '!/^#/ && NF { print $5 }' "$out/MANIFEST.txt" | while read -r f; do rm -f "$out/$f"; done
  rm -f "$out/MANIFEST.txt"
fi
if [ -n "$(ls -A "$out")" ]; then
  echo "fetch_wheels.sh: $out holds files that no earlier fetch wrote; use an empty or new folder" >&2
  exit 2
fi

# 1. the pins (pure-Python or cp312 manylinux wheels); the sdist-only ones are built in step 2
mapfile -t pins < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$here/wheels.txt" | grep -v '^$')
binary=() sdist=()
for pin in "${pins[@]}"; do
  case "$pin" in antlr4-python3-runtime==*) sdist+=("$pin") ;; *) binary+=("$pin") ;; esac
done
"$PY" -m pip download --quiet --no-deps "${TARGET[@]}" -d "$out" "${binary[@]}"

# 2. sdist-only pins: build here; each must come out pure Python (py3-none-any), or the box can't use it
for pin in "${sdist[@]}"; do
  "$PY" -m pip wheel --quiet --no-deps --no-binary=:all: -w "$out" "$pin"
done
for whl in "$out"/*.whl; do
  case "$whl" in *-py3-none-any.whl|*-py2.py3-none-any.whl|*-cp312-*.whl) ;;
    *) echo "fetch_wheels.sh: $whl does not install on CPython 3.12 x86_64" >&2; exit 1 ;;
  esac
done

# 3. hybridrl's build requirements (and theirs) for the box's offline `pip install -e .`
mapfile -t build < <("$PY" -c 'import sys, tomllib; print(*tomllib.load(open(sys.argv[1], "rb"))["build-system"]["requires"], sep="\n")' "$repo/pyproject.toml")
"$PY" -m pip download --quiet "${TARGET[@]}" -d "$out" "${build[@]}"

# 4. the manifest, and the size limit
"$PY" - "$out" "$LIMIT" <<'EOF'
import hashlib, sys, zipfile
from email.parser import Parser
from pathlib import Path

out, limit = Path(sys.argv[1]), int(sys.argv[2])
rows, total = [], 0
for whl in sorted(out.glob("*.whl")):
    with zipfile.ZipFile(whl) as z:
        meta = Parser().parsestr(z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode())
    size = whl.stat().st_size
    total += size
    rows.append(f"{meta['Name']}\t{meta['Version']}\t{hashlib.sha256(whl.read_bytes()).hexdigest()}\t{size}\t{whl.name}")
header = "# name\tversion\tsha256\tbytes\tfile (written by tests/gpu/fetch_wheels.sh)"
(out / "MANIFEST.txt").write_text("\n".join([header, *rows]) + "\n")
print("\n".join(rows))
print(f"{len(rows)} wheels, {total / 2**20:.1f} MiB in {out}")
if total > limit:
    sys.exit(f"fetch_wheels.sh: {total / 2**20:.1f} MiB is over the {limit >> 20} MiB limit")
EOF
