"""Python side of the fused GGUF decode layer (``quant_layer.c``): ``QuantDecodeLayers`` owns
the C descriptions of a model's layers over block weights (``models/quant_block.py``) and one
step's buffers, and runs the work between two attentions (o projection, residual + norm, MLP,
residual + next norm, next qkv, RoPE + KV write) in one call and one OpenMP region per layer,
or whole layers attention included (``attend_and_layers``).

It offers the interface of ``decode_layer.DecodeLayers`` that ``models/llama.py``'s fused
forward reads (``begin_step``, ``layer``, ``attends``, ``attend_and_layers``), for float32
steps of at most ``BLOCK_KERNEL_MAX_ROWS`` rows whose products all take the block kernel. The
results are bit for bit those of the separate calls (same code, same order).
"""
from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llmtower.kernels import ops
from llmtower.kernels.decode_layer import _paged_decode_address
from llmtower.kernels.kv_pointers import KVPointers
from llmtower.kernels.quant_gemm import BlockWeight

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
PARTS = 4  # QL_PARTS: most block-format runs in one matrix
# Whether pure one-row decode steps run layers 1 .. L-2 whole in C, attention included;
# False: one call per layer after a Python attention (benchmarks compare).
WHOLE_LAYERS = True


class QuantMatrix(ctypes.Structure):
    """One matrix's block-format runs by address (quant_layer.c's QuantMatrix)."""

    _fields_ = [("w", _P * PARTS), ("row_bytes", _I64 * PARTS), ("n", _I64 * PARTS),
                ("fmt", ctypes.c_int * PARTS), ("nparts", _I64)]


class QuantLayerWeights(ctypes.Structure):
    """Layer i's o and MLP matrices with layer i + 1's norm and qkv."""

    _fields_ = [("o", QuantMatrix), ("gate_up", QuantMatrix), ("down", QuantMatrix),
                ("qkv", QuantMatrix), ("o_bias", _P), ("post_norm", _P), ("next_norm", _P),
                ("qkv_bias", _P)]


class QuantStep(ctypes.Structure):
    """What every layer of one step shares: shapes, rotary tables, indices, work buffers."""

    _fields_ = [("t", _I64), ("hidden", _I64), ("inter", _I64), ("nh", _I64), ("nkv", _I64),
                ("d", _I64), ("eps", ctypes.c_float), ("num_threads", ctypes.c_int),
                ("cos", _P), ("sin", _P), ("positions", _P), ("slots", _P)]
    _fields_ += [(n, _P) for n in ("x", "n", "g", "y", "qkv", "q_out", "qa", "da", "fa", "ns",
                                   "qa_k", "da_k", "bs_k", "qa_kn", "bs_kn")]


class QuantAttention(ctypes.Structure):
    """One step's decode attention for ``quant_layers``."""

    _fields_ = [("fn", _P), ("block_tables", _P), ("bt_stride", _I64), ("context_lens", _P),
                ("block_size", _I64), ("scale", ctypes.c_float), ("out", _P)]


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = ops.kernel_library()
    lib.quant_layer.argtypes = [_P, _P, _P, _P, _I64, _P, _P]
    lib.quant_layer.restype = ctypes.c_int
    lib.quant_layers.argtypes = [_P, _P, _P, _P, _P, _P, _I64, _I64]
    lib.quant_layers.restype = ctypes.c_int
    return lib


@dataclass
class QuantLayerParts:
    """The tensors of one layer pair: layer i's o projection, post norm and MLP (gate/up as
    one matrix, gate rows first), layer i + 1's input norm and qkv."""

    o: Sequence[BlockWeight]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: Sequence[BlockWeight]
    down: Sequence[BlockWeight]
    next_norm: torch.Tensor
    qkv: Sequence[BlockWeight]
    qkv_bias: torch.Tensor | None


def fits(hidden: int, intermediate: int, num_heads: int, head_dim: int) -> bool:
    """Whether the C layer takes these shapes (every k a multiple of 256, an even head_dim)."""
    return all(k % 256 == 0 for k in (hidden, intermediate, num_heads * head_dim)) \
        and head_dim % 2 == 0 and ops.capabilities().can_run("quant_gemm")


class QuantDecodeLayers:
    """Owns the C descriptions of a model's layer pairs over block weights and, per step, the
    work buffers and the ``QuantStep`` every call reads; ``layer`` runs one pair."""

    takes_lora = False
    whole_steps = False

    def __init__(self, layers: Sequence[QuantLayerParts], hidden: int, intermediate: int,
                 num_heads: int, num_kv_heads: int, head_dim: int, eps: float) -> None:
        if not fits(hidden, intermediate, num_heads, head_dim):
            raise ValueError("the fused GGUF decode layer cannot take these shapes here")
        lib = _lib()
        self._fn, self._layers_fn = lib.quant_layer, lib.quant_layers
        self.hidden, self.inter = hidden, intermediate
        self.nh, self.nkv, self.d = num_heads, num_kv_heads, head_dim
        self.qkv_n = (num_heads + 2 * num_kv_heads) * head_dim
        self.kmax = max(hidden, intermediate, num_heads * head_dim)
        self._keep = list(layers)
        n = len(self._keep)
        self._weights = (QuantLayerWeights * n)(*(self._describe(p) for p in layers))
        size = ctypes.sizeof(QuantLayerWeights)
        self._weight_ptrs = [ctypes.addressof(self._weights) + i * size for i in range(n)]
        self._attn = QuantAttention(fn=_paged_decode_address())
        self._attn_ptr = ctypes.addressof(self._attn)
        self._step = QuantStep(hidden=hidden, inter=intermediate, nh=num_heads,
                               nkv=num_kv_heads, d=head_dim, eps=eps)
        self._step_ptr = ctypes.addressof(self._step)
        self._bufs: tuple[torch.Tensor, ...] = ()
        self._q = self._v = self._out = torch.empty(0)
        self._kv = KVPointers(num_kv_heads, head_dim, torch.float32, "fused GGUF layers")

    def _matrix(self, parts: Sequence[BlockWeight], n: int, k: int) -> QuantMatrix:
        if not 1 <= len(parts) <= PARTS or sum(p.n for p in parts) != n \
                or any(p.k != k or p.path != 0 for p in parts):
            raise ValueError(f"fused GGUF layer: a matrix of {len(parts)} runs "
                             f"[{sum(p.n for p in parts)}, {parts[0].k if parts else 0}], "
                             f"expected [{n}, {k}] in 1 to {PARTS} runs")
        m = QuantMatrix(nparts=len(parts))
        for i, p in enumerate(parts):
            m.w[i], m.row_bytes[i], m.n[i], m.fmt[i] = p.data.data_ptr(), p.row_bytes, p.n, p.fmt
        return m

    def _describe(self, p: QuantLayerParts) -> QuantLayerWeights:
        h, i, qd = self.hidden, self.inter, self.nh * self.d
        for v, n in ((p.post_norm, h), (p.next_norm, h), (p.o_bias, h), (p.qkv_bias, self.qkv_n)):
            if v is not None and (v.dtype != torch.float32 or not v.is_contiguous()
                                  or v.numel() != n):
                raise ValueError(f"fused GGUF layer: norms and biases must be contiguous "
                                 f"float32 [{n}]")
        return QuantLayerWeights(
            self._matrix(p.o, h, qd), self._matrix(p.gate_up, 2 * i, h),
            self._matrix(p.down, h, i), self._matrix(p.qkv, self.qkv_n, h),
            _ptr(p.o_bias), p.post_norm.data_ptr(), p.next_norm.data_ptr(), _ptr(p.qkv_bias))

    def begin_step(self, t: int, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                   slots: torch.Tensor, lora: object | None = None) -> None:
        """Buffers and shared values of a step of ``t`` rows (positions and slots checked by
        the caller, as for ``FusedOps``; cos / sin: the float32 full-width rotary tables)."""
        if lora is not None:
            raise ValueError("fused GGUF layer: no LoRA hooks")
        if cos.dtype != torch.float32 or sin.dtype != torch.float32:
            raise TypeError("fused GGUF layer: the rotary tables must be float32")
        if t < 1:
            raise ValueError(f"fused GGUF layer: a step of {t} rows")
        s = self._step
        s.num_threads = torch.get_num_threads()
        s.positions, s.slots = positions.data_ptr(), slots.data_ptr()
        s.cos, s.sin = cos.data_ptr(), sin.data_ptr()
        self._tables = (cos, sin, positions, slots)
        if t == s.t:
            return  # the previous step's buffers (nothing outlives a step in them)
        f = functools.partial(torch.empty, dtype=torch.float32)
        km = t * self.kmax
        bufs = (f(t, self.hidden), f(t, self.hidden), f(t, 2 * self.inter), f(t, self.inter),
                f(t, self.qkv_n), f(t, self.nh, self.d), torch.empty(km, dtype=torch.int8),
                f(km // 32), f(km // 32), torch.empty(km // 4, dtype=torch.int32),
                torch.empty(km, dtype=torch.int8), f(km // 256),
                torch.empty(km // 16, dtype=torch.int16), torch.empty(km, dtype=torch.int8),
                torch.empty(km // 16, dtype=torch.int16))
        self._bufs = bufs
        (s.x, s.n, s.g, s.y, s.qkv, s.q_out, s.qa, s.da, s.fa, s.ns, s.qa_k, s.da_k,
         s.bs_k, s.qa_kn, s.bs_kn) = (b.data_ptr() for b in bufs)
        s.t = t
        self._q = bufs[5]
        self._v = bufs[4][:, (self.nh + self.nkv) * self.d:].view(t, self.nkv, self.d)
        self._out = f(t, self.nh * self.d)
        self._attn.out = self._out.data_ptr()

    @property
    def attends(self) -> bool:
        """Whether ``attend_and_layers`` can run (the attention kernel's address is known)."""
        return WHOLE_LAYERS and self._attn.fn is not None

    def attend_and_layers(self, first: int, count: int, h: torch.Tensor,
                          kv_caches: Sequence[torch.Tensor], block_tables: torch.Tensor,
                          context_lens: torch.Tensor, block_size: int, scale: float
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layers ``first`` .. ``first + count - 1`` whole in one C call, each one's decode
        attention (one query row per request, tables already checked this step) then
        ``layer``; returns (q, v) for layer ``first + count``."""
        a = self._attn
        a.block_tables, a.bt_stride = block_tables.data_ptr(), block_tables.stride(0)
        a.context_lens, a.block_size, a.scale = context_lens.data_ptr(), block_size, scale
        k_ptrs, v_ptrs = self._kv.get(kv_caches)
        rc = self._layers_fn(ctypes.addressof(self._weights), self._step_ptr, self._attn_ptr,
                             h.data_ptr(), k_ptrs, v_ptrs, first, count)
        if rc == -1:
            raise MemoryError("paged_decode: the kernel could not allocate its score buffer")
        if rc != 0:
            raise RuntimeError(f"fused GGUF layers: a kernel refused its inputs (code {rc})")
        return self._q, self._v

    def layer(self, i: int, h: torch.Tensor, attn_out: torch.Tensor, kv_cache: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i after its attention (``attn_out`` [t, H * D] float32) through layer i + 1's
        qkv: ``h`` updated in place, k and v written to ``kv_cache`` (layer i + 1's), and
        (q [t, H, D], v [t, Hkv, D]) returned in the step's buffers (the next call reuses
        them)."""
        if attn_out.stride(1) != 1 or attn_out.shape[0] != self._step.t \
                or attn_out.dtype != torch.float32 or h.dtype != torch.float32:
            raise ValueError("fused GGUF layer: float32 attention output rows, unit-stride, "
                             "the step's row count")
        k_ptr = kv_cache.data_ptr()
        rc = self._fn(self._weight_ptrs[i], self._step_ptr, h.data_ptr(), attn_out.data_ptr(),
                      attn_out.stride(0), k_ptr,
                      k_ptr + kv_cache.stride(0) * kv_cache.element_size())
        if rc:
            raise RuntimeError("fused GGUF layer: bad sizes")
        return self._q, self._v


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
