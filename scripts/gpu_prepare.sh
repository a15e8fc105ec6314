#!/usr/bin/env bash
# Gather the wheels that scripts/gpu_check.sh installs on a GPU machine with no network, beside that
# machine's own CUDA torch and transformers. Run it where the package registries are reachable; the
# folder it fills (gpu-wheels/, ignored by git) travels with the working tree, 64 MiB at most.
#
#   scripts/gpu_prepare.sh [--python 3.12] [--cuda 130] [--out gpu-wheels]
#
# --python: the GPU image's Python (major.minor); --cuda: its torch's CUDA (torch.version.cuda without
# the dot: 130 for 13.0). Only the bitsandbytes CUDA library of that version is kept (its wheel ships
# one per CUDA release). A package with no wheel is built into one from its sdist (pure Python ones:
# prefetch_generator, varint, ...). Prints what the folder weighs; exits 1 when it is over 64 MiB.
set -euo pipefail

cd "$(dirname "$0")/.."
PY_VERSION=3.12
CUDA=130
OUT=gpu-wheels
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python) PY_VERSION="$2"; shift 2 ;;
    --cuda) CUDA="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    *) echo "gpu_prepare: unknown argument $1" >&2; exit 2 ;;
  esac
done
PYTHON="${PYTHON:-.venv/bin/python}"
LIMIT=$((64 * 1024 * 1024))

# What the check imports beyond the image (KINDS.md lists the image's packages: torch, transformers,
# numpy, psutil, PyYAML, rich, typer's click, uvloop, prometheus-client, safetensors, pytest... are there).
# Pinned where the project pins (pyproject.toml), else the versions this machine's .venv resolved.
PACKAGES=(
  hivemind==1.1.12 base58 configargparse netaddr py-cid py-multihash py-multibase py-multicodec morphys
  multiaddr dnspython trio trio-typing outcome sniffio attrs sortedcontainers mmh3 blake3 varint
  prefetch_generator pydantic pydantic-core annotated-types typing-inspection cryptography cffi pycparser
  typer shellingham annotated-doc starlette uvicorn h11 anyio bitsandbytes
)
pinned() {  # NAME==VERSION as installed in this machine's .venv (the versions the suite passes with)
  local name="${1%%==*}"
  [[ "$1" == *==* ]] && { echo "$1"; return; }
  local version
  version="$("$PYTHON" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')"
  if [[ -n "$version" ]]; then echo "$name==$version"; else echo "$name"; fi
}
PLATFORMS=()
for tag in manylinux_2_39_x86_64 manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 \
  manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
  manylinux2014_x86_64 manylinux1_x86_64 linux_x86_64 any; do
  PLATFORMS+=(--platform "$tag")
done

rm -rf "$OUT" && mkdir -p "$OUT"
BUILD="$(mktemp -d)"
trap 'rm -rf "$BUILD"' EXIT
for package in "${PACKAGES[@]}"; do
  spec="$(pinned "$package")"
  if ! "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
      --implementation cp "${PLATFORMS[@]}" -d "$OUT" "$spec" 2>"$BUILD/err"; then
    echo "gpu_prepare: no wheel of $spec for Python $PY_VERSION; building one from its sdist"
    "$PYTHON" -m pip download -q --no-deps --no-binary=:all: -d "$BUILD/sdist" "$spec"
    "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$BUILD/wheels" "$BUILD"/sdist/*
    rm -rf "$BUILD/sdist"
    for wheel in "$BUILD"/wheels/*.whl; do
      case "$wheel" in
        *-py3-none-any.whl | *-py2.py3-none-any.whl) mv "$wheel" "$OUT/" ;;
        *) echo "gpu_prepare: $spec builds a binary wheel ($wheel): not usable on Python $PY_VERSION" >&2; exit 1 ;;
      esac
    done
  fi
done

# bitsandbytes: keep its CPU library and the one CUDA library of the image's CUDA.
"$PYTHON" -m scripts._gpu_wheels strip-bitsandbytes "$OUT" --cuda "$CUDA"

WEIGHT="$(du -cb "$OUT"/*.whl | tail -n 1 | cut -f 1)"
printf 'gpu_prepare: %s holds %d wheels, %.1f MiB (limit 64 MiB)\n' "$OUT" "$(ls "$OUT"/*.whl | wc -l)" \
  "$(echo "$WEIGHT / 1048576" | bc -l)"
if (( WEIGHT > LIMIT )); then
  echo "gpu_prepare: over 64 MiB: the working tree would not travel" >&2
  exit 1
fi
