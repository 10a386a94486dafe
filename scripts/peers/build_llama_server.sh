#!/usr/bin/env bash
# Build llama.cpp's C++ llama-server from the sources inside the llama-cpp-python sdist on PyPI.
# Release, native CPU, server target only, no web UI, no curl. ~4 minutes on 2 cores; cached afterwards.
# Result: $CACHE/peers/llama.cpp-<version>/build/bin/llama-server
#
# Without ggml's AMX backend: on an Intel Xeon with AMX, 0.3.36's llama-server built with GCC 12 dies on its first
# matrix product (SIGILL/SIGSEGV on ldtilecfg: GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes of
# the tile configuration, so the rest of the configuration built on the stack may never be stored; see
# ggml-org/llama.cpp#20824 and PR #26954).  -mno-amx-* keeps the AVX512-VNNI kernels, as on a CPU without AMX.
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${FIBERSERVE_CACHE:-$HOME/.cache/fiberserve}"
DEST="$CACHE/peers/llama.cpp-$VERSION"
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# shellcheck disable=SC2086
if ! c++ $NO_AMX -x c++ -E - < /dev/null > /dev/null 2>&1; then NO_AMX=""; fi  # a compiler without the flags
FLAGS="native; $NO_AMX"
if [ -x "$DEST/build/bin/llama-server" ] && [ "$(cat "$DEST/build/fiberserve-flags" 2>/dev/null)" = "$FLAGS" ]; then
  echo "$DEST/build/bin/llama-server"
  exit 0
fi
mkdir -p "$CACHE/peers"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --no-deps --no-binary :all: -d "$tmp" "llama-cpp-python==$VERSION"
tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
rm -rf "$DEST"
mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$DEST"
cmake -S "$DEST" -B "$DEST/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_SERVER_WEBUI=OFF
cmake --build "$DEST/build" --target llama-server -j "$(nproc)"
echo "$FLAGS" > "$DEST/build/fiberserve-flags"
echo "$DEST/build/bin/llama-server"
