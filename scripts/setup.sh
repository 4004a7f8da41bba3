#!/usr/bin/env bash
# Set up feedgpu on a fresh machine: a virtual environment in .venv with the CPU build of
# torch, Pillow-SIMD built from source (AVX2 where the CPU has it) and feedgpu with its dev extra.
# Idempotent: a second run only checks what is there. feedgpu itself is installed again only when
# the venv lacks an editable install of this checkout made from the same pyproject.toml and extras
# (a stamp in the venv holds their hash), so a dependency added to pyproject.toml is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FEEDGPU_VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
pip_() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }
# torch first, pinned to the CPU build (a bare `torch` would pull a CUDA build of several GB).
"$PY" -c "import torch" 2>/dev/null || pip_ "torch==2.13.0"
# WebP decoding needs libwebp's headers when Pillow-SIMD is compiled (Debian: libwebp-dev); without
# them WebP files are skipped as "unsupported format" (feedgpu doctor shows what PIL can decode).
WEBP_H=/usr/include/webp/decode.h
if [ ! -e "$WEBP_H" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q libwebp-dev >/dev/null 2>&1 \
    || echo "setup: libwebp-dev could not be installed; WebP files will be skipped" >&2
fi
# Pillow-SIMD before anything else that could pull stock Pillow in: both own the PIL package.
# Built again (never from pip's wheel cache) when WebP headers are there but the build lacks WebP.
if ! "$PY" -c "import PIL, os, sys; from PIL import features
sys.exit('.post' not in PIL.__version__ or (os.path.exists('$WEBP_H') and not features.check('webp')))" 2>/dev/null; then
  if grep -qw avx2 /proc/cpuinfo 2>/dev/null; then export CC="${CC:-cc} -mavx2"; fi
  pip_ --no-cache-dir --force-reinstall --no-deps --no-binary pillow-simd "pillow-simd>=10.0"
fi
# DALI (CUDA 13 build; its CPU operators run without a GPU) for the DALI engine and its tests, and
# Ray (executor: ray; its tests start a 2-CPU local cluster). Ray does not depend on pillow.
# remote: fsspec, aiohttp and s3fs for sources read from URLs (and the S3 tests, with moto from dev)
# docs: mkdocs, mkdocs-material and mkdocstrings for the documentation site (none pulls pillow)
EXTRAS="dev,dali,ray,remote,docs"
STAMP="$VENV/.feedgpu-setup-stamp"
WANT="$( (pwd -P; echo "$EXTRAS"; cat pyproject.toml) | sha256sum | cut -d' ' -f1)"
editable_here() {  # the installed feedgpu is an editable install of this checkout
  "$PY" -I - "$(pwd -P)" <<'PYEOF' 2>/dev/null
import json, sys
from importlib.metadata import distribution
from pathlib import Path
from urllib.parse import unquote, urlparse
d = json.loads(distribution("feedgpu").read_text("direct_url.json") or "{}")
here = d.get("dir_info", {}).get("editable") and Path(unquote(urlparse(d["url"]).path)).resolve() == Path(sys.argv[1])
sys.exit(0 if here else 1)
PYEOF
}
if [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ] && editable_here; then
  echo "setup: feedgpu is installed (editable, this checkout, same pyproject.toml): not reinstalled" >&2
else
  rm -f "$STAMP"
  pip_ -e ".[$EXTRAS]"
  echo "$WANT" > "$STAMP"
fi
# matplotlib (plots of `feedgpu bench --plot`) requires `pillow`, which pip would install over
# Pillow-SIMD: install its other dependencies by name, then matplotlib without dependencies.
if ! "$PY" -c "import matplotlib" 2>/dev/null; then
  pip_ "contourpy>=1.0.1" "cycler>=0.10" "fonttools>=4.28.2" "kiwisolver>=1.3.1" "pyparsing>=3" \
       "python-dateutil>=2.7" "packaging>=20"
  pip_ --no-deps "matplotlib>=3.8"
fi
# Nothing above may have replaced Pillow-SIMD (feedgpu doctor shows the active PIL build).
"$PY" -c "import PIL, sys; sys.exit(0 if '.post' in PIL.__version__ else 'stock Pillow replaced Pillow-SIMD; rerun scripts/setup.sh after pip uninstall -y pillow')"
