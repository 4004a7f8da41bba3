#!/usr/bin/env bash
# Second environment for the torchvision tests (tests/tv): .venv-tv with PyPI's torch and
# torchvision, Pillow-SIMD over the stock Pillow that torchvision pulls in, DALI and feedgpu itself.
# PyPI's torchvision loads its compiled ops only beside PyPI's own torch build (a CUDA build that runs
# on the CPU), not beside the CPU build of .venv, so the two cannot share one environment.
# Called by scripts/test.sh; FEEDGPU_TV=0 skips it. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${FEEDGPU_TV:-1}" = 0 ] && exit 0
VENV=${FEEDGPU_TV_VENV:-.venv-tv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
pip_() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }
# Any build of Pillow-SIMD below uses AVX2 where the CPU has it.
if grep -qw avx2 /proc/cpuinfo 2>/dev/null; then export CC="${CC:-cc} -mavx2"; fi
# torch and torchvision from PyPI as one pinned pair (torchvision's ops are built for one torch):
# on x86_64 PyPI's CUDA build of torch (it runs on the CPU too), on aarch64 its CPU build.
PAIR=("torch==2.14.1" "torchvision==0.29.1")
[ "$(uname -m)" = aarch64 ] && PAIR=("torch==2.9.1" "torchvision==0.24.1")
"$PY" -c "import torchvision" 2>/dev/null || pip_ "${PAIR[@]}"
# feedgpu with the torchvision and DALI extras and the test runner (not all of dev: lightning,
# accelerate and moto are for tests that run in .venv).
pip_ -e ".[torchvision,dali]" "pytest>=8" "pytest-timeout>=2.2"
# torchvision requires `pillow`: pip installed stock Pillow, which owns the same PIL package as
# Pillow-SIMD. Remove it and build Pillow-SIMD from source as scripts/setup.sh does.
if "$PY" -m pip show -q pillow >/dev/null 2>&1 \
   || ! "$PY" -c "import PIL, sys; sys.exit('.post' not in PIL.__version__)" 2>/dev/null; then
  "$PY" -m pip uninstall -y -q pillow 2>/dev/null || true
  pip_ --no-cache-dir --force-reinstall --no-deps --no-binary pillow-simd "pillow-simd>=10.0"
fi
"$PY" -c "import PIL, sys, torchvision; sys.exit(0 if '.post' in PIL.__version__ else 'stock Pillow replaced Pillow-SIMD in $VENV')"
