#!/usr/bin/env bash
# Set up, then run the test suite (real 2-rank CPU worlds included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/browser.sh  # Debian's chromium + driver for tests/test_browser.py (root: apt; else the test says so)
# Two workers, one test file each at a time (a file's module fixtures stay in one process): much of the suite waits
# on kernels, servers and rank start-up, so two files share 2 cores well.
# --durations: the slowest tests, for keeping the suite near CI's ~12 min (scripts/bench.py --suite keeps them)
exec .venv/bin/python -m pytest -q -rs -n 2 --dist loadfile --no-loadscope-reorder --durations=25 tests "$@"
