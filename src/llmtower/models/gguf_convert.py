"""Write a GGUF file out as a Hugging Face model directory (float32, dequantized).

The directory holds config.json, generation_config.json, model.safetensors, tokenizer.json and
tokenizer_config.json, so llmtower and transformers load it alike.
"""
from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from llmtower.models.gguf_loader import field_value, gguf_model_config, gguf_state_dict, open_gguf
from llmtower.models.gguf_tokenizer import write_gguf_tokenizer

# Bump when the output of the conversion changes, so cached directories are rebuilt.
CONVERTER_VERSION = 1


def convert_gguf_to_hf_dir(gguf_path: str | Path, out_dir: str | Path) -> None:
    """Convert ``gguf_path`` into the (existing, empty) directory ``out_dir``."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = open_gguf(gguf_path)
    config = gguf_model_config(reader)
    state = gguf_state_dict(reader, config)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)

    hf_config = config.to_hf_dict()
    pad_id = field_value(reader, "tokenizer.ggml.padding_token_id", None)
    hf_config["pad_token_id"] = pad_id
    hf_config["llmtower_converted_from"] = {"gguf": gguf_path.name, "converter_version": CONVERTER_VERSION}
    _write_json(out_dir / "config.json", hf_config)
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_ids[0] if len(config.eos_token_ids) == 1 else config.eos_token_ids,
        "pad_token_id": pad_id,
    })
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    write_gguf_tokenizer(reader, out_dir)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
