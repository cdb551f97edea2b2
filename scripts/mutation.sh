#!/usr/bin/env bash
# Mutation testing of the judging code (issue 27), with cosmic-ray: each mutant is written into the source file in
# place, so the rank processes the tests start import it too; PYTHONDONTWRITEBYTECODE keeps a mutant out of
# __pycache__. Not part of the test command: its result is a benchmark (score, survivors, wall time).
#   bash scripts/mutation.sh                       # every module of scripts/mutation/targets.yaml
#   bash scripts/mutation.sh kit/judge/oracle.py         # one module (a session resumes where it stopped)
#   bash scripts/mutation.sh --fast --again kit/commands/sweep/grouping.py   # its survivors again, against the tests as they are now
#   bash scripts/mutation.sh --workers 2 kit/watch/core.py  # its mutants on two checkouts at once (one per core)
#   bash scripts/mutation.sh --readme [docs/tests.md]    # runs/mutation/summary.json as that page's table
# Writes runs/mutation/<module>.sqlite (the session) and runs/mutation/summary.json (score and survivors).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
.venv/bin/python -c "import cosmic_ray" 2>/dev/null || .venv/bin/python -m pip install -q -c constraints.txt cosmic-ray
export PYTHONDONTWRITEBYTECODE=1  # the kit cache: the machine's, as the suite's (tests/conftest.py)
[ "${1:-}" = "--readme" ] || git diff --quiet -- kit || {
  echo "error: kit/ has uncommitted changes; a mutation run rewrites its files in place" >&2; exit 2; }
exec .venv/bin/python scripts/mutation_run.py "$@"
