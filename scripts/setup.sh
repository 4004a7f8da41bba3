#!/usr/bin/env bash
# Set up feedgpu on a fresh machine: a virtual environment in .venv with the CPU build of
# torch, Pillow-SIMD built from source (AVX2 where the CPU has it) and feedgpu with its dev extra.
# Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FEEDGPU_VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
pip_() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }
# torch first, pinned to the CPU build (a bare `torch` would pull a CUDA build of several GB).
"$PY" -c "import torch" 2>/dev/null || pip_ "torch==2.13.0"
# Pillow-SIMD before anything else that could pull stock Pillow in: both own the PIL package.
if ! "$PY" -c "import PIL, sys; sys.exit('.post' not in PIL.__version__)" 2>/dev/null; then
  if grep -qw avx2 /proc/cpuinfo 2>/dev/null; then export CC="${CC:-cc} -mavx2"; fi
  pip_ --no-binary pillow-simd "pillow-simd>=10.0"
fi
# DALI (CUDA 13 build; its CPU operators run without a GPU) for the DALI engine and its tests.
pip_ -e ".[dev,dali]"
# matplotlib (plots of `feedgpu bench --plot`) requires `pillow`, which pip would install over
# Pillow-SIMD: install its other dependencies by name, then matplotlib without dependencies.
if ! "$PY" -c "import matplotlib" 2>/dev/null; then
  pip_ "contourpy>=1.0.1" "cycler>=0.10" "fonttools>=4.28.2" "kiwisolver>=1.3.1" "pyparsing>=3" \
       "python-dateutil>=2.7" "packaging>=20"
  pip_ --no-deps "matplotlib>=3.8"
fi
# Nothing above may have replaced Pillow-SIMD (feedgpu doctor shows the active PIL build).
"$PY" -c "import PIL, sys; sys.exit(0 if '.post' in PIL.__version__ else 'stock Pillow replaced Pillow-SIMD; rerun scripts/setup.sh after pip uninstall -y pillow')"
