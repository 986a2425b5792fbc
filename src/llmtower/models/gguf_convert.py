"""Describe a GGUF file as a Hugging Face model directory.

``write_gguf_model_dir`` (what llmtower serves from) writes config.json,
generation_config.json, tokenizer.json and tokenizer_config.json from the GGUF's metadata, and
``gguf_source.json`` naming the file: the weights stay in the GGUF and are read from it at load
(``models/gguf_weights.py``), so no float copy of them is written.

``convert_gguf_to_hf_dir`` also writes model.safetensors (float32, dequantized), for tools that
need a complete Hugging Face directory (transformers, other engines):

    python -m llmtower.models.gguf_convert MODEL.gguf OUT_DIR
"""
from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

import torch
from gguf import GGUFReader

from llmtower.models.config import ModelConfig
from llmtower.models.gguf_loader import field_value, gguf_model_config, open_gguf
from llmtower.models.gguf_weights import gguf_float_state_dict, write_gguf_source
from llmtower.models.gguf_tokenizer import write_gguf_tokenizer

# Bump when the output of the conversion changes, so cached directories are rebuilt.
# 2: weights read from the GGUF itself (gguf_source.json), no model.safetensors.
# 3: RoPE scaling read from the GGUF (a directory cached before took a bare
#    rope.scaling.factor for plain RoPE); SentencePiece vocabularies.
CONVERTER_VERSION = 3


def write_gguf_model_dir(gguf_path: str | Path, out_dir: str | Path) -> None:
    """Config, tokenizer and the GGUF's location into the (existing, empty) ``out_dir``."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = open_gguf(gguf_path)
    _write_metadata(reader, gguf_model_config(reader), gguf_path, out_dir)
    write_gguf_source(out_dir, gguf_path)


def convert_gguf_to_hf_dir(gguf_path: str | Path, out_dir: str | Path) -> None:
    """Convert ``gguf_path`` into a complete float32 Hugging Face directory ``out_dir``
    (existing, empty)."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = open_gguf(gguf_path)
    config = gguf_model_config(reader)
    state = gguf_float_state_dict(gguf_path, config, torch.float32)
    _write_metadata(reader, config, gguf_path, out_dir)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def _write_metadata(reader: GGUFReader, config: ModelConfig, gguf_path: Path,
                    out_dir: Path) -> None:

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
    write_gguf_tokenizer(reader, out_dir)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3:
        sys.exit("usage: python -m llmtower.models.gguf_convert MODEL.gguf OUT_DIR")
    Path(sys.argv[2]).mkdir(parents=True, exist_ok=False)
    convert_gguf_to_hf_dir(sys.argv[1], sys.argv[2])
