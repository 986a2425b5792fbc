"""CPU time of the block kernels on a 1B model's matrices (Llama-3.2-1B shapes, SmolLM2's
vocabulary; random blocks): the product for 1 and 16 rows of x (a decode step of one stream and
of 16), and the dequantization to bfloat16 of a prefill slab. CPU time of the calling thread
(1 thread), so a busy machine moves it less than wall time; its relative error against the
float64 product of the dequantized weights beside it.

--baseline LIB.so compares with another build of the kernels (e.g. an older quant_gemm.c
compiled alone: gcc -O3 -march=native -fopenmp -fPIC -shared quant_gemm.c -o old.so) through
its quant_act / quant_gemm (per-32 activations for every format) and quant_dequant_bf16.

    PYTHONPATH=src:. python benchmarks/gguf_kernels.py [--baseline old.so]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import time
from collections.abc import Callable

import gguf
import torch

from llmtower.kernels import quant_gemm as qg
from tests.kernels.test_quant_gemm import random_blocks

Q = gguf.GGMLQuantizationType
SHAPES = [(Q.Q4_0, 16384, 2048, "gate/up"), (Q.Q4_K, 16384, 2048, "gate/up"),
          (Q.Q6_K, 2048, 8192, "down"), (Q.Q6_K, 49152, 2048, "output")]


def cpu_ms(fn: Callable[[], None], reps: int) -> float:
    fn()
    t = time.process_time()
    for _ in range(reps):
        fn()
    return (time.process_time() - t) / reps * 1e3


def baseline_lib(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.quant_act.argtypes = [p, i64, i64, i64, p, p, p, p]
    lib.quant_gemm.argtypes = [i, p, i64, i64, i64, i64, p, p, p, p, p, i64, i, i]
    lib.quant_dequant_bf16.argtypes = [i, p, i64, i64, i64, p, p, i]
    return lib


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    old = baseline_lib(args.baseline) if args.baseline else None
    print(f"load average {os.getloadavg()[0]:.1f}; CPU-ms per call, 1 thread"
          + ("; baseline " + args.baseline if old else ""))
    print("| matrix | rows of x | CPU-ms | GB/s of weights | rel. error |"
          + (" baseline CPU-ms | speed-up |" if old else ""))
    print("|---|---|---|---|---|" + ("---|---|" if old else ""))
    for qt, n, k, name in SHAPES:
        data = random_blocks(qt, n, k)
        w = qg.from_numpy(int(qt), data, n, k)
        wf = torch.from_numpy(gguf.quants.dequantize(data, qt)).double()
        for m in (1, 16):
            print(f"| {qt.name} {name} [{n}x{k}] | {m} | " + product_row(w, wf, m, old),
                  flush=True)
        print(f"| {qt.name} {name}: 4096 rows to bfloat16 | - | " + dequant_row(w, old),
              flush=True)


def product_row(w: qg.BlockWeight, wf: torch.Tensor, m: int, old: ctypes.CDLL | None) -> str:
    n, k = w.shape
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    out = torch.empty(m, n)
    reps = 5 if m == 1 else 2
    ms = cpu_ms(lambda: w.matmul_into(qg.quantize_activations(x), out, 1), reps)
    ref = x.double() @ wf.T
    err = float((out.double() - ref).abs().mean() / ref.abs().mean())
    row = f"{ms:.1f} | {w.nbytes / ms / 1e6:.1f} | {err:.1e} |"
    if old is None:
        return row
    nb = k // 32
    qa = torch.empty(m * k, dtype=torch.int8)
    da, fa = torch.empty(m * nb), torch.empty(m * nb)
    ns = torch.empty(m * nb * 8, dtype=torch.int32)

    def base() -> None:
        old.quant_act(x.data_ptr(), m, k, k, qa.data_ptr(), da.data_ptr(), fa.data_ptr(),
                      ns.data_ptr())
        old.quant_gemm(w.fmt, w.data.data_ptr(), w.row_bytes, n, k, m, qa.data_ptr(),
                       da.data_ptr(), fa.data_ptr(), ns.data_ptr(), out.data_ptr(), n, 1, 0)
    b = cpu_ms(base, reps)
    return row + f" {b:.1f} | {b / ms:.2f}x |"


def dequant_row(w: qg.BlockWeight, old: ctypes.CDLL | None) -> str:
    part = w.rows(0, min(4096, w.n))
    slab = torch.empty(part.n, part.k, dtype=torch.bfloat16)

    def run(lib: ctypes.CDLL) -> None:
        lib.quant_dequant_bf16(part.fmt, part.data.data_ptr(), part.row_bytes, part.n, part.k,
                               None, slab.data_ptr(), 1)
    ms = cpu_ms(lambda: run(part._lib), 3)
    row = f"{ms:.1f} | {part.nbytes / ms / 1e6:.1f} | exact |"
    if old is None:
        return row
    b = cpu_ms(lambda: run(old), 3)
    return row + f" {b:.1f} | {b / ms:.2f}x |"

if __name__ == "__main__":
    main()
