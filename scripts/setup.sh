#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install everything into it:
# torch 2.13.0 (CPU build) pinned first, then gnncompile with its dev and PyG extras.
# Usage: scripts/setup.sh            (idempotent; re-installs the project when pyproject changes)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${GNNCOMPILE_VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.gnncompile-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/setup.sh -nt "$stamp" ]; then
  "$VENV/bin/python" -m pip install --quiet --upgrade pip setuptools wheel
  "$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
  "$VENV/bin/python" -m pip install --quiet -e ".[dev,pyg]"
  touch "$stamp"
fi
