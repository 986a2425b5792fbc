"""Load a model's weights for ``--quantization none | int8 | int4 | gguf``.

- ``none``: the float weights in the model's dtype (a GGUF is dequantized, as always).
- ``int8`` / ``int4``: the float32 weights; the model quantizes its linear layers on load
  (int8 per output channel; int4 in groups of 32 with a scale and a minimum, as GGUF's Q4_1).
- ``gguf``: the GGUF file's own blocks, kept in their formats and read from the file by the
  model (``gguf_weights.gguf_block_state_dict``, ``quant_block``).
"""
from __future__ import annotations

from pathlib import Path

import torch

from llmtower.models.default_model import default_gguf_path, is_default_model_name
from llmtower.models.gguf_weights import gguf_block_state_dict
from llmtower.models.loader import load_model_config, load_state_dict
from llmtower.models.quant import QUANTIZATION_METHODS, QuantizedTensor
from llmtower.models.quant_block import GGUFMatrix


def resolve_gguf_path(model: str | Path | None) -> Path:
    """The GGUF file behind ``--model`` (the default model's, or a .gguf path)."""
    if model is None or (isinstance(model, str) and is_default_model_name(model)):
        return default_gguf_path()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    raise ValueError(f"--quantization gguf keeps a GGUF file's quantized weights, but the model "
                     f"{str(model)!r} is not a .gguf file: pass a .gguf model, or use "
                     "--quantization int8 or int4 to quantize a Hugging Face model on load")


def load_model_weights(model: str | Path | None, path: Path, dtype: torch.dtype,
                       quantization: str
                       ) -> dict[str, torch.Tensor | QuantizedTensor | GGUFMatrix]:
    """The state dict ``LlamaForCausalLM(..., quantization=quantization)`` expects."""
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={quantization!r} is not one of "
                         f"{', '.join(QUANTIZATION_METHODS)}")
    if quantization == "gguf":
        gguf_path = resolve_gguf_path(model)
        return dict(gguf_block_state_dict(gguf_path, load_model_config(path)))
    # Quantizing from float32 keeps the rounding to the one step of the quantization.
    load_dtype = torch.float32 if quantization in ("int8", "int4") else dtype
    return dict(load_state_dict(path, load_dtype))
