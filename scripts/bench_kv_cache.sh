#!/usr/bin/env bash
# Long-context decode with each KV cache format: fiberserve (--kv-cache-dtype auto, q8_0, fp8_e4m3) and
# llama-server (f16, then -ctk/-ctv q8_0), one server at a time on the same GGUF file.  Each level is closed-loop
# forced completions of PROMPT_WORDS random words (about as many tokens), 64 greedy tokens streamed; the tables go
# to OUT.  At one client TPOT is the long-context decode speed; with several, each one's TPOT also holds the other
# requests' prefill chunks (fiberserve bench depth measures decode alone).
# Usage: bash scripts/bench_kv_cache.sh [model.gguf] [concurrency levels...]   (default: the embedded model, 1)
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-$(.venv/bin/python -c 'from fiberserve.config import default_cache_dir as d; from fiberserve.model.assets import default_model_path as p; print(p(d()))')}
shift || true
LEVELS=${*:-1}
PROMPT_WORDS=${PROMPT_WORDS:-4000}
SLOTS=16
CONTEXT=$((SLOTS * (PROMPT_WORDS + 400)))
OUT=${OUT:-bench-results/kv-cache/$(basename "$MODEL" .gguf)}
PORT=18100
LLAMA_SERVER=$(ls -d "${HOME}"/.cache/fiberserve/peers/llama.cpp-*/build/bin/llama-server 2>/dev/null | tail -1 || true)
mkdir -p "$OUT"

wait_ready() {
    for _ in $(seq 1200); do
        curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return 0
        sleep 0.5
    done
    echo "server not ready" >&2
    return 1
}

load() {  # name, extra bench flags
    .venv/bin/fiberserve bench run --url "http://127.0.0.1:$PORT" --concurrency $LEVELS --requests-per-client 1 \
        --requests 3 --prompt-words "$PROMPT_WORDS" --output-len 64 --stream "${@:2}" \
        --markdown "$OUT/$1.md" --json "$OUT/$1.json" | tee "$OUT/$1.txt"
}

run_server() {  # name, command...
    local name=$1
    shift
    "$@" >"$OUT/$name.log" 2>&1 &
    local pid=$!
    wait_ready
    grep -h "KV cache:" "$OUT/$name.log" || true
    if [[ $name == llama* ]]; then load "$name" --fresh-connections; else load "$name"; fi
    kill -INT $pid
    wait $pid || true
}

for format in auto q8_0 fp8_e4m3; do
    run_server "fiberserve-$format" .venv/bin/fiberserve serve --model "$MODEL" --port $PORT \
        --kv-cache-dtype $format --kv-cache-mb 2400 --max-model-len $((PROMPT_WORDS + 400)) --no-progress
done
if [[ -n $LLAMA_SERVER ]]; then
    common=(-m "$MODEL" --host 127.0.0.1 --port $PORT -t "$(nproc)" -np $SLOTS -c $CONTEXT -fa on)
    run_server llama-server-f16 "$LLAMA_SERVER" "${common[@]}"
    run_server llama-server-q8_0 "$LLAMA_SERVER" "${common[@]}" -ctk q8_0 -ctv q8_0
else
    echo "llama-server is not installed (scripts/peers/build_llama_server.sh): skipped" | tee "$OUT/llama-server.txt"
fi
