#!/bin/bash
# The issue-28 table: SmolLM2's output tok/s, one stream and 64 prompts, float32 and bfloat16,
# with the kernels built per instruction-set level (LLMTOWER_CPU_ISA) and PyTorch capped to
# match: "v3" emulates an AVX2-only CPU (oneDNN and ATen capped at AVX2, kernels for
# x86-64-v3), "native" is this CPU. Same prompts and harness as vs_vllm.sh
# (../shared/anchors/bench_offline.py); vLLM's AVX2 build runs beside it under the same caps
# where ANCHORS_VENV has one. bfloat16 where the engine refuses it at start prints "refused".
#   LEVELS  the levels to run (default: "v3 native"; v2 and v4 also work)
#   CELLS   the cells (default: "one-f32 many-f32 one-bf16 many-bf16")
#   MODEL, ANCHORS_VENV  as in vs_vllm.sh; HARNESS the harness (../shared/anchors/bench_offline.py)
#   RUNS_ONE / RUNS_MANY  timed runs per cell (3 / 2); PY the python (.venv/bin/python)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
ANCHORS_VENV=${ANCHORS_VENV:-$HOME/anchors/venv}
MODEL=${MODEL:-$(ls -d "$HOME"/.cache/llmtower/smollm2-135m-instruct-* | head -1)}
HARNESS=${HARNESS:-../shared/anchors/bench_offline.py}
B="--seed 0 --threads 2 --max-foreign 1.0 --idle-timeout 1"
ONE="--num-prompts 1 --min-input 144 --max-input 144 --output-len 128 --runs ${RUNS_ONE:-3}"
MANY="--num-prompts 64 --min-input 32 --max-input 256 --output-len 128 --runs ${RUNS_MANY:-2}"
caps() {  # level -> the environment that builds and caps for it
  case $1 in
    v2) echo "LLMTOWER_CPU_ISA=v2 ONEDNN_MAX_CPU_ISA=SSE41 ATEN_CPU_CAPABILITY=default";;
    v3) echo "LLMTOWER_CPU_ISA=v3 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2";;
    v4) echo "LLMTOWER_CPU_ISA=v4 ONEDNN_MAX_CPU_ISA=AVX512_CORE ATEN_CPU_CAPABILITY=avx512";;
    native) echo "LLMTOWER_CPU_ISA=native";;
    *) echo "unknown level $1: give v2, v3, v4 or native" >&2; exit 2;;
  esac
}
tok_s() { sed -n 's/^RESULT .*"output_tok_s": \([0-9.]*\).*/\1/p' | tail -1; }
for level in ${LEVELS:-v3 native}; do
  for cell in ${CELLS:-one-f32 many-f32 one-bf16 many-bf16}; do
    case $cell in
      one-f32) dtype=float32 shape=$ONE;; many-f32) dtype=float32 shape=$MANY;;
      one-bf16) dtype=bfloat16 shape=$ONE;; many-bf16) dtype=bfloat16 shape=$MANY;;
      *) echo "unknown cell $cell" >&2; exit 2;;
    esac
    # shellcheck disable=SC2046,SC2086
    out=$(env $(caps "$level") nice -n "${NICE:-0}" "$PY" "$HARNESS" --engine llmtower \
          --model "$MODEL" $B --dtype $dtype $shape 2>&1)
    ours=$(echo "$out" | tok_s)
    [ -z "$ours" ] && ours=$(echo "$out" | grep -q "is refused on this CPU" && echo refused \
                             || echo "failed: $(echo "$out" | tail -1)")
    theirs=-
    if [ -x "$ANCHORS_VENV/bin/python" ]; then
      # shellcheck disable=SC2046,SC2086
      theirs=$(env $(caps "$level") "$ANCHORS_VENV/bin/python" "$HARNESS" --engine vllm \
               --vllm-mode inproc --omp-bind 0-1 --model "$MODEL" $B --dtype $dtype $shape \
               2>&1 | tok_s)
    fi
    echo "level=$level cell=$cell llmtower_tok_s=$ours vllm_tok_s=${theirs:-failed}" \
         "load=$(cut -d' ' -f1-3 /proc/loadavg)"
  done
done
