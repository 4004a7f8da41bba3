#!/usr/bin/env bash
# feedgpu's runtime dependencies (and pytest) as wheels for the GPU machine's Python 3.12, which
# has torch, numpy, Pillow and pyarrow but not these, and no network (../shared/docs/gpu-checks.md).
#
# Usage (from the project's root):   bash bench/gpu_deps.sh [DIR]
#   DIR  folder inside the checkout, ignored by git (default: .dv/deps); carry it with the last
#        DALI part and install both:
#        python3 -m pip install -q --no-index --no-deps --no-compile --target ~/site ~/w/*.whl DIR/*.whl
#        export PYTHONPATH=~/site; python3 bench/gpu_check.py --out $OUT/gpu_check
set -euo pipefail
DIR=${1:-.dv/deps}
mkdir -p "$DIR"
top=$(dirname "$DIR" | cut -d/ -f1)
grep -qxF "/$top/" .git/info/exclude 2>/dev/null || echo "/$top/" >> .git/info/exclude
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
for pkg in "zstandard>=0.22" "xxhash>=3.0" "PyYAML>=6.0" "pydantic>=2.5" pydantic-core annotated-types \
           typing-extensions typing-inspection "click>=8.1" "tqdm>=4.66" "platformdirs>=3.0" "psutil>=5.9" \
           "pytest>=8" pluggy iniconfig packaging "pytest-timeout>=2.2"; do
  python3 -m pip download -q --no-deps "${plat[@]}" -d "$DIR" "$pkg"
done
echo "Prepared $(ls "$DIR"/*.whl | wc -l) wheels in $DIR ($(du -sh "$DIR" | cut -f1))."
