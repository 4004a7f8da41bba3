#!/usr/bin/env bash
# Every test: tests/ in .venv (all tiers but tests/tv), then tests/tv in .venv-tv (PyPI's torch and
# torchvision; see scripts/setup_tv.sh). Arguments go to both pytest runs (-x, -k EXPR, ...).
# Exits non-zero if either run fails.
set -uo pipefail
cd "$(dirname "$0")/.."
# .venv-tv is built (or checked) here, not by scripts/setup.sh, so the main job does not need it.
bash scripts/setup_tv.sh || exit $?
.venv/bin/python -m pytest -q -p no:cacheprovider tests --ignore=tests/tv "$@"; main=$?
.venv-tv/bin/python -m pytest -q -p no:cacheprovider tests/tv "$@"; tv=$?
# with a selection (-k, -m), one side may select nothing (pytest's exit 5): not a failure then
if [ $# -gt 0 ]; then [ $main = 5 ] && main=0; [ $tv = 5 ] && tv=0; fi
exit $(( main != 0 ? main : tv ))
