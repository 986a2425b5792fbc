"""Python side of the fused decode layer (``decode_layer.c``): ``DecodeLayers`` owns the C
structs that describe a model's layers and one step's buffers, and runs the work between two
attentions (o projection, residual + norm, MLP, residual + next norm, next qkv, RoPE + KV
write) in one call per layer, or whole layers attention included (``attend_and_layers``).

Used by ``models/llama.py`` for decode steps whose products take a decode-step kernel: in
bfloat16 the few-row kernel (``gemv_bf16``, up to ``models/linear.py`` GEMV_MAX_ROWS rows) or
``gemm_bf16`` (same packed copy, same sums: up to BF16_KERNEL_MAX_ROWS), in float32 the panel
kernel (``gemm_f32``, up to F32_KERNEL_MAX_ROWS); their ``PackedWeight`` copies are what the C
code reads. The results are bit for bit those of the separate kernels
(same code, same order): only the Python and the thread fork/joins between them go. The calls
do no checking beyond what ``begin_step`` validates once per step.
"""
from __future__ import annotations

import ctypes
import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from llmtower.kernels import ops, paged_attention
from llmtower.kernels.build import KernelUnavailable
from llmtower.kernels.gemm_f32 import GemmF32Weight
from llmtower.kernels.decode_layer_lora import LoRAProducts, LoRARows
from llmtower.kernels.gemv_bf16 import GemvWeight
from llmtower.kernels.kv_pointers import KVPointers
from llmtower.kernels.kv_prefetch_choice import KvPrefetchChoice

_P = ctypes.c_void_p
# Most rows a step may have for the fused path, beside the limit of the products' kernel
# (models/linear.py: GEMV_MAX_ROWS for bfloat16, F32_KERNEL_MAX_ROWS for float32). 0 turns the
# fused layer off (benchmarks and tests compare the two).
MAX_ROWS = 256
# The dtypes the C code runs, as its step's ``bf16`` flag.
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# Whether pure one-row decode steps run layers 1 .. L-2 whole in C, attention included
# (``attend_and_layers``); False: one call per layer after a Python attention (benchmarks).
WHOLE_LAYERS = True
# Whether pure one-row decode steps run whole in one C call (``DecodeLayers.step``: layer 0's
# qkv, every attention and layer, the last layer's rest, the final norm and, in bfloat16, the
# output layer); False: layer 0 and the last layer from Python around ``attend_and_layers``.
WHOLE_STEP = True
# Whether whole layers prefetch the next attention's K/V blocks in the float32 products' spare
# steps (decode_layer.c, ``decode_layer_prefetch_kv``): None decides per engine by timing its
# first decode steps both ways (kernels/kv_prefetch_choice.py; LLMTOWER_PREFETCH_KV fixes it);
# True / False fix it (benchmarks compare).
PREFETCH_KV: bool | None = None


class DecodeLayerWeights(ctypes.Structure):
    """One layer's matrices (the decode-step kernel's packed copies) and vectors, by address,
    and its index (its LoRA products)."""

    _fields_ = [(n, _P) for n in ("o", "o_bias", "post_norm", "gate_up", "down", "next_norm",
                                  "qkv", "qkv_bias")] + [("layer", ctypes.c_int64)]


class DecodeStep(ctypes.Structure):
    """What every layer of one step shares: shapes, rotary tables, indices, work buffers."""

    _fields_ = [("t", ctypes.c_int64), ("hidden", ctypes.c_int64), ("inter", ctypes.c_int64),
                ("nh", ctypes.c_int64), ("nkv", ctypes.c_int64), ("d", ctypes.c_int64),
                ("eps", ctypes.c_float), ("num_threads", ctypes.c_int), ("bf16", ctypes.c_int),
                ("cos", _P), ("sin", _P), ("positions", _P), ("slots", _P),
                ("x", _P), ("n", _P), ("y", _P), ("qkv", _P), ("q_out", _P), ("lora", _P)]


class DecodeAttention(ctypes.Structure):
    """One step's decode attention for ``decode_layers``: the kernel's address, the
    requests' block tables and context lengths, the output buffer."""

    _fields_ = [("fn", _P), ("block_tables", _P), ("bt_stride", ctypes.c_int64),
                ("context_lens", _P), ("block_size", ctypes.c_int64), ("scale", ctypes.c_float),
                ("out", _P)]


class DecodeEnds(ctypes.Structure):
    """The two ends of a step for ``decode_step``: layer 0's input norm and qkv, the last
    layer's o projection, post norm and MLP, the final norm, the output layer (or NULL)."""

    _fields_ = [(n, _P) for n in ("first_norm", "first_qkv", "first_qkv_bias", "o", "o_bias",
                                  "post_norm", "gate_up", "down", "final_norm", "head")] \
        + [("vocab", ctypes.c_int64), ("last", ctypes.c_int64)]


class DecodeTail(ctypes.Structure):
    """One step's sampled rows and the buffers of their results."""

    _fields_ = [("rows", _P), ("m", ctypes.c_int64), ("h_rows", _P), ("attn_rows", _P),
                ("out", _P), ("logits_bf16", _P), ("logits", _P), ("lora", _P)]


# paged_attention.py's declaration of paged_decode that decode_layer.c calls by address;
# if that declaration changes, the address is not used (each layer's attention then runs from
# Python) rather than called with the wrong arguments.
_PAGED_DECODE_ARGTYPES = [_P, ctypes.c_int64, _P, _P, _P, ctypes.c_int64, _P, _P,
                          ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                          ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_int]


def _paged_decode_address() -> int | None:
    try:
        fn: Any = paged_attention._fn()  # a ctypes function (typed as a plain callable there)
    except KernelUnavailable:
        return None
    if list(fn.argtypes or ()) != _PAGED_DECODE_ARGTYPES or fn.restype is not ctypes.c_int:
        return None
    return ctypes.cast(fn, ctypes.c_void_p).value


class DecodeRows(Protocol):
    """What ``DecodeLayers.step`` reads of a step's decodes (``models/attention.py``'s
    ``DecodeBatch``): one row per request, their block tables and context lengths, and whether
    those were checked against the caches this step (set here once they are)."""

    query_start: torch.Tensor | None
    num_rows: int
    num_reqs: int
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    checked: bool


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = ops.kernel_library()
    lib.decode_layer.argtypes = [_P, _P, _P, _P, ctypes.c_int64, _P, _P]
    lib.decode_layer.restype = ctypes.c_int
    lib.decode_layers.argtypes = [_P, _P, _P, _P, _P, _P, ctypes.c_int64, ctypes.c_int64]
    lib.decode_layers.restype = ctypes.c_int
    lib.decode_step.argtypes = [_P, _P, _P, _P, _P, _P, _P, _P, ctypes.c_int64]
    lib.decode_step.restype = ctypes.c_int
    return lib


class DecodeLayers:
    """Owns the C descriptions of a model's layer pairs (layer i's o projection and MLP with
    layer i + 1's input norm and qkv: ``layers[i]`` for i < L - 1) and, per step, the work
    buffers and the ``DecodeStep`` every call reads; ``layer`` runs one pair. Its
    ``prefetch_choice`` decides whether whole-layer calls prefetch the next attention's K/V."""

    def __init__(self, layers: Sequence[LayerParts], hidden: int, intermediate: int,
                 num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 dtype: torch.dtype = torch.bfloat16, ends: EndParts | None = None) -> None:
        err = ops.capabilities().why_not_in("decode_layer", dtype)
        if err is not None:
            raise ValueError(f"the fused decode layer cannot run: {err}")
        lib = _lib()
        self._fn = lib.decode_layer
        self.dtype = dtype
        self._kernel = GemvWeight if dtype == torch.bfloat16 else GemmF32Weight
        self.hidden, self.inter = hidden, intermediate
        self.nh, self.nkv, self.d = num_heads, num_kv_heads, head_dim
        self.qkv_n = (num_heads + 2 * num_kv_heads) * head_dim
        if head_dim % 2:
            raise ValueError(f"the fused decode layer needs an even head_dim, not {head_dim}")
        self._keep = list(layers)  # the tensors whose addresses the structs hold
        n = len(self._keep)
        self._weights = (DecodeLayerWeights * n)(*(self._describe(p, i)
                                                    for i, p in enumerate(layers)))
        size = ctypes.sizeof(DecodeLayerWeights)
        self._weight_ptrs = [ctypes.addressof(self._weights) + i * size for i in range(n)]
        self._layers_fn = lib.decode_layers
        self._prefetch_kv = ctypes.c_int.in_dll(lib, "decode_layer_prefetch_kv")
        # bfloat16 products take no side stream: nothing to choose
        self.prefetch_choice = KvPrefetchChoice.from_env() if dtype == torch.float32 \
            else KvPrefetchChoice(fixed=False)
        self._attn = DecodeAttention(fn=_paged_decode_address())
        self._attn_ptr = ctypes.addressof(self._attn)
        self._out = torch.empty(0)
        self._kv = KVPointers(num_kv_heads, head_dim, dtype, "fused decode layers")
        self._step = DecodeStep(hidden=hidden, inter=intermediate, nh=num_heads,
                                nkv=num_kv_heads, d=head_dim, eps=eps, bf16=DTYPES[dtype])
        self._step_ptr = ctypes.addressof(self._step)
        self._step_tensors: tuple[torch.Tensor, ...] = (torch.empty(0), torch.empty(0))
        self._q = self._v = torch.empty(0)
        self._step_fn = lib.decode_step
        self._ends_keep = ends
        self._ends = self._describe_ends(ends) if ends is not None else None
        self.vocab = 0 if ends is None or ends.head is None else ends.head.n
        self._tail = DecodeTail()
        self._tail_ptr = ctypes.addressof(self._tail)
        self._scratch = torch.empty(0, dtype=dtype)
        self._scratch_rows = 0
        self._lora: LoRARows | None = None  # this step's adapter rows
        self._lora_checked: LoRAProducts | None = None
        self._tail_lora: LoRARows | None = None  # the sampled rows' (kept for the call)

    def _describe(self, p: LayerParts, index: int) -> DecodeLayerWeights:
        h, i, qd = self.hidden, self.inter, self.nh * self.d
        want = ((p.o, h, qd, False), (p.gate_up, i, h, True), (p.down, h, i, False),
                (p.qkv, self.qkv_n, h, False))
        self._check_matrices(want)
        self._check_vectors(((p.post_norm, h), (p.next_norm, h), (p.o_bias, h),
                             (p.qkv_bias, self.qkv_n)))
        return DecodeLayerWeights(
            p.o.packed.data_ptr(), _ptr(p.o_bias), p.post_norm.data_ptr(),
            p.gate_up.packed.data_ptr(), p.down.packed.data_ptr(), p.next_norm.data_ptr(),
            p.qkv.packed.data_ptr(), _ptr(p.qkv_bias), index)

    def _check_matrices(self, want: Sequence[tuple[Any, int, int, bool]]) -> None:
        for g, n, k, pair in want:
            if not isinstance(g, self._kernel):
                raise TypeError(f"fused decode layer: {self.dtype} takes "
                                f"{self._kernel.__name__} matrices, not {type(g).__name__}")
            if (g.n, g.k, g.silu_pair, g.path) != (n, k, pair, 0):
                raise ValueError(f"fused decode layer: a matrix is [{g.n}, {g.k}] (gate/up pair "
                                 f"{g.silu_pair}), expected [{n}, {k}] (pair {pair})")

    def _check_vectors(self, vectors: Sequence[tuple[torch.Tensor | None, int]]) -> None:
        for v, n in vectors:
            if v is not None and (v.dtype != self.dtype or not v.is_contiguous()
                                  or v.numel() != n):
                raise ValueError(f"fused decode layer: norms and biases must be contiguous "
                                 f"{self.dtype} [{n}]")

    def _describe_ends(self, e: EndParts) -> DecodeEnds:
        h, i, qd = self.hidden, self.inter, self.nh * self.d
        want: list[tuple[Any, int, int, bool]] = [
            (e.first_qkv, self.qkv_n, h, False), (e.o, h, qd, False), (e.gate_up, i, h, True),
            (e.down, h, i, False)]
        if e.head is not None:
            want.append((e.head, e.head.n, h, False))
        self._check_matrices(want)
        self._check_vectors(((e.first_norm, h), (e.post_norm, h), (e.final_norm, h),
                             (e.o_bias, h), (e.first_qkv_bias, self.qkv_n)))
        return DecodeEnds(
            e.first_norm.data_ptr(), e.first_qkv.packed.data_ptr(), _ptr(e.first_qkv_bias),
            e.o.packed.data_ptr(), _ptr(e.o_bias), e.post_norm.data_ptr(),
            e.gate_up.packed.data_ptr(), e.down.packed.data_ptr(), e.final_norm.data_ptr(),
            None if e.head is None else e.head.packed.data_ptr(),
            0 if e.head is None else e.head.n, len(self._keep))

    @property
    def whole_steps(self) -> bool:
        """Whether ``step`` can run (the ends were given and whole layers can run)."""
        return WHOLE_STEP and self._ends is not None and self.attends

    def step(self, h: torch.Tensor, kv_caches: Sequence[torch.Tensor], db: DecodeRows,
             block_size: int, scale: float, rows: torch.Tensor, head: bool = True
             ) -> tuple[torch.Tensor, bool]:
        """A whole pure one-row decode step (after ``begin_step``) in one C call: ``h`` [t,
        hidden] the embedding rows (the residual stream, updated in place), every layer's
        qkv, K/V write, attention and the rest, then for the sampled ``rows`` (logits_indices)
        the last layer's rest and the final norm. Returns (float32 logits [m, vocab], True)
        where this holds the output layer and ``head`` asks for it, else (the final norm's
        rows [m, hidden], False).
        ``db``: the step's decodes, one row per request (its tables and lengths are checked
        here once per step unless already checked)."""
        s = self._step
        t = s.t
        if self._ends is None:
            raise ValueError("fused decode step: built without the model's ends")
        if tuple(h.shape) != (t, self.hidden) or h.dtype != self.dtype or not h.is_contiguous():
            raise ValueError(f"fused decode step: h must be contiguous {self.dtype} "
                             f"[{t}, {self.hidden}]")
        if len(kv_caches) != len(self._keep) + 1:
            raise ValueError("fused decode step: one KV cache per layer")
        if db.query_start is not None or db.num_rows != t or db.num_reqs != t:
            raise ValueError("fused decode step: one query row per request, every row a decode")
        bt, cl = db.block_tables, db.context_lens
        if (bt.dtype != torch.int64 or cl.dtype != torch.int64 or bt.dim() != 2
                or not bt.is_contiguous() or not cl.is_contiguous() or bt.shape[0] != t
                or tuple(cl.shape) != (t,)):
            raise ValueError("fused decode step: block_tables [n, blocks] and context_lens [n] "
                             "must be contiguous int64")
        k_ptrs, v_ptrs = self._kv.get(kv_caches)
        if block_size != self._kv.block_size:
            raise ValueError(f"fused decode step: the caches hold blocks of "
                             f"{self._kv.block_size} tokens, not {block_size}")
        if not db.checked:
            paged_attention.check_tables(bt, cl, self._kv.num_blocks, block_size)
            db.checked = True
        m = rows.shape[0]
        if rows.dtype != torch.int64 or rows.dim() != 1 or not rows.is_contiguous() \
                or not 1 <= m <= t:
            raise ValueError(f"fused decode step: the sampled rows must be contiguous int64, "
                             f"1 to {t} of them")
        a = self._attn
        a.block_tables, a.bt_stride = bt.data_ptr(), bt.stride(0)
        a.context_lens, a.block_size, a.scale = cl.data_ptr(), block_size, scale
        head = head and self.vocab > 0
        # scratch: gathered h rows, gathered attention rows, the output layer's bfloat16
        # results, each 64-element aligned
        parts = (t * self.hidden, t * self.nh * self.d,
                 m * self.vocab if head and self.dtype == torch.bfloat16 else 0)
        offs = [0]
        for n in parts:
            offs.append(offs[-1] + -(-n // 64) * 64)
        if self._scratch.numel() < offs[-1] + 64:
            self._scratch = torch.empty(offs[-1] + 64, dtype=self.dtype)
        es = self._scratch.element_size()
        sc = -(-self._scratch.data_ptr() // 64) * 64
        out = torch.empty(m, self.hidden, dtype=self.dtype)
        logits = torch.empty(m, self.vocab, dtype=torch.float32) if head else None
        tl = self._tail
        tl.lora = None
        if self._lora is not None:
            tail = self._lora if m == t and bool((rows == torch.arange(t)).all()) \
                else self._lora.select(rows)
            self._tail_lora = tail
            tl.lora = tail.ptr
        tl.rows, tl.m = rows.data_ptr(), m
        tl.h_rows, tl.attn_rows = sc, sc + offs[1] * es
        tl.out = out.data_ptr()
        tl.logits_bf16 = sc + offs[2] * es if head else None
        tl.logits = None if logits is None else logits.data_ptr()
        rc = self._timed(self._step_fn, ctypes.addressof(self._weights),
                         ctypes.addressof(self._ends), self._step_ptr, self._attn_ptr,
                         self._tail_ptr, h.data_ptr(), k_ptrs, v_ptrs, len(kv_caches))
        if rc == 2:
            raise ValueError(f"fused decode step: sampled rows must be in 0..{t - 1}")
        if rc == -1:
            raise MemoryError("paged_decode: the kernel could not allocate its score buffer")
        if rc != 0:
            raise RuntimeError(f"fused decode step: a kernel refused its inputs (code {rc})")
        if logits is not None:
            return logits, True
        return out, False

    @property
    def takes_lora(self) -> bool:
        """Whether steps with LoRA rows can run here (float32: the hooks are in its products)."""
        return self.dtype == torch.float32

    def begin_step(self, t: int, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                   slots: torch.Tensor, lora: LoRARows | None = None) -> None:
        """Buffers and shared values of a step of ``t`` rows (positions and slots checked by
        the caller, as for ``FusedOps``; cos / sin: the full-width rotary tables in the
        model's dtype). ``lora``: the step's adapter rows (float32; None: no row has one)."""
        if cos.dtype != self.dtype or sin.dtype != self.dtype:
            raise TypeError(f"fused decode layer: the rotary tables must be {self.dtype}")
        if t < 1 or t > MAX_ROWS:
            raise ValueError(f"fused decode layer: a step of {t} rows (1 to {MAX_ROWS})")
        s = self._step
        if lora is not None:
            self._check_lora(lora, t)
        self._lora = lora
        s.lora = None if lora is None else lora.ptr
        s.num_threads = torch.get_num_threads()
        s.positions, s.slots = positions.data_ptr(), slots.data_ptr()
        if t == s.t and self._step_tensors[0] is cos and self._step_tensors[1] is sin:
            # the previous step's buffers (nothing outlives a step in them)
            self._step_tensors = (cos, sin, positions, slots, *self._step_tensors[4:])
            return
        e = functools.partial(torch.empty, dtype=self.dtype)
        x, n, y, qkv, q = (e(t, self.hidden), e(t, self.hidden), e(t, self.inter),
                           e(t, self.qkv_n), e(t, self.nh, self.d))
        self._out = e(t, self.nh * self.d)
        self._step_tensors = (cos, sin, positions, slots, x, n, y, qkv, q, self._out)
        s.t = t
        s.cos, s.sin = cos.data_ptr(), sin.data_ptr()
        s.x, s.n, s.y, s.qkv, s.q_out = (x.data_ptr(), n.data_ptr(), y.data_ptr(),
                                         qkv.data_ptr(), q.data_ptr())
        self._q = q
        self._v = qkv[:, (self.nh + self.nkv) * self.d:].view(t, self.nkv, self.d)
        self._attn.out = self._out.data_ptr()

    def _check_lora(self, lora: LoRARows, t: int) -> None:
        """The adapter rows fit this step and the products fit these layers (once per set)."""
        if not self.takes_lora:
            raise ValueError(f"fused decode layer: no LoRA hooks in {self.dtype} steps")
        if lora.num_rows != t:
            raise ValueError(f"fused decode layer: adapter rows for {lora.num_rows} rows in a "
                             f"step of {t}")
        p = lora.products
        if p is self._lora_checked:
            return
        h, i, qd = self.hidden, self.inter, self.nh * self.d
        want = {"qkv": (h, [qd, self.nkv * self.d, self.nkv * self.d]), "o": (qd, [h]),
                "gate_up": (h, [i, i]), "down": (i, [h])}
        if p.num_layers != len(self._keep) + 1:
            raise ValueError(f"fused decode layer: LoRA matrices for {p.num_layers} layers, "
                             f"the model has {len(self._keep) + 1}")
        for group, (k, sizes) in p.shapes.items():
            if (k, sizes) != want[group]:
                raise ValueError(f"fused decode layer: LoRA {group} matrices take {k} inputs "
                                 f"to {sizes} outputs, the layer's {want[group]}")
        self._lora_checked = p

    def _timed(self, fn: Any, *args: Any) -> int:
        """``fn(*args)`` (a C call of whole layers) with this step's K/V prefetch setting:
        PREFETCH_KV where a benchmark fixed it, else the trial's (its time reported to it)."""
        if PREFETCH_KV is not None:
            self._prefetch_kv.value = int(PREFETCH_KV)
            return fn(*args)
        choice, t = self.prefetch_choice, self._step.t
        self._prefetch_kv.value = int(choice.setting(t))
        if choice.decided is not None:
            return fn(*args)
        start = time.perf_counter()
        rc = fn(*args)
        choice.record(t, time.perf_counter() - start)
        return rc

    @property
    def attends(self) -> bool:
        """Whether ``attend_and_layers`` can run (the attention kernel's address is known)."""
        return WHOLE_LAYERS and self._attn.fn is not None

    def attend_and_layers(self, first: int, count: int, h: torch.Tensor,
                          kv_caches: Sequence[torch.Tensor], block_tables: torch.Tensor,
                          context_lens: torch.Tensor, block_size: int, scale: float
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layers ``first`` .. ``first + count - 1`` whole in one C call: each one's decode
        attention (``paged_decode``, one query row per request: the step must be decodes
        only, with tables and lengths already checked against the caches, as the attention
        of layer ``first - 1`` does) over q from the previous call, then ``layer``. Returns
        (q, v) for layer ``first + count``, as ``layer`` does."""
        a = self._attn
        a.block_tables, a.bt_stride = block_tables.data_ptr(), block_tables.stride(0)
        a.context_lens, a.block_size, a.scale = context_lens.data_ptr(), block_size, scale
        k_ptrs, v_ptrs = self._kv.get(kv_caches)
        rc = self._timed(self._layers_fn, ctypes.addressof(self._weights), self._step_ptr,
                         self._attn_ptr, h.data_ptr(), k_ptrs, v_ptrs, first, count)
        if rc == -1:
            raise MemoryError("paged_decode: the kernel could not allocate its score buffer")
        if rc != 0:
            raise RuntimeError(f"fused decode layers: a kernel refused its inputs (code {rc})")
        return self._q, self._v

    def layer(self, i: int, h: torch.Tensor, attn_out: torch.Tensor, kv_cache: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i after its attention (``attn_out`` [t, H * D]) through layer i + 1's qkv:
        ``h`` (the residual stream [t, hidden]) updated in place, k and v written to their
        slots of ``kv_cache`` (layer i + 1's), and (q [t, H, D], v [t, Hkv, D]) returned for
        layer i + 1's attention. q and v live in the step's buffers: the next call reuses them."""
        if attn_out.stride(1) != 1 or attn_out.shape[0] != self._step.t:
            raise ValueError("fused decode layer: attention output rows must be unit-stride "
                             "and the step's row count")
        k_ptr = kv_cache.data_ptr()
        self._fn(self._weight_ptrs[i], self._step_ptr, h.data_ptr(), attn_out.data_ptr(),
                 attn_out.stride(0), k_ptr, k_ptr + kv_cache.stride(0) * kv_cache.element_size())
        return self._q, self._v


@dataclass
class LayerParts:
    """The tensors of one layer pair that ``DecodeLayers`` reads: layer i's o projection,
    post-attention norm and MLP; layer i + 1's input norm and qkv projection."""

    o: GemvWeight | GemmF32Weight
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: GemvWeight | GemmF32Weight  # a gate/up pair (``GemvWeight(gate, up)``)
    down: GemvWeight | GemmF32Weight
    next_norm: torch.Tensor
    qkv: GemvWeight | GemmF32Weight
    qkv_bias: torch.Tensor | None


@dataclass
class EndParts:
    """The tensors of a step's two ends that ``DecodeLayers.step`` reads: layer 0's input
    norm and qkv projection; the last layer's o projection, post-attention norm and MLP; the
    model's final norm; and (bfloat16, or None) the output layer's few-row copy."""

    first_norm: torch.Tensor
    first_qkv: GemvWeight | GemmF32Weight
    first_qkv_bias: torch.Tensor | None
    o: GemvWeight | GemmF32Weight
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: GemvWeight | GemmF32Weight
    down: GemvWeight | GemmF32Weight
    final_norm: torch.Tensor
    head: GemvWeight | GemmF32Weight | None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
