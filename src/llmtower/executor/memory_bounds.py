"""Bounds on the engine's native (non-Python) memory, which otherwise grows with every new
per-step token count.

Each step runs the model's matrix multiplications on a new number of tokens, and oneDNN (and
ideep, PyTorch's wrapper of it) caches a compiled primitive per shape: up to 1,024 each by
default, ~0.5 MiB apiece for bfloat16 matmuls. Freed primitives then leave glibc's heap
fragmented, so even a bounded cache keeps the process growing. Measured with one bfloat16
576x1536 linear over 800 token counts (tests: benchmarks/soak.py for the whole server):

    default caches                      +585 MiB
    caches capped at 64                 +371 MiB
    caches capped at 64 + malloc_trim    +54 MiB, flat after the first 400 shapes

So: cap both caches (before the first oneDNN call of the process; the capacities are read
lazily) and hand freed heap pages back to the OS every few seconds of stepping. A shape
evicted from the cache is compiled again when it returns (well under a millisecond per
primitive); the capacity keeps the token counts of recent steps cached.

Between two trims the heap keeps its freed pages (``hold_freed_pages``): glibc's defaults hand
the top of the heap back to the OS whenever more than ~2x its largest recent block is free
there, and serve blocks above the (adaptive) mmap threshold from fresh mappings, so a step's
activations (tens of MB per layer in a prefill chunk) came back as new zero-filled pages, step
after step: ~150,000 page faults per 2048-token float32 prefill step of SmolLM2, ~600 MB of
zeroing. Holding them costs nothing beyond the peak of one step, which the periodic trim
returns anyway (vLLM's CPU backend gets the same effect by preloading tcmalloc).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import time

logger = logging.getLogger(__name__)

# The operator's knob (0 disables the caches); the library variables win when set explicitly.
CAPACITY_ENV = "LLMTOWER_ONEDNN_CACHE_CAPACITY"
# ~1 MiB of native memory per cached bfloat16 primitive once the heap settles (64: ~75 MiB,
# 128: ~130 MiB). A miss recompiles a primitive (~1 ms), so the default keeps the shapes of
# the last ~50 steps: decode steps, whose token count moves slowly, nearly always hit.
DEFAULT_CAPACITY = 256
_LIBRARY_ENVS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY",
                 "LRU_CACHE_CAPACITY")
TRIM_INTERVAL_S = 5.0
TRIM_ENV = "LLMTOWER_MALLOC_TRIM_INTERVAL_S"  # seconds between trims; 0 turns them off


def bound_native_caches(environ: os._Environ | dict[str, str] = os.environ) -> int:
    """Cap oneDNN's primitive cache and ideep's LRU cache of this process (and of processes
    it starts afterwards). Returns the capacity in force."""
    capacity = int(environ.get(CAPACITY_ENV, DEFAULT_CAPACITY))
    for name in _LIBRARY_ENVS:
        environ.setdefault(name, str(capacity))
    return capacity


HOLD_ENV = "LLMTOWER_MALLOC_HOLD"  # 0: glibc's own trim and mmap thresholds
# glibc's mallopt parameters and the values set: blocks up to 32 MiB (the largest mmap threshold
# glibc accepts) come from the heap, and the heap's top is never trimmed on free (the periodic
# malloc_trim still hands free pages back).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
HOLD_MMAP_THRESHOLD = 32 * 2**20
HOLD_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: 2 GiB free at the top before a trim


def hold_freed_pages(environ: os._Environ | dict[str, str] = os.environ) -> bool:
    """Keep freed heap memory mapped in this process (``mallopt``), unless the operator set
    ``LLMTOWER_MALLOC_HOLD=0``; True when set (glibc only: elsewhere nothing happens)."""
    if environ.get(HOLD_ENV, "1").strip() in ("0", "false", "no", "off"):
        return False
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, HOLD_MMAP_THRESHOLD) == 1
    return mallopt(_M_TRIM_THRESHOLD, HOLD_TRIM_THRESHOLD) == 1 and ok


def _load_malloc_trim():
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


class HeapTrimmer:
    """Owns the periodic ``malloc_trim(0)`` of the engine process: at most once every
    ``interval_s`` seconds, called between steps."""

    def __init__(self, interval_s: float | None = None) -> None:
        if interval_s is None:
            interval_s = float(os.environ.get(TRIM_ENV, TRIM_INTERVAL_S))
        self.interval_s = interval_s
        self._trim = _load_malloc_trim() if interval_s > 0 else None
        self.holds_pages = hold_freed_pages()
        self._next = time.monotonic() + interval_s
        self.num_trims = 0

    def after_step(self) -> None:
        if self._trim is None:
            return
        now = time.monotonic()
        if now < self._next:
            return
        self._trim(0)
        self.num_trims += 1
        # From the end of the trim: a slow trim on a huge heap cannot run back to back.
        self._next = time.monotonic() + self.interval_s


# Native memory of the bounded caches once the heap settles (~1 MiB per bfloat16 primitive).
BYTES_PER_CACHED_PRIMITIVE = 2**20


def working_memory_bytes(hidden_size: int, intermediate_size: int, num_heads: int,
                         num_kv_heads: int, head_dim: int, vocab_size: int,
                         max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                         elem_size: int) -> int:
    """An upper estimate of the engine's memory beyond weights and KV cache, for the memory
    plan: the activations of one full step (layers run one at a time, so one layer's worth),
    the attention scores of a prefill chunk (float32), the logits and sampling buffers of
    every running sequence (float32), and the bounded oneDNN caches."""
    t = max_num_batched_tokens
    activations = t * elem_size * (4 * hidden_size + 3 * intermediate_size
                                   + (num_heads + 2 * num_kv_heads) * head_dim)
    scores = num_heads * t * min(t, max_model_len) * 4
    logits = max_num_seqs * vocab_size * 4 * 3  # logits, probabilities, sort scratch
    capacity = int(os.environ.get(CAPACITY_ENV, DEFAULT_CAPACITY))
    return activations + scores + logits + capacity * BYTES_PER_CACHED_PRIMITIVE
