#!/bin/bash
# The issue-28 table: SmolLM2's output tok/s, one stream and 64 prompts, float32 and bfloat16,
# with the kernels built per instruction-set level (LLMTOWER_CPU_ISA) and PyTorch capped to
# match: "v3" emulates an AVX2-only CPU (oneDNN and ATen capped at AVX2, kernels for
# x86-64-v3), "native" is this CPU. Same prompts and harness as vs_vllm.sh
# (../shared/anchors/bench_offline.py); vLLM's AVX2 build runs beside it under the same caps
# where ANCHORS_VENV has one (below v4 told that the CPU has no AVX-512, so that it loads its AVX2
# build: each line names the vllm/_C*.so it mapped). bfloat16 where the engine refuses it at start
# prints "refused". The engines take turns cell by cell.
#   LEVELS  the levels to run (default: "v3 native"; v2 and v4 also work)
#   CELLS   the cells (default: "one-f32 many-f32 one-bf16 many-bf16")
#   MODEL, ANCHORS_VENV  as in vs_vllm.sh; HARNESS the harness (../shared/anchors/bench_offline.py)
#   RUNS_ONE / RUNS_MANY  timed runs per cell (3 / 2); PY the python (.venv/bin/python)
#   ROUNDS  times the whole table is run (1): on a shared machine, compare within a round
#   KV_GIB  each engine's KV cache (4; 2 holds the 64 prompts in float32 with room to spare)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
ANCHORS_VENV=${ANCHORS_VENV:-$HOME/anchors/venv}
# SmolLM2 in float32 (vLLM cannot read the GGUF): written once by smollm2_f32_dir.sh
MODEL=${MODEL:-$(PY=$PY benchmarks/smollm2_f32_dir.sh)}
HARNESS=${HARNESS:-../shared/anchors/bench_offline.py}
B="--seed 0 --threads 2 --max-foreign 1.0 --idle-timeout 1 --kv-gib ${KV_GIB:-4}"
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
# vLLM picks its kernel library by what the CPU has, not by ONEDNN_MAX_CPU_ISA: below v4 a
# sitecustomize.py (on PYTHONPATH for its runs only) reports no AVX-512 to it, so it loads its
# AVX2 build (_C_AVX2), and prints which vllm/_C*.so the process mapped (checked below).
SHIM=$(mktemp -d)
trap 'rm -rf "$SHIM"' EXIT
cat > "$SHIM/sitecustomize.py" <<'PY'
import atexit
import os
if os.environ.get("BENCH_NO_AVX512") == "1":
    import torch
    torch.cpu._is_avx512_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: False
@atexit.register
def _loaded():
    with open("/proc/self/maps") as f:
        libs = sorted({ln.split()[-1].rsplit("/", 1)[-1] for ln in f if "vllm/_C" in ln})
    print("VLLM_KERNELS", " ".join(libs) or "none", flush=True)
PY
shim() {  # level -> the environment of vLLM's runs
  case $1 in v2|v3) echo "PYTHONPATH=$SHIM BENCH_NO_AVX512=1";; *) echo "PYTHONPATH=$SHIM";; esac
}
for round in $(seq "${ROUNDS:-1}"); do
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
    theirs=- vlib=-
    if [ -x "$ANCHORS_VENV/bin/python" ]; then
      # shellcheck disable=SC2046,SC2086
      vout=$(env $(caps "$level") $(shim "$level") nice -n "${NICE:-0}" \
             "$ANCHORS_VENV/bin/python" "$HARNESS" --engine vllm --vllm-mode inproc \
             --omp-bind 0-1 --model "$MODEL" $B --dtype $dtype $shape 2>&1)
      theirs=$(echo "$vout" | tok_s)
      vlib=$(echo "$vout" | sed -n 's/^VLLM_KERNELS //p' | tail -1)
    fi
    echo "round=$round level=$level cell=$cell llmtower_tok_s=$ours vllm_tok_s=${theirs:-failed}" \
         "vllm_kernels=${vlib:-?} load=$(cut -d' ' -f1-3 /proc/loadavg)"
  done
done
done
