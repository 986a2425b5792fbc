"""What the int8 activations of the block kernels cost in accuracy, on a GGUF model.

The model is loaded once with ``--quantization gguf``. Each variant reads the same token
sequences in one teacher-forced pass and is compared at every position with the reference:

- reference: every product by the float32 values of the dequantized blocks (exact weights,
  float32 activations);
- int8 kernel: every product by the block kernel (``quant_gemm.c`` / ``quant_gemm_k.c``:
  activations int8 per 32 or per 256 values), i.e. what a decode step computes for each row;
- bfloat16 slabs: every product by the weights dequantized to bfloat16 (what prefill chunks
  of more than ``BLOCK_KERNEL_MAX_ROWS`` rows compute).

Printed per variant: greedy agreement (argmax equal to the reference's), mean and max of
|log p(reference's argmax) - log p_reference(it)|.

    PYTHONPATH=src python benchmarks/gguf_int8_accuracy.py --model F.gguf --num-seqs 4 --len 64
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantized import build, teacher_forced_logprobs

from llmtower.models import quant_block
from llmtower.models.quant_block import BlockQuantLinear


def float_product(self: BlockQuantLinear, x: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T with W the float32 dequantized blocks, one part at a time."""
    xf = x.float()
    out = torch.cat([xf @ p.dequantize().T for p in self.parts], dim=1)
    if bias is not None:
        out += bias
    return out.to(x.dtype)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--num-seqs", type=int, default=4)
    ap.add_argument("--len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = build(args.model, "float32", "gguf")
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(100, model.config.vocab_size, (args.len,), generator=g).tolist()
            for _ in range(args.num_seqs)]
    real_call = BlockQuantLinear.__call__

    def run(name: str) -> list[torch.Tensor]:
        t = time.perf_counter()
        out = [teacher_forced_logprobs(model, s, 1) for s in seqs]
        print(f"{name}: {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
        return out

    BlockQuantLinear.__call__ = float_product  # type: ignore[method-assign]
    refs = run("reference")
    BlockQuantLinear.__call__ = real_call  # type: ignore[method-assign]
    variants = {}
    quant_block.INT8_MAX_ROWS_NO_AMX = {}  # one limit for every format: the one set below
    quant_block.BLOCK_KERNEL_MAX_ROWS = 10**9
    variants["int8 kernel"] = run("int8 kernel")
    quant_block.BLOCK_KERNEL_MAX_ROWS = 0
    variants["bfloat16 slabs"] = run("bfloat16 slabs")
    print(f"\n{os.path.basename(args.model)}: {args.num_seqs} x {args.len} random tokens, "
          f"teacher-forced, against float32 products of the dequantized blocks; load average "
          f"{os.getloadavg()[0]:.1f}")
    print("| products | greedy agreement | mean logprob error | max logprob error |")
    print("|---|---|---|---|")
    for name, lps in variants.items():
        agree = total = 0
        errs = []
        for lp, ref in zip(lps, refs):
            tok = ref.argmax(-1)
            agree += int((lp.argmax(-1) == tok).sum())
            total += tok.numel()
            errs.append((lp.gather(1, tok[:, None]) - ref.gather(1, tok[:, None])).abs().view(-1))
        e = torch.cat(errs)
        print(f"| {name} | {agree / total:.1%} | {e.mean():.4f} | {e.max():.3f} |")


if __name__ == "__main__":
    main()
