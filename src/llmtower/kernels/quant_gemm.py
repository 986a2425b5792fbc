"""Python side of the block-quantized products (``quant_gemm.c``): ``BlockWeight`` owns a
matrix in one of GGUF's block formats (the file's bytes as they are) and multiplies float rows
by it, or gives its exact float32 values.

The activations of a call are quantized to int8 once per form (``quantize_activations``): per
32 values for Q4_0 / Q4_1 / Q8_0 (``quant_gemm.c``), per 256 for the K formats
(``quant_gemm_k.c``), each on first use, so a caller with several matrices over the same rows
(q, k and v of mixed formats) pays for each form once.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np
import torch

from llmtower.kernels.ops import kernel_library

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int

# ggml type id -> name, for the formats the kernel reads.
BLOCK_FORMATS = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
# Those in super-blocks of 256, multiplied against activations quantized per 256 values.
K_FORMATS = frozenset({12, 13, 14})
# Those of them whose activations come in the nibble order (Q4_K, Q5_K: quant_gemm_k.c kq_pos).
NIBBLE_ORDER = frozenset({12, 13})


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = kernel_library()
    lib.quant_block_values.argtypes = lib.quant_block_bytes.argtypes = [_INT]
    lib.quant_block_values.restype = lib.quant_block_bytes.restype = _I64
    lib.quant_dequant.argtypes = [_INT, _P, _I64, _I64, _I64, _P, _P, _INT]
    lib.quant_dequant.restype = _INT
    lib.quant_dequant_bf16.argtypes = [_INT, _P, _I64, _I64, _I64, _P, _P, _INT]
    lib.quant_dequant_bf16.restype = _INT
    lib.quant_act.argtypes = [_P, _I64, _I64, _I64, _P, _P, _P, _P]
    lib.quant_act.restype = None
    lib.quant_gemm.argtypes = [_INT, _P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _I64,
                               _INT, _INT]
    lib.quant_gemm.restype = _INT
    lib.quant_act_k.argtypes = [_P, _I64, _I64, _I64, _P, _P, _P, _INT]
    lib.quant_act_k.restype = None
    lib.quant_gemm_k.argtypes = [_INT, _P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _I64, _INT,
                                 _INT]
    lib.quant_gemm_k.restype = _INT
    return lib


def block_shape(fmt: int) -> tuple[int, int]:
    """(values, bytes) of one block of ggml type ``fmt``; ValueError for other formats."""
    lib = _lib()
    values = int(lib.quant_block_values(fmt))
    if values == 0:
        raise ValueError(f"ggml type {fmt} has no block kernel (those: "
                         f"{', '.join(BLOCK_FORMATS.values())})")
    return values, int(lib.quant_block_bytes(fmt))


@dataclass
class Int8Blocks32:
    """Owns rows quantized to int8 per 32 values (``quant_act``): the values ``qa``, scales
    ``da``, scaled sums ``fa`` and the negated half-block sums ``ns`` ``quant_gemm`` starts
    from."""

    qa: torch.Tensor
    da: torch.Tensor
    fa: torch.Tensor
    ns: torch.Tensor


@dataclass
class Int8Blocks256:
    """Owns rows quantized to int8 per 256 values (``quant_act_k``): the values ``qa``, one
    scale ``da`` per 256 and the sums ``bs`` of each 16 values (int16); with
    ``nibble_order`` each 256's 32-value sub-blocks stored as Q4_K / Q5_K read them (0 2 1 3
    4 6 5 7)."""

    qa: torch.Tensor
    da: torch.Tensor
    bs: torch.Tensor
    nibble_order: bool = False


class QuantizedActivations:
    """Owns float rows x [M, K] and their int8 forms, each made on first use: ``per32()`` for
    the 32-value formats, ``per256(nibble_order)`` for the K formats (Q4_K / Q5_K in the
    nibble order, Q6_K in the values' own)."""

    def __init__(self, x: torch.Tensor) -> None:
        if x.dtype != torch.float32:
            x = x.float()
        if x.stride(-1) != 1:
            x = x.contiguous()
        self.m, self.k = x.shape
        if self.k % 32:
            raise ValueError(f"block-quantized products need K in multiples of 32, not {self.k}")
        self.x = x
        self._per32: Int8Blocks32 | None = None
        self._per256: dict[bool, Int8Blocks256] = {}

    def per32(self) -> Int8Blocks32:
        if self._per32 is None:
            m, k, nb = self.m, self.k, self.k // 32
            f = Int8Blocks32(torch.empty(m * k, dtype=torch.int8),
                             torch.empty(m * nb, dtype=torch.float32),
                             torch.empty(m * nb, dtype=torch.float32),
                             torch.empty(m * nb * 8, dtype=torch.int32))
            _lib().quant_act(self.x.data_ptr(), m, k, self.x.stride(0), f.qa.data_ptr(),
                             f.da.data_ptr(), f.fa.data_ptr(), f.ns.data_ptr())
            self._per32 = f
        return self._per32

    def per256(self, nibble_order: bool = False) -> Int8Blocks256:
        f = self._per256.get(nibble_order)
        if f is None:
            m, k = self.m, self.k
            if k % 256:
                raise ValueError(f"K-format products need K in multiples of 256, not {k}")
            f = Int8Blocks256(torch.empty(m * k, dtype=torch.int8),
                              torch.empty(m * (k // 256), dtype=torch.float32),
                              torch.empty(m * (k // 16), dtype=torch.int16), nibble_order)
            _lib().quant_act_k(self.x.data_ptr(), m, k, self.x.stride(0), f.qa.data_ptr(),
                               f.da.data_ptr(), f.bs.data_ptr(), int(nibble_order))
            self._per256[nibble_order] = f
        return f


def quantize_activations(x: torch.Tensor) -> QuantizedActivations:
    """float rows [M, K] (K a multiple of 32) -> their int8 forms (made on first use)."""
    return QuantizedActivations(x)


class BlockWeight:
    """Owns one matrix [N, K] in ggml block format ``fmt``: ``data`` holds its rows' bytes
    (uint8, N * row_bytes, any buffer that stays alive: a file mapping or our own copy).
    ``path=1`` runs the portable C code (tests compare the two)."""

    def __init__(self, fmt: int, data: torch.Tensor, n: int, k: int, path: int = 0) -> None:
        values, nbytes = block_shape(fmt)
        if k % values:
            raise ValueError(f"a {BLOCK_FORMATS[fmt]} matrix needs K in multiples of {values}, "
                             f"not {k}")
        self.fmt, self.n, self.k, self.path = fmt, n, k, path
        self.row_bytes = k // values * nbytes
        if data.dtype != torch.uint8 or data.numel() != n * self.row_bytes \
                or not data.is_contiguous():
            raise ValueError(f"{BLOCK_FORMATS[fmt]} [{n}, {k}] takes {n * self.row_bytes} "
                             f"contiguous bytes, not {data.numel()} {data.dtype}")
        self.data = data
        self._lib = _lib()

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        return self.n * self.row_bytes

    def rows(self, start: int, end: int) -> BlockWeight:
        """Rows ``start:end`` of this matrix, over the same bytes (no copy)."""
        if not 0 <= start <= end <= self.n:
            raise IndexError(f"rows {start}:{end} of a matrix of {self.n} rows")
        data = self.data[start * self.row_bytes:end * self.row_bytes]
        return BlockWeight(self.fmt, data, end - start, self.k, self.path)

    def matmul_into(self, act: QuantizedActivations, out: torch.Tensor, threads: int) -> None:
        """``out[:, :N] = x @ W.T`` in float32 (out: [M, >= N] float32, unit column stride)."""
        if act.k != self.k:
            raise ValueError(f"rows of {act.k} values cannot multiply a [{self.n}, {self.k}] "
                             "matrix")
        if self.fmt in K_FORMATS:
            f = act.per256(self.fmt in NIBBLE_ORDER)
            rc = self._lib.quant_gemm_k(self.fmt, self.data.data_ptr(), self.row_bytes, self.n,
                                        self.k, act.m, f.qa.data_ptr(), f.da.data_ptr(),
                                        f.bs.data_ptr(), out.data_ptr(), out.stride(0), threads,
                                        self.path)
        else:
            g = act.per32()
            rc = self._lib.quant_gemm(self.fmt, self.data.data_ptr(), self.row_bytes, self.n,
                                      self.k, act.m, g.qa.data_ptr(), g.da.data_ptr(),
                                      g.fa.data_ptr(), g.ns.data_ptr(), out.data_ptr(),
                                      out.stride(0), threads, self.path)
        if rc:
            raise RuntimeError(f"quant_gemm refused format {self.fmt} [{self.n}, {self.k}]")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """float32 ``x @ W.T`` of rows x [M, K]."""
        out = torch.empty(x.shape[0], self.n, dtype=torch.float32)
        self.matmul_into(quantize_activations(x), out, torch.get_num_threads())
        return out

    def dequantize(self, rows: torch.Tensor | None = None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """float32 values of the matrix (or of ``rows``, int64 indices), exactly as gguf's
        reference dequantization gives them; with ``dtype=torch.bfloat16``, those values
        rounded to bfloat16 (without a float32 copy of the whole)."""
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dequantize gives float32 or bfloat16, not {dtype}")
        idx = None if rows is None else rows.to(torch.int64).contiguous()
        count = self.n if idx is None else int(idx.numel())
        if idx is not None and count and (int(idx.min()) < 0 or int(idx.max()) >= self.n):
            raise IndexError(f"row index out of range for a matrix of {self.n} rows")
        out = torch.empty(count, self.k, dtype=dtype)
        fn = self._lib.quant_dequant if dtype == torch.float32 else self._lib.quant_dequant_bf16
        rc = fn(self.fmt, self.data.data_ptr(), self.row_bytes, count, self.k,
                None if idx is None else idx.data_ptr(), out.data_ptr(), torch.get_num_threads())
        if rc == -2:
            raise MemoryError(f"quant_dequant_bf16: no memory for a row of {self.k} floats")
        if rc:
            raise RuntimeError(f"quant_dequant refused format {self.fmt}")
        return out


def from_numpy(fmt: int, data: np.ndarray, n: int, k: int, path: int = 0) -> BlockWeight:
    """A ``BlockWeight`` over a numpy byte array (e.g. a gguf reader's view), without a copy."""
    return BlockWeight(fmt, torch.from_numpy(np.ascontiguousarray(data).reshape(-1)), n, k, path)
