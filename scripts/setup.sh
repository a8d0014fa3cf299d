#!/usr/bin/env bash
# Set up the development environment: a virtual environment in .venv with
# actormesh (editable), torch 2.13 (CPU) and the test tools. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -r requirements-dev.txt
# The dashboard's browser test drives Debian's headless chromium; install it when we can
# (root with apt-get, as in CI). Without it that test skips and says why.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
   && ! { command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; }; then
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver \
        || echo "setup.sh: could not install chromium; the dashboard browser test will skip" >&2
fi
# Workers start faster from compiled bytecode; some machines set
# PYTHONDONTWRITEBYTECODE, so compile once here.
.venv/bin/python -m compileall -q src >/dev/null
