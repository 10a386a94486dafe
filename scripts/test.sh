#!/usr/bin/env bash
# Install fiberserve with its test dependencies into ./.venv and run the whole suite.
# Usage: bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first, and pinned to the CPU build that lies on this kind of machine:
# an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0" "setuptools>=77" "ninja>=1.11"
# The install compiles the kernels (setup.py) against the torch above: no isolated build environment
# (that would install torch a second time).
.venv/bin/python -m pip install -q --no-build-isolation -e ".[test]"
# xgrammar for constrained decoding, without its requirements: they pull in triton, a GPU compiler unused here.
.venv/bin/python -m pip install -q --no-deps "xgrammar>=0.1.21" "apache-tvm-ffi>=0.1.11"
# The SGLang frontend, installed lightly: its own dependencies are the server's, not the client's.
.venv/bin/python -m pip install -q --no-deps "sglang==0.5.10"
# Debian's chromium for the chat page's test in a real browser (Playwright drives it and downloads no browser).
if ! command -v chromium >/dev/null; then
    as_root=$([ "$(id -u)" -eq 0 ] || echo sudo)
    $as_root apt-get update -q && DEBIAN_FRONTEND=noninteractive $as_root apt-get install -y -q chromium
fi
.venv/bin/ruff check fiberserve tests setup.py
.venv/bin/ruff format --check fiberserve tests setup.py
.venv/bin/mypy
# pytest exits 5 when it collects nothing: that must fail, and it does under set -e.
.venv/bin/python -m pytest -q "$@"
# On a CPU with AVX-512 the suite above ran the AVX-512 kernels; test the AVX2 build too (the kernels and the
# model's math on them), as a CPU without AVX-512 runs it.
if [ $# -eq 0 ] && grep -qw avx512f /proc/cpuinfo; then
    FIBERSERVE_KERNEL_VARIANT=avx2 .venv/bin/python -m pytest -q tests/unit/test_kernels.py tests/unit/test_kv_format.py \
        tests/unit/test_model_math.py tests/unit/test_lora.py
fi
