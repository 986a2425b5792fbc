#!/bin/bash
# `llmtower serve` against `vllm serve` (vLLM 0.32's CPU build, its OpenAI server module), each
# at its defaults on SmolLM2, with one client for both: `llmtower bench serve` (vLLM's
# `bench serve` metrics and definitions), 64 random prompts of 128 tokens in / 64 out, EOS
# ignored, at an infinite rate (all at once) and at 2 req/s. Servers run one after another on
# a quiet machine; prints each run's output throughput, mean / p99 TTFT and mean TPOT.
#   ANCHORS_VENV  vLLM's CPU venv (built by ../shared/anchors; never a dependency of ours)
#   MODEL         SmolLM2's float32 Hugging Face folder (default: benchmarks/smollm2_f32_dir.sh writes it once)
#   ENGINES       which servers: "llmtower llmtower-bf16 vllm" (default)
# At their defaults vLLM serves this float32 folder in bfloat16 (its CPU default), llmtower
# in float32 (token-exact against transformers); llmtower-bf16 adds `--dtype bfloat16`.
set -euo pipefail
cd "$(dirname "$0")/.."
ANCHORS_VENV=${ANCHORS_VENV:-$HOME/anchors/venv}
MODEL=${MODEL:-$(benchmarks/smollm2_f32_dir.sh)}
ENGINES=${ENGINES:-llmtower llmtower-bf16 vllm}
PORT=${PORT:-18555}
LOG=$(mktemp -d)
trap 'kill -- -$SERVER_PID 2>/dev/null || true; rm -rf "$LOG"' EXIT
SERVER_PID=0

start() {  # engine
  case $1 in
    llmtower) setsid .venv/bin/llmtower serve --model "$MODEL" --port "$PORT" >"$LOG/$1.log" 2>&1 &;;
    llmtower-bf16) setsid .venv/bin/llmtower serve --model "$MODEL" --port "$PORT" --dtype bfloat16 \
                     >"$LOG/$1.log" 2>&1 &;;
    vllm) setsid "$ANCHORS_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL" \
            --port "$PORT" >"$LOG/$1.log" 2>&1 &;;
    *) echo "unknown engine $1: give llmtower, llmtower-bf16 or vllm" >&2; exit 2;;
  esac
  SERVER_PID=$!
  for _ in $(seq 600); do
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; then return 0; fi
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then tail -20 "$LOG/$1.log"; exit 1; fi
    sleep 1
  done
  echo "$1 did not start" >&2; exit 1
}

for engine in $ENGINES; do
  start "$engine"
  for rate in inf 2; do
    echo "=== $engine rate $rate $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
    .venv/bin/llmtower bench serve --port "$PORT" --model "$MODEL" --tokenizer "$MODEL" \
      --dataset-name random --random-input-len 128 --random-output-len 64 --num-prompts 64 \
      --request-rate "$rate" --ignore-eos --disable-tqdm 2>&1 \
      | grep -E "Output token throughput|Mean TTFT|P99 TTFT|Mean TPOT|Successful requests"
  done
  kill -- -"$SERVER_PID" 2>/dev/null || true
  wait "$SERVER_PID" 2>/dev/null || true
  SERVER_PID=0
done
