#!/usr/bin/env bash
# Set up, then execute every notebook on CPU (2 ranks) with papermill; prints where the results are.
#   bash scripts/run_all.sh                                   # default parameters (scripts/params/default.yaml)
#   bash scripts/run_all.sh --params scripts/params/quick.yaml
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
args=("$@")
[[ " $* " == *" --params "* ]] || args=(--params scripts/params/default.yaml "${args[@]}")
exec .venv/bin/python -m gradkit.notebooks.runall "${args[@]}"
