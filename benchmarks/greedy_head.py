"""The greedy screen (``kernels/greedy_head.c``) against the full output layer, per row count:
ms per call for each, with the caches flushed between calls (as in a decode step, where the
layers' weights have just streamed through), and how many candidates the screen left.

SmolLM2's output layer shape (49,152 x 576) with random weights (std 0.05); each input row is
one vocabulary row times 30 plus noise, so it has a clear winner as a model's hidden state
does. "full" is the decode kernel's product (gemv_bf16 / gemm_bf16 / gemm_f32, what the
whole-step C call runs) and numpy's argmax; "screen" is ``GreedyHead.tokens``. The two take
turns within each round.

    chrt -f 1 .venv/bin/python benchmarks/greedy_head.py
    chrt -f 1 .venv/bin/python benchmarks/greedy_head.py --rows 1,8,64 --dtypes float32
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from llmtower.kernels import ops
from llmtower.kernels.gemm_bf16 import gemm_bf16
from llmtower.kernels.gemm_f32 import GemmF32Weight
from llmtower.kernels.gemv_bf16 import GemvWeight
from llmtower.kernels.greedy_head import GreedyHead, max_rows
from llmtower.models.linear import GEMV_MAX_ROWS


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,4,8,16,64,128")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if ops.capabilities().why_not("greedy_head") is not None:
        raise SystemExit(f"no greedy screen here: {ops.capabilities().why_not('greedy_head')}")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    flush = torch.empty(64 * 2**20 // 4)  # 64 MiB: more than the L3 cache
    print(f"output layer {args.vocab} x {args.hidden}, {args.threads} threads, {args.rounds} "
          f"rounds (median ms per call); load average {os.getloadavg()[0]:.1f}")
    print("| dtype | rows | full, ms | screen, ms | full / screen | candidates (median, max) |")
    print("|---|---|---|---|---|---|")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        w = (torch.randn(args.vocab, args.hidden, generator=g) * 0.05).to(dtype)
        kernel = GemvWeight(w) if dtype == torch.bfloat16 else GemmF32Weight(w)
        head = GreedyHead(w, kernel)
        head.max_rows = max_rows()  # past the bfloat16 limit too: this shows where it lies

        def full(x: torch.Tensor, kernel=kernel) -> np.ndarray:
            few = isinstance(kernel, GemvWeight) and x.shape[0] > GEMV_MAX_ROWS
            logits = gemm_bf16(kernel, x) if few else kernel(x)
            return np.argmax(logits.float().numpy(), axis=-1)

        for m in (int(r) for r in args.rows.split(",")):
            if m > head.max_rows:
                continue
            picks = torch.randint(0, args.vocab, (m,), generator=g)
            x = (w[picks].float() * 30 + torch.randn(m, args.hidden, generator=g)).to(dtype)
            times: dict[str, list[float]] = {"full": [], "screen": []}
            cands: list[int] = []
            for _ in range(args.rounds):
                for part, fn in (("full", full), ("screen", head.tokens)):
                    flush.add_(1)
                    t = time.perf_counter()
                    out = fn(x)
                    times[part].append(time.perf_counter() - t)
                    if part == "screen":
                        cands += head.num_cand[:m].tolist()
                        assert np.array_equal(out, full(x)), "the screen's tokens differ"
            f, s = (statistics.median(times[p]) * 1e3 for p in ("full", "screen"))
            print(f"| {name} | {m} | {f:.3f} | {s:.3f} | {f / s:.2f}x | "
                  f"{statistics.median(cands):.0f}, {max(cands)} |")


if __name__ == "__main__":
    main()
