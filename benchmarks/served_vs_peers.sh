#!/bin/bash
# The issue-32 table for the current code: `llmtower serve` at its defaults and with
# --dtype bfloat16, then llama.cpp's llama-server and vLLM's OpenAI server where they are
# built (skipped, saying so, where not), each alone and one after another, with one client
# (`llmtower bench serve`: random 128-token prompts, 64 out, EOS ignored, 64 requests):
# rate inf cold / warm, 2 req/s; then the engine's offline throughput on prompts of the same
# shape and the served/offline ratio; then ratios to the issue's recorded peer figures.
#   LLAMA_SERVER  llama-server binary (default: $ANCHORS/llama.cpp/build/bin/llama-server)
#   LLAMA_GGUF    SmolLM2 as a BF16 GGUF (default: the first $ANCHORS/models/*mol*bf16*.gguf)
#   ANCHORS_VENV  vLLM's CPU venv (default: $ANCHORS/venv)
#   MODEL         SmolLM2's float32 folder for vLLM (default: benchmarks/smollm2_f32_dir.sh's)
#   NUM_PROMPTS   requests per run (default 64); SERVE_ARGS  more flags for llmtower
# Peers are built as in ../shared/anchors/README.md. Run on a quiet machine: the figures
# of one run are compared with each other, as ratios.
set -euo pipefail
cd "$(dirname "$0")/.."
ANCHORS=${ANCHORS:-$HOME/anchors}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=$(command -v python3)
LLAMA_SERVER=${LLAMA_SERVER:-$ANCHORS/llama.cpp/build/bin/llama-server}
LLAMA_GGUF=${LLAMA_GGUF:-$(ls "$ANCHORS"/models/*[Ss]mol*[Bb][Ff]16*.gguf 2>/dev/null | head -1 || true)}
ANCHORS_VENV=${ANCHORS_VENV:-$ANCHORS/venv}
MODEL=${MODEL:-$(benchmarks/smollm2_f32_dir.sh)}
echo "=== $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) CPUs"
PYTHONPATH=${LLMTOWER_SRC:-$PWD/src} exec "$PY" benchmarks/served_vs_peers.py \
  --num-prompts "${NUM_PROMPTS:-64}" --llama-server "$LLAMA_SERVER" --llama-gguf "${LLAMA_GGUF:-}" \
  --vllm-python "$ANCHORS_VENV/bin/python" --hf-model "${MODEL:-}" --serve-args "${SERVE_ARGS:-}"
