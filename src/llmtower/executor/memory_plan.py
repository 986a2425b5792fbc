"""The memory plan of a start: weights + working memory + KV cache (+ swap space), estimated
before anything is loaded and checked against what this process may take (the least of its
cgroup's room, MemAvailable and ``ulimit -v``: ``host_available_bytes``), so a model that
cannot fit is refused with the numbers and what to change instead of being killed by the OOM
killer half-way through loading. After the load the start-up log prints the measured RSS
beside the plan.

Weights are estimated from the files without reading them: a GGUF's tensor table (kept in
its block formats with ``--quantization gguf``, else dequantized to the model's dtype), or a
safetensors header's shapes. Float matrices are counted twice where ``models/linear.py``
keeps a decode kernel's copy beside oneDNN's (bfloat16 with AVX512_BF16, float32 with
AVX-512), and ``--quantization int8/int4`` counts the float32 weights it quantizes from.
"""
from __future__ import annotations

import json
import logging
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from llmtower.core.sched.degradation import host_available_bytes
from llmtower.kernels import ops

logger = logging.getLogger(__name__)

GIB = 2**30
# The share of the available memory a plan may use: the rest is for Python, the tokenizer,
# libraries and the page cache the process leans on.
PLAN_MARGIN = 0.9
_SAFETENSORS_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "I64": 8, "I32": 4, "I8": 1,
                      "U8": 1, "BOOL": 1}


@dataclass(frozen=True)
class MemoryPlan:
    """Owns one start's memory estimate in bytes: weights, working memory (one step's
    activations and bounded caches), the KV cache and CPU swap space, and what this process
    may take (None: unknown)."""

    weights: int
    working: int
    kv_cache: int
    swap: int
    available: int | None

    @property
    def total(self) -> int:
        return self.weights + self.working + self.kv_cache + self.swap

    def describe(self) -> str:
        avail = "unknown" if self.available is None else f"{self.available / GIB:.2f} GiB"
        return (f"weights {self.weights / GIB:.2f} GiB + working memory "
                f"{self.working / GIB:.2f} GiB + KV cache {self.kv_cache / GIB:.2f} GiB + swap "
                f"space {self.swap / GIB:.2f} GiB = {self.total / GIB:.2f} GiB (available: "
                f"{avail})")

    def check(self, margin: float = PLAN_MARGIN) -> None:
        """Refuse a plan that does not fit ``margin`` of the available memory, saying what to
        change."""
        if self.available is None or self.total <= self.available * margin:
            return
        over = self.total - self.available * margin
        hints = []
        if self.kv_cache > 0:
            hints.append("a smaller --kv-cache-memory / --num-gpu-blocks")
        if self.swap > 0:
            hints.append("less --swap-space")
        hints.append("a smaller --max-num-batched-tokens")
        hints.append("a quantized model (a Q4_K_M / Q4_0 GGUF with --quantization gguf)")
        raise ValueError(f"this model does not fit in memory: {self.describe()}; at most "
                         f"{margin:.0%} of the available memory is planned, so "
                         f"{over / GIB:.2f} GiB must go: use {', or '.join(hints)}")


def _safetensors_tensors(directory: Path) -> list[tuple[list[int], str]]:
    """(shape, dtype) of every tensor in a model directory's safetensors files (their headers
    only)."""
    out: list[tuple[list[int], str]] = []
    for file in sorted(directory.glob("*.safetensors")):
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        out += [(v["shape"], v["dtype"]) for k, v in header.items() if k != "__metadata__"]
    return out


def _float_copies(dtype: torch.dtype) -> int:
    """Layouts a float matrix is held in (oneDNN's, and a decode kernel's where it runs)."""
    caps = ops.capabilities()
    if dtype == torch.bfloat16 and caps.can_run("gemv_bf16"):
        return 2
    if dtype == torch.float32 and caps.can_run("gemm_f32"):
        return 2
    return 1


def estimate_weight_bytes(model_dir: Path, gguf_path: Path | None, dtype: torch.dtype,
                          quantization: str) -> int:
    """The weights' bytes once loaded (see the module docstring for what is counted)."""
    elem = torch.empty((), dtype=dtype).element_size()
    copies = _float_copies(dtype)
    if gguf_path is not None:
        from llmtower.models.gguf_index import read_tensor_index
        from llmtower.models.quant_block import has_block_kernel

        total = 0
        for t in read_tensor_index(gguf_path):
            if quantization == "gguf" and len(t.shape) == 2 and has_block_kernel(int(t.qtype)):
                total += t.nbytes
            else:
                total += int(t.n_elements) * elem * (copies if len(t.shape) == 2 else 1)
        return total
    total = 0
    for shape, dt in _safetensors_tensors(model_dir):
        numel = 1
        for s in shape:
            numel *= s
        if quantization in ("int8", "int4") and len(shape) == 2:
            total += numel * 4 + numel // (1 if quantization == "int8" else 2)
        else:
            total += numel * elem * (copies if len(shape) == 2 else 1)
        del dt
    return total


def make_plan(weights: int, working: int, kv_cache: int, swap: int) -> MemoryPlan:
    """A plan against what this process may take now."""
    return MemoryPlan(weights, working, kv_cache, swap, host_available_bytes())


def rss_bytes() -> tuple[int, int]:
    """(resident, peak resident) bytes of this process (VmRSS, VmHWM)."""
    rss = peak = 0
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return rss, peak or rss
