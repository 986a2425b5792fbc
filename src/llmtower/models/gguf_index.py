"""A GGUF file's tensor table (names, shapes, types, byte offsets), read without gguf's reader.

gguf.GGUFReader builds a numpy view for every metadata value: on a 49,152-token vocabulary
that is ~250,000 memmap slices, 5-6 s of CPU per open (measured on SmolLM2's GGUF), paid again
by every caller. Loading weights needs only the tensor table, so this walks the metadata by
lengths alone (struct over the header bytes) and reads the table after it.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
# GGUF value type -> its fixed size in bytes (8: string, 9: array are walked).
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """Owns one tensor's entry: ``shape`` in numpy order (rows first), ggml ``qtype``, and
    ``offset``/``nbytes`` of its data in the file."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int
    nbytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1


def _skip_value(buf: memoryview, at: int, vtype: int) -> tuple[int, object]:
    """Offset past one value of ``vtype`` at ``at``, and the value where it is a scalar the
    caller may want (general.alignment)."""
    if vtype == _STRING:
        (n,) = struct.unpack_from("<Q", buf, at)
        return at + 8 + n, None
    if vtype == _ARRAY:
        sub, count = struct.unpack_from("<IQ", buf, at)
        at += 12
        if sub == _STRING:
            for _ in range(count):
                (n,) = struct.unpack_from("<Q", buf, at)
                at += 8 + n
            return at, None
        if sub == _ARRAY:
            for _ in range(count):
                at, _v = _skip_value(buf, at, _ARRAY)
            return at, None
        return at + _SIZES[sub] * count, None
    size = _SIZES[vtype]
    value = int.from_bytes(bytes(buf[at:at + size]), "little") if vtype in (4, 10) else None
    return at + size, value


def read_tensor_index(path: str | Path) -> list[TensorInfo]:
    """The tensor table of GGUF file ``path``; ValueError for a file that is not GGUF v2/v3."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        buf = memoryview(mm)
        try:
            if bytes(buf[:4]) != _MAGIC:
                raise ValueError(f"{path} is not a GGUF file (bad magic)")
            version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
            if version not in (2, 3):
                raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
            at = 24
            alignment = 32
            for _ in range(n_kv):
                (klen,) = struct.unpack_from("<Q", buf, at)
                key = bytes(buf[at + 8:at + 8 + klen]).decode("utf-8")
                at += 8 + klen
                (vtype,) = struct.unpack_from("<I", buf, at)
                at, value = _skip_value(buf, at + 4, vtype)
                if key == "general.alignment" and isinstance(value, int):
                    alignment = value
            raw: list[tuple[str, tuple[int, ...], int, int]] = []
            for _ in range(n_tensors):
                (nlen,) = struct.unpack_from("<Q", buf, at)
                name = bytes(buf[at + 8:at + 8 + nlen]).decode("utf-8")
                at += 8 + nlen
                (ndim,) = struct.unpack_from("<I", buf, at)
                dims = struct.unpack_from(f"<{ndim}Q", buf, at + 4)
                qtype, rel = struct.unpack_from("<IQ", buf, at + 4 + 8 * ndim)
                at += 4 + 8 * ndim + 12
                raw.append((name, tuple(int(d) for d in reversed(dims)), qtype, rel))
            data_start = -(-at // alignment) * alignment
        except struct.error as e:
            raise ValueError(f"{path} is not a readable GGUF file: {e}") from e
        finally:
            buf.release()
    out = []
    for name, shape, qtype, rel in raw:
        qt = GGMLQuantizationType(qtype)
        values, nbytes = GGML_QUANT_SIZES[qt]
        numel = int(np.prod(shape)) if shape else 1
        out.append(TensorInfo(name, shape, qt, data_start + rel, numel // values * nbytes))
    return out


def tensor_data(mm: np.ndarray, t: TensorInfo) -> np.ndarray:
    """``t``'s data in a uint8 map of the whole file: typed for float tensors, else
    [rows, row bytes] (what gguf's dequantize takes)."""
    raw = mm[t.offset:t.offset + t.nbytes]
    if t.qtype == GGMLQuantizationType.F32:
        return raw.view(np.float32).reshape(t.shape)
    if t.qtype == GGMLQuantizationType.F16:
        return raw.view(np.float16).reshape(t.shape)
    rows = int(np.prod(t.shape[:-1])) if len(t.shape) > 1 else 1
    return raw.reshape(rows, t.nbytes // rows)
