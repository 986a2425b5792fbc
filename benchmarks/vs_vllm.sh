#!/bin/bash
# llmtower against vLLM 0.32 on the same token-id prompts (../shared/anchors/bench_offline.py),
# engines alternating, each at `chrt -f 1`. Cells: many-bf16 one-bf16 many-f32 one-f32 (SmolLM2),
# w1-f32 (the harness's W1 model, 64 prompts, float32).
#   ANCHORS_VENV  vLLM's CPU venv (built by ../shared/anchors; never a dependency of ours)
#   MODEL         SmolLM2's float32 Hugging Face folder (default: benchmarks/smollm2_f32_dir.sh writes it once)
#   W1_MODEL      the W1 model folder (../shared/anchors/make_models.py)
set -euo pipefail
cd "$(dirname "$0")/.."
ANCHORS_VENV=${ANCHORS_VENV:-$HOME/anchors/venv}
MODEL=${MODEL:-$(benchmarks/smollm2_f32_dir.sh)}
W1_MODEL=${W1_MODEL:-$(dirname "$ANCHORS_VENV")/models/small-llama}
HARNESS=../shared/anchors/bench_offline.py
B="--seed 0 --threads 2 --max-foreign 1.0 --idle-timeout 1"
MANY="--num-prompts 64 --min-input 32 --max-input 256 --output-len 128 --runs 2"
ONE="--num-prompts 1 --min-input 144 --max-input 144 --output-len 128 --runs 3"
run() {  # label, dtype, shape args[, model folder]
  local model=${4:-$MODEL}
  echo "=== $1 $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  # shellcheck disable=SC2086
  chrt -f 1 .venv/bin/python "$HARNESS" --engine llmtower --model "$model" $B --dtype "$2" $3 2>&1 | tail -4
  # shellcheck disable=SC2086
  chrt -f 1 "$ANCHORS_VENV/bin/python" "$HARNESS" --engine vllm --vllm-mode inproc --omp-bind 0-1 \
    --model "$model" $B --dtype "$2" $3 2>&1 | tail -4
}
for cell in "${@:-many-bf16 one-bf16 many-f32 one-f32}"; do
  for what in $cell; do
    case $what in
      many-bf16) run many-bf16 bfloat16 "$MANY";;
      many-f32) run many-f32 float32 "$MANY";;
      one-bf16) run one-bf16 bfloat16 "$ONE";;
      one-f32) run one-f32 float32 "$ONE";;
      w1-f32) run w1-f32 float32 "$MANY" "$W1_MODEL";;
      *) echo "unknown cell $what: give many-bf16, one-bf16, many-f32, one-f32 or w1-f32" >&2
         exit 2;;
    esac
  done
done
