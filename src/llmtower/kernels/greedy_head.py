"""Python side of the greedy output layer (``greedy_head.c``): ``GreedyHead`` picks each
sampled row's argmax token by screening an int8 copy of the output layer and computing exactly
only the rows that could win.

A greedy step with no logprobs, penalties or grammar needs the argmax of the logits, nothing
else. The output layer is the largest matrix a decode step reads (SmolLM2: 56.6 of 274 MB in
bfloat16, 113 of 540 MB in float32); the screen reads 28.3 MB instead, plus the candidates'
tiles of the layer's own packed weights. The token is bit for bit the one the full logits give
(ties: the first index), because the candidates' logits come from the same packed weights and
the same summation code as the full layer's, and every other row is proven below them
(``greedy_head.c`` derives the bound). ``LLMTOWER_GREEDY_HEAD=0`` turns it off (read by
``ops.capabilities()``, kernel ``greedy_head``).
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from llmtower.kernels.ops import kernel_library
from llmtower.kernels.gemm_f32 import GemmF32Weight
from llmtower.kernels.gemv_bf16 import GemvWeight
from llmtower.kernels.huge_pages import empty_streamed

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int

TILE = 64  # output rows per tile of the int8 copy (greedy_head.c)
# Most candidates a row may leave to exact computation (``GreedyHead.cap``); past it the full
# layer decides the row (measured on SmolLM2: 1 candidate at the median, 481 at most over
# 1,024 rows).
CANDIDATE_CAP = 2048
# Most rows a bfloat16 screen takes: past ~48 the bfloat16 GEMM's dot products keep level with
# the screen's int16 ones (benchmarks/greedy_head.py: 1.62x at 1 row, 1.22x at 16, 0.99x at
# 64), while float32's FMAs fall behind at every size (1.77x at 64, 1.88x at 128).
BF16_MAX_ROWS = 32
# Rows of the weight quantized at a time at load (float64 work space: 4096 x K x 8 bytes).
_LOAD_CHUNK = 4096


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = kernel_library()
    lib.greedy_head_max_rows.restype = _INT
    lib.greedy_head_tokens.argtypes = [_P, _I64, _I64, _INT, _P, _P, _P, _I64, _I64, _P, _P, _P,
                                       _I64, _P, _P, _P, _I64, _INT, _INT]
    lib.greedy_head_tokens.restype = _INT
    return lib


def max_rows() -> int:
    """Most sampled rows one call takes (a decode step's, up to the products' kernels')."""
    return int(_lib().greedy_head_max_rows())


class GreedyHead:
    """Owns the output layer's int8 screen: its packed int8 copy, three float32 bound constants
    per vocabulary row, and the scratch of a call; reads (never owns) the layer's own packed
    weights ``kernel`` for the candidates' exact logits. ``path=1`` screens with portable C
    (the same integer sums; tests compare them)."""

    def __init__(self, weight: torch.Tensor, kernel: GemvWeight | GemmF32Weight,
                 path: int = 0) -> None:
        bf16 = isinstance(kernel, GemvWeight)
        want = torch.bfloat16 if bf16 else torch.float32
        if weight.dim() != 2 or weight.dtype != want or tuple(weight.shape) != (kernel.n, kernel.k):
            raise ValueError(f"greedy head: the weight must be {want} [{kernel.n}, {kernel.k}] "
                             f"like its kernel copy, not {weight.dtype} {tuple(weight.shape)}")
        if kernel.path != 0 or kernel.silu_pair:
            raise ValueError("greedy head: the kernel copy must be a single matrix on the fast "
                             "path (its sums are the ones repeated here)")
        self.n, self.k = kernel.n, kernel.k
        self.bf16 = bf16
        self.kernel = kernel
        self.path = path
        self._lib = _lib()
        q, self.consts = _quantize(weight, 2 * ((self.k + 1) // 2))
        self.packed = _tiles(q)
        self.max_rows = min(max_rows(), BF16_MAX_ROWS) if bf16 else max_rows()
        # A call's scratch, grown to the most rows seen: each row's upper bounds (as many
        # bytes as its float32 logits would take), candidates and their exact logits.
        self.cap = CANDIDATE_CAP
        self._rows, self._cap = 0, 0
        self._upper = torch.empty(0, dtype=torch.float32)
        self.cand = torch.empty(0, dtype=torch.int64)
        self.cand_val = torch.empty(0, dtype=torch.float32)
        self.num_cand = torch.zeros(0, dtype=torch.int64)
        self._tokens = torch.empty(0, dtype=torch.int64)

    def tokens(self, x: torch.Tensor, allow: np.ndarray | None = None) -> np.ndarray:
        """x [m, K] (the final norm's rows, the kernel's dtype, unit column stride) -> int64
        [m]: each row's greedy token, or -1 where the full output layer must decide (h not
        finite, no token allowed, or more than ``cap`` candidates). ``allow``: int32 [m,
        ceil(V / 32)], each row's grammar bitmask (xgrammar's: bit v set where token v is
        allowed; -1 words for a row without a grammar), or None."""
        m = x.shape[0] if x.dim() == 2 else 0
        if x.dtype != (torch.bfloat16 if self.bf16 else torch.float32) or x.dim() != 2 \
                or x.shape[1] != self.k or x.stride(1) != 1 or not 1 <= m <= self.max_rows:
            raise ValueError(f"greedy head: x must be {'bfloat16' if self.bf16 else 'float32'} "
                             f"[1..{self.max_rows}, {self.k}] with unit column stride, not "
                             f"{x.dtype} {tuple(x.shape)}")
        if m > self._rows or self.cap != self._cap:
            self._rows, self._cap = max(m, self._rows), max(1, self.cap)
            self._upper = torch.empty(self._rows * self.n, dtype=torch.float32)
            self.cand = torch.empty(self._rows * self._cap, dtype=torch.int64)
            self.cand_val = torch.empty(self._rows * self._cap, dtype=torch.float32)
            self.num_cand = torch.zeros(self._rows, dtype=torch.int64)
            self._tokens = torch.empty(self._rows, dtype=torch.int64)
        words = -(-self.n // 32)
        if allow is not None and (allow.dtype != np.int32 or allow.shape != (m, words)
                                  or not allow.flags.c_contiguous):
            raise ValueError(f"greedy head: the token bitmask must be contiguous int32 "
                             f"[{m}, {words}], not {allow.dtype} {allow.shape}")
        stride = x.stride(0) if m > 1 else self.k
        rc = self._lib.greedy_head_tokens(
            x.data_ptr(), m, stride, int(self.bf16), self.packed.data_ptr(),
            self.consts.data_ptr(), self.kernel.packed.data_ptr(), self.n, self.k,
            self._upper.data_ptr(), self.cand.data_ptr(), self.cand_val.data_ptr(),
            self._cap, self.num_cand.data_ptr(), self._tokens.data_ptr(),
            None if allow is None else allow.ctypes.data, words, torch.get_num_threads(),
            self.path)
        if rc == -1:
            raise MemoryError("greedy head: could not allocate the quantized rows")
        if rc != 0:
            raise ValueError("greedy head: the kernel refused its sizes")
        return self._tokens.numpy()[:m].copy()

    def candidates(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        """The last call's candidates of ``row`` (vocabulary ids, ascending) and their exact
        logits (tests compare them with the full layer's)."""
        nc = int(self.num_cand[row])
        base = row * self._cap
        return (self.cand.numpy()[base:base + nc].copy(),
                self.cand_val.numpy()[base:base + nc].copy())


def _tiles(q: torch.Tensor) -> torch.Tensor:
    """int8 q [V, K] in the screen's layout (gemv_bf16's): tile t of 64 rows, input pair p,
    then the 64 rows' two inputs, zero past V and K; on huge pages where they are on."""
    n, k = q.shape
    tiles, pairs = -(-n // TILE), -(-k // 2)
    padded = torch.zeros(tiles * TILE, pairs * 2, dtype=torch.int8)
    padded[:n, :k] = q
    out = empty_streamed(padded.numel(), torch.int8)
    out.view(tiles, pairs, TILE, 2).copy_(padded.view(tiles, TILE, pairs, 2).transpose(1, 2))
    return out


def _quantize(weight: torch.Tensor, k_sums: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W [V, K] -> (q int8 [V, K], consts float32 [3, V rounded up to 64]): per row
    s = max|w| / 127 (float32),
    q = round(w / s), and the bound's constants |e| + gamma |w| and s |q| (e = w - s q; gamma
    the relative error of a float32 sum of ``k_sums`` terms), computed in float64 and rounded
    up."""
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("greedy head: the output layer holds inf or NaN")
    n, k = weight.shape
    u = 2.0 ** -24
    gamma = k_sums * u / (1 - k_sums * u)
    widen = 1 + 2.0 ** -20  # covers rounding the float64 results to float32
    q = torch.empty(n, k, dtype=torch.int8)
    consts = torch.zeros(3, -(-n // 64) * 64, dtype=torch.float32)  # zero past n
    for i in range(0, n, _LOAD_CHUNK):
        j = min(n, i + _LOAD_CHUNK)
        w = weight[i:j].double()
        s = (w.abs().amax(dim=1).float() / 127).double()
        qi = torch.where(s[:, None] > 0, torch.round(w / s.clamp_min(1e-300)[:, None]),
                         torch.zeros_like(w)).clamp_(-127, 127)
        e = w - qi * s[:, None]
        q[i:j] = qi.to(torch.int8)
        consts[0, i:j] = s.float()
        consts[1, i:j] = ((e.norm(dim=1) + gamma * w.norm(dim=1)) * widen).float()
        consts[2, i:j] = (s * qi.norm(dim=1) * widen).float()
    return q, consts
