"""Turn GGUF tensor data (float or block-quantized bytes) into float32 numpy arrays.

gguf.quants.dequantize handles every ggml type when the installed gguf has it; the numpy block
decoders below cover the common types (Q4_0, Q4_1, Q8_0) for older gguf releases without it.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType

_gguf_dequantize: Callable[[np.ndarray, GGMLQuantizationType], np.ndarray] | None
try:
    from gguf.quants import dequantize as _gguf_dequantize
except ImportError:  # gguf releases before quants.dequantize
    _gguf_dequantize = None

_BLOCK = 32  # values per block in Q4_0, Q4_1 and Q8_0


def _blocks(data: np.ndarray, block_bytes: int) -> tuple[np.ndarray, tuple[int, ...]]:
    """(n_blocks, block_bytes) uint8 view of byte rows, and the float shape they decode to."""
    row_bytes = data.shape[-1]
    if row_bytes % block_bytes:
        raise ValueError(f"row of {row_bytes} bytes is not a whole number of {block_bytes}-byte blocks")
    shape = (*data.shape[:-1], row_bytes // block_bytes * _BLOCK)
    return np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, block_bytes), shape


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    # Byte j holds value j in its low nibble and value j + 16 in its high nibble.
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)


def dequantize_q8_0(data: np.ndarray) -> np.ndarray:
    """Q8_0 block (34 bytes): f16 scale d, then 32 int8 q; value = d * q."""
    blocks, shape = _blocks(data, 34)
    q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
    return (_half(blocks, 0) * q).reshape(shape)


def dequantize_q4_0(data: np.ndarray) -> np.ndarray:
    """Q4_0 block (18 bytes): f16 scale d, then 16 bytes of 4-bit q; value = d * (q - 8)."""
    blocks, shape = _blocks(data, 18)
    return (_half(blocks, 0) * (_nibbles(blocks[:, 2:]) - 8.0)).reshape(shape)


def dequantize_q4_1(data: np.ndarray) -> np.ndarray:
    """Q4_1 block (20 bytes): f16 scale d, f16 minimum m, 16 bytes of 4-bit q; value = d * q + m."""
    blocks, shape = _blocks(data, 20)
    return (_half(blocks, 0) * _nibbles(blocks[:, 4:]) + _half(blocks, 2)).reshape(shape)


NUMPY_DEQUANTIZERS = {
    GGMLQuantizationType.Q8_0: dequantize_q8_0,
    GGMLQuantizationType.Q4_0: dequantize_q4_0,
    GGMLQuantizationType.Q4_1: dequantize_q4_1,
}


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """GGUFReader tensor data of type ``qtype`` -> float32 array in numpy (row-major) shape."""
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.asarray(data).astype(np.float32)
    if _gguf_dequantize is not None:
        return np.asarray(_gguf_dequantize(data, qtype), dtype=np.float32)
    if qtype in NUMPY_DEQUANTIZERS:
        return NUMPY_DEQUANTIZERS[qtype](data)
    raise ValueError(f"GGUF tensor type {qtype.name} cannot be read with the installed gguf package: "
                     f"upgrade it (pip install -U gguf) or use a GGUF quantized as F32, F16, "
                     f"{', '.join(t.name for t in NUMPY_DEQUANTIZERS)}")
