"""A prefill chunk's product by a block-format matrix, two ways, side by side in one process:
the int8 block kernel (``BlockWeight.matmul_into``: activations quantized to int8, the file's
blocks read in place) and the bfloat16 route (``BlockQuantLinear._dequantized_product``: the
weight dequantized to bfloat16 a slab at a time, then oneDNN's GEMM). The two take turns each
round, so a busy machine's load hits both alike; wall ms per product (median of the rounds) at
the run's thread count. ``models/quant_block.py``'s BLOCK_KERNEL_MAX_ROWS is where the first
stops being the faster. For the K formats a third column times the one-weight-row int8 code
(``path=2``: quant_gemm_k.c alone, without quant_gemm_k16.c's 16-row groups).

    PYTHONPATH=src:. python benchmarks/gguf_prefill_products.py --rows 64,96,144,256,512
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import gguf
import torch

from llmtower.kernels import quant_gemm as qg
from llmtower.models.quant_block import BlockQuantLinear
from tests.kernels.test_quant_gemm import random_blocks

Q = gguf.GGMLQuantizationType
SHAPES = {"q4_0": (Q.Q4_0, 16384, 2048), "q4_k": (Q.Q4_K, 16384, 2048),
          "q6_k": (Q.Q6_K, 2048, 8192), "q4_k_o": (Q.Q4_K, 2048, 2048)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="64,96,144,256,512")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, load {os.getloadavg()[0]:.1f}")
    print(f"{'matrix':<22} {'rows':>5} {'int8 ms':>9} {'bf16 ms':>9} {'bf16/int8':>10} "
          f"{'1-row ms':>9} {'1-row/int8':>10}")
    for name in args.shapes.split(","):
        fmt, n, k = SHAPES[name]
        w = qg.from_numpy(int(fmt), random_blocks(fmt, n, k), n, k)
        lin = BlockQuantLinear([w])
        w1 = qg.from_numpy(int(fmt), random_blocks(fmt, n, k), n, k, path=2) \
            if int(fmt) in qg.K_FORMATS else None
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k)
            out = torch.empty(m, n)

            def int8(w=w, x=x, out=out) -> None:  # type: ignore[no-untyped-def]
                w.matmul_into(qg.quantize_activations(x), out, args.threads)

            def bf16(lin=lin, x=x) -> None:  # type: ignore[no-untyped-def]
                lin._dequantized_product(x, None)

            def one_row(w1=w1, x=x, out=out) -> None:  # type: ignore[no-untyped-def]
                if w1 is not None:
                    w1.matmul_into(qg.quantize_activations(x), out, args.threads)

            times: dict[str, list[float]] = {"int8": [], "bf16": [], "one_row": []}
            runs = (("int8", int8), ("bf16", bf16), ("one_row", one_row))
            for _, fn in runs:
                fn()  # warm
            for _ in range(args.rounds):
                for key, fn in runs:
                    t = time.perf_counter()
                    fn()
                    times[key].append((time.perf_counter() - t) * 1e3)
            a, b = statistics.median(times["int8"]), statistics.median(times["bf16"])
            c = statistics.median(times["one_row"]) if w1 is not None else float("nan")
            print(f"{fmt.name + ' ' + str(n) + 'x' + str(k):<22} {m:>5} {a:>9.1f} {b:>9.1f} "
                  f"{b / a:>9.2f}x {c:>9.1f} {c / a:>9.2f}x", flush=True)


if __name__ == "__main__":
    main()
