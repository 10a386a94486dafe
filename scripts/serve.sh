#!/usr/bin/env bash
# Install fiberserve into ./.venv and serve the embedded default model on 127.0.0.1:8000.
# Usage: bash scripts/serve.sh [fiberserve serve flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e .
exec .venv/bin/fiberserve serve "$@"
