"""Read a GGUF's weights without dequantizing the linear layers (``--quantization gguf``).

Q4_0 and Q4_1 tensors become int4 ``QuantizedTensor``s with groups of 32, bit for bit the same
integers, scales and minimums as the file's blocks; Q8_0 linear weights become int8 with one scale
per row (torch has no per-block int8 kernel). Everything else (norms, float tensors, other
block types, and the token embeddings, which are looked up row by row) is dequantized to float
as ``gguf_loader.gguf_state_dict`` does. Like there, llama.cpp's q/k row permutation is undone:
on the integers and their per-row scales alike.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader

from llmtower.models.config import ModelConfig
from llmtower.models.gguf_dequant import _blocks, dequantize
from llmtower.models.gguf_loader import _gguf_arch, hf_tensor_name, unpermute_qk
from llmtower.models.gguf_rope import CONFIG_TENSORS
from llmtower.models.quant import INT4_GROUP, QuantizedTensor, quantize_int8

_Q = GGMLQuantizationType
KEPT_QUANTIZED = (_Q.Q4_0, _Q.Q4_1, _Q.Q8_0)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)[:, 0]


def _int4(data: np.ndarray, has_min: bool) -> QuantizedTensor:
    """Q4_0 (18-byte blocks: f16 d, 16 bytes of nibbles) or Q4_1 (20 bytes: f16 d, f16 m, ...)."""
    block_bytes = 20 if has_min else 18
    blocks, shape = _blocks(data, block_bytes)
    n, k = shape
    d = _f16(blocks, 0)
    qs = blocks[:, block_bytes - 16:]
    # Byte j holds value j in its low nibble and value j + 16 in its high nibble.
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).reshape(n, k)
    # Q4_0: d * (q - 8) -> zero 0; Q4_1: d * q + m = d * (q - 8) + (m + 8 d).
    zero = _f16(blocks, 2) + 8.0 * d if has_min else np.zeros_like(d)
    g = k // INT4_GROUP
    return QuantizedTensor("int4", torch.from_numpy(np.ascontiguousarray(q)),
                           torch.from_numpy(d.reshape(n, g)), torch.from_numpy(zero.reshape(n, g)),
                           INT4_GROUP)


def quantized_tensor(data: np.ndarray, qtype: GGMLQuantizationType) -> QuantizedTensor:
    """GGUFReader data of a Q4_0, Q4_1 or Q8_0 matrix -> a ``QuantizedTensor``."""
    if qtype == _Q.Q4_0:
        return _int4(data, has_min=False)
    if qtype == _Q.Q4_1:
        return _int4(data, has_min=True)
    if qtype == _Q.Q8_0:
        return quantize_int8(torch.from_numpy(np.ascontiguousarray(dequantize(data, qtype))))
    raise ValueError(f"GGUF type {qtype.name} is not kept quantized: only "
                     f"{', '.join(t.name for t in KEPT_QUANTIZED)}")


def gguf_quantized_state_dict(reader: GGUFReader, config: ModelConfig
                              ) -> dict[str, torch.Tensor | QuantizedTensor]:
    """Every tensor of the GGUF under its Hugging Face name: the linear layers' Q4_0 / Q4_1 /
    Q8_0 weights as ``QuantizedTensor``, the rest as float32 tensors."""
    _, info = _gguf_arch(reader)
    state: dict[str, torch.Tensor | QuantizedTensor] = {}
    for t in reader.tensors:
        if t.name in CONFIG_TENSORS:
            continue
        name = hf_tensor_name(t.name)
        heads = None
        if info["permuted_qk"] and ".self_attn.q_proj." in name:
            heads = config.num_attention_heads
        elif info["permuted_qk"] and ".self_attn.k_proj." in name:
            heads = config.num_key_value_heads
        if t.tensor_type in KEPT_QUANTIZED and name.startswith("model.layers.") \
                and name.endswith("_proj.weight"):
            qt = quantized_tensor(t.data, t.tensor_type)
            if heads is not None:
                order = unpermute_qk(np.arange(qt.shape[0]), heads)
                qt = qt.rows(torch.from_numpy(np.ascontiguousarray(order)))
            state[name] = qt
            continue
        w = dequantize(t.data, t.tensor_type)
        if heads is not None:
            w = unpermute_qk(w, heads)
        state[name] = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
    embed = state.get("model.embed_tokens.weight")
    if not isinstance(embed, torch.Tensor) or embed.shape[0] != config.vocab_size:
        raise ValueError(f"token_embd does not match the tokenizer's {config.vocab_size} tokens")
    return state
