#!/usr/bin/env bash
# Build llama.cpp's C++ llama-server from the sources inside the llama-cpp-python sdist on PyPI.
# Release, native CPU, server target only, no web UI, no curl. ~4 minutes on 2 cores; cached afterwards.
# Result: $CACHE/peers/llama.cpp-<version>/build/bin/llama-server
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${FIBERSERVE_CACHE:-$HOME/.cache/fiberserve}"
DEST="$CACHE/peers/llama.cpp-$VERSION"
if [ -x "$DEST/build/bin/llama-server" ]; then echo "$DEST/build/bin/llama-server"; exit 0; fi
mkdir -p "$CACHE/peers"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --no-deps --no-binary :all: -d "$tmp" "llama-cpp-python==$VERSION"
tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
rm -rf "$DEST"
mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$DEST"
cmake -S "$DEST" -B "$DEST/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_SERVER_WEBUI=OFF
cmake --build "$DEST/build" --target llama-server -j "$(nproc)"
echo "$DEST/build/bin/llama-server"
