#!/usr/bin/env bash
# Set up the kit in ./.venv (idempotent): CPU torch first, then DeepSpeed built against it, then the kit.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
# pip runs only when the pins or this script changed since the last setup of this venv (the kit itself is an
# editable install: its code needs none); a fresh clone always installs.
STAMP=.venv/.gradkit-setup
WANT=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  python -m pip install -q --upgrade pip setuptools wheel
  # The CPU wheel of torch 2.13.0 (on this machine's disk); any GPU torch the user already has is kept.
  python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
  # deepspeed ships as an sdist whose build imports torch: build it against the torch above.
  DS_BUILD_OPS=0 python -m pip install -q --no-build-isolation -e .
  echo "$WANT" > "$STAMP"
fi
bash scripts/nbstripout_filter.sh "$PWD/.venv/bin/python"  # outputs JupyterLab autosaves never reach a commit
python -m ipykernel install --sys-prefix --name gradkit --display-name "Python (gradkit)" >/dev/null
python -c "import torch, deepspeed, transformers, kit; print(f'gradkit ready: torch {torch.__version__}, deepspeed {deepspeed.__version__}, transformers {transformers.__version__}')"
