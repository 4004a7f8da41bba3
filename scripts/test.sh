#!/usr/bin/env bash
# Every test: tests/ in .venv (all tiers but tests/tv), then tests/tv in .venv-tv (PyPI's torch and
# torchvision; see scripts/setup_tv.sh). Arguments go to both pytest runs (-x, -k EXPR, ...).
# Exits non-zero if either run fails.
set -uo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pytest -q -p no:cacheprovider tests --ignore=tests/tv "$@"; main=$?
.venv-tv/bin/python -m pytest -q -p no:cacheprovider tests/tv "$@"; tv=$?
exit $(( main != 0 ? main : tv ))
