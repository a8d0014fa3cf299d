#!/usr/bin/env bash
# Set up the development environment: a virtual environment in .venv with
# actormesh (editable), torch 2.13 (CPU) and the test tools. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -r requirements-dev.txt
# Workers start faster from compiled bytecode; some machines set
# PYTHONDONTWRITEBYTECODE, so compile once here.
.venv/bin/python -m compileall -q src >/dev/null
