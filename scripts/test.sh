#!/usr/bin/env bash
# Set up, then run the test suite (real 2-rank CPU worlds included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/browser.sh  # Debian's chromium + driver for tests/test_browser.py (root: apt; else the test says so)
exec .venv/bin/python -m pytest -q -rs tests "$@"
