#!/usr/bin/env bash
# Set up the kit in ./.venv (idempotent): CPU torch first, then DeepSpeed built against it, then the kit.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
# pip runs only when the pins (constraints.txt, the one place they are), the requirements or this script changed
# since the last setup of this venv (the kit itself is an editable install: its code needs none); a fresh clone
# always installs.
STAMP=.venv/.gradkit-setup
WANT=$(cat pyproject.toml setup.py constraints.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  python -m pip install -q --upgrade pip setuptools wheel
  # The CPU wheel of torch 2.13.0 (on this machine's disk); any GPU torch the user already has is kept.
  python -c "import torch" 2>/dev/null || python -m pip install -q -c constraints.txt torch
  # deepspeed ships as an sdist whose build imports torch: build it against the torch above. The kit itself is the
  # editable install of `gradkit` (the folder kit/), with every extra, at the releases of constraints.txt.
  DS_BUILD_OPS=0 python -m pip install -q --no-build-isolation -c constraints.txt -e ".[notebooks,dask,dev]"
  echo "$WANT" > "$STAMP"
fi
bash scripts/nbstripout_filter.sh "$PWD/.venv/bin/python"  # outputs JupyterLab autosaves never reach a commit
python -m ipykernel install --sys-prefix --name gradkit --display-name "Python (gradkit)" >/dev/null
python -c "import torch, deepspeed, transformers, gradkit; print(f'gradkit {gradkit.__version__} ready: torch {torch.__version__}, deepspeed {deepspeed.__version__}, transformers {transformers.__version__}')"
