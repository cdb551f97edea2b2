#!/usr/bin/env bash
# Notebooks are committed without outputs: nbstripout, the Jupyter ecosystem's git filter, cleans every .ipynb as
# git stages it, so what JupyterLab autosaves (outputs, execution counts, widget state) never reaches a commit or
# `git diff` (`git status` may still list a notebook whose size changed until it is added: nothing is staged).
# Cell ids are kept (JupyterLab's own). scripts/setup.sh runs this in the clone.
#   bash scripts/nbstripout_filter.sh [PYTHON]      # run inside the git clone to filter
set -euo pipefail
PY=${1:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}
if ! git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  echo "not inside a git clone: no notebook filter to install"
  exit 0
fi
"$PY" -m nbstripout --install --python "$PY"
git config filter.nbstripout.clean "\"$PY\" -m nbstripout --keep-id"
git config diff.ipynb.textconv "\"$PY\" -m nbstripout --keep-id -t"
