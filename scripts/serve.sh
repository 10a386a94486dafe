#!/usr/bin/env bash
# Install fiberserve into ./.venv and serve the embedded default model on 127.0.0.1:8000.
# Usage: bash scripts/serve.sh [fiberserve serve flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0" "setuptools>=77" "ninja>=1.11"
# The install compiles the kernels (setup.py) against the torch above: no isolated build environment
# (that would install torch a second time).
.venv/bin/python -m pip install -q --no-build-isolation -e .
# xgrammar for constrained decoding, without its requirements: they pull in triton, a GPU compiler unused here.
.venv/bin/python -m pip install -q --no-deps "xgrammar>=0.1.21" "apache-tvm-ffi>=0.1.11"
exec .venv/bin/fiberserve serve "$@"
