"""Memory the kernels stream from, backed by 2 MiB transparent huge pages where Linux gives them.

A decode step streams every weight once (a one-row bfloat16 step on SmolLM2-135M reads 274 MB)
and gathers K/V blocks from all over the cache. On 4 KiB pages that is a TLB miss every 64
cache lines, and in a virtual machine each miss walks two page tables (guest and host). Measured
on this machine kind (2 cores, KVM guest), one process, taking turns: a streaming read of 512 MiB
ran at 31 GB/s on 4 KiB pages and 42 GB/s on huge pages, with 1 thread 28 vs 38 GB/s
(`benchmarks/memory_bandwidth.py --no-engine`).

Most machines leave transparent huge pages in ``madvise`` mode, so memory gets them only when
asked, and only if asked *before* it is first touched: a page faulted in as 4 KiB stays so until
``khugepaged`` gets round to it (minutes, if ever). So weights are copied into memory that was
advised while still untouched, never advised after the fact.

    one chunk (an anonymous mmap, advised MADV_HUGEPAGE before any write)
    |<-- up to 2 MiB -->|<------------------------ CHUNK_BYTES ------------------------>|
    | unused: alignment | tensor | tensor | tensor ...  free ->                           |
                        ^ 2 MiB boundary; tensors start on 4 KiB boundaries (bump pointer)

A tensor keeps its chunk alive (``torch.frombuffer`` holds the mmap), so a chunk is unmapped
when the last tensor carved from it is freed; freed space inside a live chunk is not reused:
weights live as long as their model. Where huge pages are off (``never``), unsupported (not
Linux) or disabled (``LLMTOWER_HUGE_PAGES=0``), these are plain tensors, with identical
contents and results either way.
"""
from __future__ import annotations

import mmap
import os
import sys
import threading

import torch

HUGE_PAGE = 2 * 2**20
CHUNK_BYTES = 64 * 2**20
_ALIGN = 4096
# Tensors smaller than this stay ordinary allocations: they sit in the caches anyway.
MIN_BYTES = 64 * 1024

# Read at import; benchmarks flip it to compare both kinds of memory in one process.
ENABLED = os.environ.get("LLMTOWER_HUGE_PAGES", "1") != "0" and sys.platform.startswith("linux") \
    and hasattr(mmap, "MADV_HUGEPAGE")


def _advised_map(nbytes: int) -> tuple[mmap.mmap, int]:
    """An untouched anonymous mapping with a 2 MiB-aligned, huge-page-advised range of
    ``nbytes`` at the returned offset."""
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(m, dtype=torch.uint8, count=1).data_ptr()
    offset = -base % HUGE_PAGE
    try:
        m.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)
    except OSError:
        pass  # a kernel without THP: ordinary pages, same contents
    return m, offset


class HugePageArena:
    """Owns the current huge-page chunk and carves tensors out of it with a bump pointer;
    a request larger than a quarter chunk gets a mapping of its own."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self._map: mmap.mmap | None = None
        self._next = 0
        self._end = 0
        self._lock = threading.Lock()

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized 1-D tensor of ``numel`` elements on huge-page-advised memory."""
        nbytes = numel * dtype.itemsize
        if nbytes == 0:
            return torch.empty(0, dtype=dtype)
        if nbytes > self.chunk_bytes // 4:
            m, offset = _advised_map(nbytes)
            return torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype)
        with self._lock:
            if self._map is None or self._next + nbytes > self._end:
                self._map, self._next = _advised_map(self.chunk_bytes)
                self._end = self._next + self.chunk_bytes
            offset = self._next
            self._next = -(-(offset + nbytes) // _ALIGN) * _ALIGN
            m = self._map
        return torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype)


_ARENA = HugePageArena()


def empty_streamed(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized 1-D tensor for memory a kernel streams every step (packed weights):
    from the process's huge-page arena, or a plain ``torch.empty`` where that is off or the
    tensor is small."""
    if not ENABLED or numel * dtype.itemsize < MIN_BYTES:
        return torch.empty(numel, dtype=dtype)
    return _ARENA.empty(numel, dtype)


def to_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` on huge-page memory (``t`` itself where that is off, the
    tensor is small, or it is not a plain strided CPU tensor)."""
    if not ENABLED or t.nbytes < MIN_BYTES or t.layout != torch.strided or t.device.type != "cpu" \
            or t.is_quantized:
        return t
    out = _ARENA.empty(t.numel(), t.dtype).view(t.shape)
    out.copy_(t)
    return out


def empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized tensor of ``shape`` on a huge-page-advised mapping of its own (the KV
    cache: large, and freed with its engine)."""
    numel = 1
    for s in shape:
        numel *= s
    if not ENABLED or numel * dtype.itemsize < MIN_BYTES:
        return torch.empty(shape, dtype=dtype)
    m, offset = _advised_map(numel * dtype.itemsize)
    return torch.frombuffer(m, dtype=torch.uint8, count=numel * dtype.itemsize,
                            offset=offset).view(dtype).view(shape)


def huge_page_bytes() -> int | None:
    """Bytes of this process's memory on transparent huge pages (``AnonHugePages`` of
    /proc/self/smaps_rollup), or None where Linux does not say."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
