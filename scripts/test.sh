#!/usr/bin/env bash
# Set up, then run the test suite (real 2-rank CPU worlds included).
#   bash scripts/test.sh                  # the whole suite: what CI runs
#   bash scripts/test.sh --changed [BASE] # the inner loop: only the tests that reach what changed since BASE (default
#                                         # HEAD: the uncommitted changes), by the test map (scripts/testmap.py)
#   bash scripts/test.sh --map            # the suite under coverage: builds that map (runs/testmap/map.json)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--changed" ]; then
  shift
  base=HEAD
  if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then base=$1; shift; fi
  [ -x .venv/bin/python ] || bash scripts/setup.sh
  mapfile -t picked < <(.venv/bin/python scripts/testmap.py changed "$base")
  [ ${#picked[@]} -gt 0 ] || { echo "no test reaches what changed since $base: nothing to run"; exit 0; }
  files=$(printf '%s\n' "${picked[@]}" | cut -d: -f1 | sort -u | wc -l)
  workers=(); [ "$files" -gt 1 ] && workers=(-n 2 --dist loadfile)
  exec .venv/bin/python -m pytest -q -rs "${workers[@]}" "${picked[@]}" "$@"
fi
bash scripts/setup.sh
if [ "${1:-}" = "--map" ]; then shift; exec .venv/bin/python scripts/testmap_build.py build "$@"; fi
bash scripts/browser.sh  # Debian's chromium + driver for tests/test_browser.py (root: apt; else the test says so)
# Two workers, one test file each at a time (a file's module fixtures stay in one process): much of the suite waits
# on kernels, servers and rank start-up, so two files share 2 cores well.
# --durations: the slowest tests, for keeping the suite near CI's ~12 min (scripts/bench.py --suite keeps them)
exec .venv/bin/python -m pytest -q -rs -n 2 --dist loadfile --no-loadscope-reorder --durations=25 tests "$@"
