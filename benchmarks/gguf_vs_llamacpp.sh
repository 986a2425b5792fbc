#!/usr/bin/env bash
# llmtower vs llama.cpp on the same GGUF files (issue 26's table): peak RSS and end-to-end
# output tok/s, one stream (144-token prompt + 64 tokens) and 16 prompts, for each file given.
#
#   ANCHORS=$HOME/anchors bash benchmarks/gguf_vs_llamacpp.sh [FILE.gguf ...]
#
# Default files: $ANCHORS/models/llama-1b-{q4_0,q4_k_m}.gguf (make_1b.py + llama.cpp's
# convert_hf_to_gguf.py + llama-quantize, ../shared/anchors/README.md). llama.cpp's
# llama-batched-bench is taken from $LLAMA_CPP (default $ANCHORS/llama.cpp/build/bin) and
# skipped when it is not built. Each cell runs in a fresh process (its own peak RSS, from
# /usr/bin/time for llama.cpp, VmHWM for llmtower), 2 threads. llama.cpp's end-to-end
# output tok/s is B x TG / T of its table, prefill included as in ours. The load average
# is printed with each row: compare ratios from one run. $LLAMA_CPP_ARGS adds flags to
# llama.cpp's command (e.g. "-nr": without weight repacking, where its AMX path crashes, as
# on a GGML_NATIVE build on this development VM). $REPEAT (default 1) runs the whole table
# that many times, the two engines interleaved cell by cell (a busy machine's load moves:
# each ratio compares runs seconds apart), then prints each cell's ratios and their median.
# $PROMPTS (default "1 16") the prompt counts of the rows. An AVX2-only CPU (issue 28): export
# ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 LLMTOWER_CPU_ISA=v3 and point LLAMA_CPP at a
# llama.cpp built with -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
# -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF (docs/performance.md, "GGUF block weights on AVX2").
set -euo pipefail
ANCHORS=${ANCHORS:-$HOME/anchors}
LLAMA_CPP=${LLAMA_CPP:-$ANCHORS/llama.cpp/build/bin}
THREADS=${THREADS:-2}
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}

files=("$@")
if [ ${#files[@]} -eq 0 ]; then
  for f in "$ANCHORS/models/llama-1b-q4_0.gguf" "$ANCHORS/models/llama-1b-q4_k_m.gguf"; do
    [ -f "$f" ] && files+=("$f")
  done
fi
if [ ${#files[@]} -eq 0 ]; then
  echo "no GGUF files: pass them as arguments or build $ANCHORS/models/llama-1b-*.gguf" >&2
  exit 1
fi

bench_ours() {  # file n_prompts -> "tok_s peak_gb"
  "$PY" benchmarks/gguf_offline.py --model "$1" --num-prompts "$2" --input 144 --output 64 \
    --threads "$THREADS" --quantization gguf --runs "${RUNS:-2}" 2>/dev/null | tail -1 |
    "$PY" -c 'import json,sys; d=json.loads(sys.stdin.read()); print(d["tok_s"], d["peak_rss_gb"])'
}

bench_llamacpp() {  # file n_prompts -> "tok_s peak_gb"
  local out
  out=$(LD_LIBRARY_PATH=$LLAMA_CPP /usr/bin/time -v "$LLAMA_CPP/llama-batched-bench" -m "$1" \
        -npp 144 -ntg 64 -npl "$2" -t "$THREADS" -no-kvu -c $((208 * $2 + 64)) ${LLAMA_CPP_ARGS:-} 2>&1)
  echo "$out" | "$PY" -c '
import re, sys
text = sys.stdin.read()
rows = [l for l in text.splitlines() if re.match(r"\|\s*144\s*\|", l)]
cols = [c.strip() for c in rows[-1].strip("|").split("|")]  # PP TG B N_KV T_PP S_PP T_TG S_TG T S
tg, b, t = int(cols[1]), int(cols[2]), float(cols[8])
rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1))
print(round(b * tg / t, 2), round(rss * 1024 / 1e9, 3))'
}

REPEAT=${REPEAT:-1}
declare -A ratios
printf '%-28s %-8s %-22s %-22s %-6s %s\n' "file (size)" "prompts" "llmtower tok/s, RSS" \
  "llama.cpp tok/s, RSS" "ratio" "load"
for ((rep = 0; rep < REPEAT; rep++)); do
for f in "${files[@]}"; do
  size=$(du -h "$f" | cut -f1)
  for n in ${PROMPTS:-1 16}; do
    read -r ours_t ours_r < <(bench_ours "$f" "$n")
    if [ -x "$LLAMA_CPP/llama-batched-bench" ]; then
      read -r cpp_t cpp_r < <(bench_llamacpp "$f" "$n")
      ratio=$("$PY" -c "print(f'{$ours_t / $cpp_t:.2f}x')")
      ratios["$(basename "$f") $n"]+="${ratio%x} "
      cpp="$cpp_t, ${cpp_r} GB"
    else
      cpp="(not built)"; ratio="-"
    fi
    printf '%-28s %-8s %-22s %-22s %-6s %s\n' "$(basename "$f") ($size)" "$n" \
      "$ours_t, ${ours_r} GB" "$cpp" "$ratio" "$(cut -d' ' -f1 /proc/loadavg)"
  done
done
done
if [ "$REPEAT" -gt 1 ]; then
  echo
  for cell in "${!ratios[@]}"; do
    echo "$cell: ratios ${ratios[$cell]}-> median $("$PY" -c "import statistics, sys; \
print(f'{statistics.median(map(float, sys.argv[1:])):.2f}x')" ${ratios[$cell]})"
  done | sort
fi
