"""A GGUF file's RoPE scaling as the Hugging Face rope parameters llmtower applies
(``models/layers/rotary.py``).

llama.cpp's converter stores scaling two ways:

- Llama 3.1+ (``rope_type`` llama3): a ``rope_freqs.weight`` tensor of head_dim / 2 factors,
  one per rotary frequency, each dividing that frequency (llama.cpp rotates by
  ``position * base^(-2i/d) / rope_freqs[i]``). The llama3 parameters themselves are not
  written, so the factors are kept as they are: transformers' ``longrope`` with the same
  factors short and long and an attention factor of 1 is that rotation.
- linear and YaRN: ``<arch>.rope.scaling.type`` with ``.factor``, ``.original_context_length``
  and the ``yarn_*`` keys, which the converter wrote from the Hugging Face ``rope_scaling`` and
  which map back onto it key for key. Without a type llama.cpp reads a factor as linear.

What has no Hugging Face counterpart (factors combined with a scaling type, Phi-3's
``longrope`` factor tensors, llama.cpp-only knobs set away from their neutral values) is refused
by name rather than served with a different rotation.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from gguf import GGUFReader

from llmtower.models.gguf_dequant import dequantize

# Tensors of a GGUF that configure the model rather than hold weights.
ROPE_FREQS = "rope_freqs.weight"
CONFIG_TENSORS = frozenset({ROPE_FREQS})
_PHI3_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def shortest_float(value: float) -> float:
    # GGUF stores float32: give back 1.1, not 1.100000023841858, as config.json had it.
    return float(str(np.float32(value)))


def _rope_freqs(reader: GGUFReader) -> list[float] | None:
    t = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if t is None:
        return None
    return [shortest_float(f) for f in dequantize(t.data, t.tensor_type).reshape(-1).tolist()]


def gguf_rope_scaling(reader: GGUFReader, field: Callable[[str, Any], Any], arch: str,
                      context_length: int) -> dict[str, Any] | None:
    """The Hugging Face ``rope_scaling`` of the GGUF (None: plain RoPE); ``field(key, default)``
    reads a metadata value (``gguf_loader.field_value``)."""

    def key(name: str, default: Any = None) -> Any:
        return field(f"{arch}.rope.{name}", default)

    names = {t.name for t in reader.tensors}
    if any(n in names for n in _PHI3_FACTORS):
        raise ValueError("this GGUF holds LongRoPE factor tensors (rope_factors_long / "
                         "rope_factors_short, Phi-3 128k), which llmtower does not serve")
    freqs = _rope_freqs(reader)
    factor = key("scaling.factor", None)
    if factor is None:
        factor = key("scale_linear", None)  # the key's older name
    kind = key("scaling.type", None)
    if kind is None:  # as llama.cpp: a factor without a type is linear
        kind = "linear"
    if kind == "linear" and factor in (None, 0.0, 1.0):
        kind = "none"
    attn_factor = key("scaling.attn_factor", 1.0)
    if attn_factor != 1.0:
        raise ValueError(f"{arch}.rope.scaling.attn_factor={attn_factor} (a scale on cos/sin "
                         "beside the scaling type) is not supported")
    if freqs is not None and kind != "none":
        raise ValueError(f"this GGUF combines rope_freqs with {arch}.rope.scaling.type={kind!r}, "
                         "which has no Hugging Face counterpart: llmtower reads one or the other")
    if kind == "none":
        if freqs is None:
            return None
        return {"rope_type": "longrope", "short_factor": freqs, "long_factor": list(freqs),
                "factor": 1.0, "attention_factor": 1.0,
                "original_max_position_embeddings": context_length}
    if kind == "linear":
        return {"rope_type": "linear", "factor": shortest_float(factor)}
    if kind == "yarn":
        return _yarn(arch, key, factor, context_length)
    raise ValueError(f"{arch}.rope.scaling.type={kind!r} is not supported: llmtower reads none, "
                     "linear and yarn (and llama3's rope_freqs tensor)")


def _yarn(arch: str, key: Callable[..., Any], factor: float | None, context_length: int) -> dict[str, Any]:
    if not factor:
        raise ValueError(f"yarn rope scaling lacks {arch}.rope.scaling.factor")
    ext = key("scaling.yarn_ext_factor", None)
    if ext is not None and ext != 1.0:
        raise ValueError(f"{arch}.rope.scaling.yarn_ext_factor={ext} is not supported: transformers' "
                         "YaRN always extrapolates fully (1.0)")
    log_mul = key("scaling.yarn_log_multiplier", 0.0)
    if log_mul:
        raise ValueError(f"{arch}.rope.scaling.yarn_log_multiplier={log_mul} (DeepSeek's "
                         "mscale_all_dim) is not supported")
    out: dict[str, Any] = {"rope_type": "yarn", "factor": shortest_float(factor),
                           "original_max_position_embeddings":
                               int(key("scaling.original_context_length", context_length))}
    for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                             ("yarn_attn_factor", "attention_factor")):
        value = key(f"scaling.{gguf_key}", None)
        if value is not None:
            out[hf_key] = shortest_float(value)
    return out
