"""The float32 64-prompt workload before and after this page's float32 kernels, in one process
and one engine, the settings taking turns (a noisy neighbour hits all alike): decode-step GEMMs
on oneDNN or on ``kernels/gemm_f32.c`` (``models.linear.F32_KERNEL_MAX_ROWS``), fresh prefills
on SDPA or on ``kernels/prefill_attention_f32.c`` (the attention layer's ``prefill_f32``).

Part 1 (``--shapes``): the model's matrices in isolation, 30 layers' copies cycled as in a
decode step (weights from memory), ms per product for oneDNN's packed GEMM and the kernel.
Part 2: the `bench throughput` workload (SmolLM2, 64 prompts of 32-256 tokens, 128 out, greedy,
EOS ignored) per setting and round: output tok/s, and whether both settings produced the same
tokens (a row's float32 sums differ between the two in summation order only).

    chrt -f 1 .venv/bin/python benchmarks/gemm_f32.py --threads 2 --rounds 2 --shapes
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from llmtower.bench.synthetic import is_synthetic_model, synthetic_model_dir
from llmtower.bench.throughput import input_lengths, random_prompts, run_engine
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.args import EngineArgs
from llmtower.engine.factory import create_engine_core
from llmtower.kernels.gemm_f32 import GemmF32Weight
from llmtower.models import linear

# name -> (F32_KERNEL_MAX_ROWS, prefill kernel on)
SETTINGS = {"oneDNN+SDPA": (0, False), "gemm_f32+SDPA": (linear.F32_KERNEL_MAX_ROWS, False),
            "gemm_f32+prefill_f32": (linear.F32_KERNEL_MAX_ROWS, True)}
# SmolLM2's matrices (out, in); "gate+up" is the fused SwiGLU half (silu_mul).
SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate+up": (1536, 576),
          "down": (576, 1536), "lm_head": (49152, 576)}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="or w1")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len-range", default="32:256")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--shapes", action="store_true", help="also time the matrices in isolation")
    p.add_argument("--rows", default="1,8,64,128,256,512,2048")
    return p.parse_args()


def time_shapes(rows_list: list[int], layers: int = 30) -> None:
    op = torch.ops.mkldnn._linear_pointwise
    reorder = torch.ops.mkldnn._reorder_linear_weight
    print("| ms per product (30 cold copies) | rows | oneDNN | gemm_f32 | ratio |\n|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        count = 1 if name == "lm_head" else layers
        ws = [torch.randn(n, k) * 0.05 for _ in range(count)]
        if name == "gate+up":
            ups = [torch.randn(n, k) * 0.05 for _ in range(count)]
            od = [(reorder(w, 64), reorder(u, 64)) for w, u in zip(ws, ups)]
            ours = [GemmF32Weight(w, u) for w, u in zip(ws, ups)]

            def f_od(x: torch.Tensor, od=od) -> None:  # type: ignore[no-untyped-def]
                for g, u in od:
                    op.binary(x, op(x, g, None, "swish", [], ""), u, None, "mul")

            def f_ours(x: torch.Tensor, ours=ours) -> None:  # type: ignore[no-untyped-def]
                for w in ours:
                    w.silu_mul(x)
        else:
            od1 = [reorder(w, 64) for w in ws]
            ours = [GemmF32Weight(w) for w in ws]

            def f_od(x: torch.Tensor, od1=od1) -> None:  # type: ignore[no-untyped-def,misc]
                for w in od1:
                    op(x, w, None, "none", [], "")

            def f_ours(x: torch.Tensor, ours=ours) -> None:  # type: ignore[no-untyped-def,misc]
                for w in ours:
                    w(x)
        for rows in rows_list:
            x = torch.randn(rows, k)
            best = {"od": float("inf"), "ours": float("inf")}
            for _ in range(4):
                for key, fn in (("od", f_od), ("ours", f_ours)):
                    t = time.perf_counter()
                    fn(x)
                    best[key] = min(best[key], (time.perf_counter() - t) / count)
            print(f"| {name} | {rows} | {best['od'] * 1e3:.3f} | {best['ours'] * 1e3:.3f} | "
                  f"{best['od'] / best['ours']:.2f}x |", flush=True)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()[0]
    if args.shapes:
        time_shapes([int(r) for r in args.rows.split(",")])
    if is_synthetic_model(args.model):  # w1: the synthetic W1 Llama, built on first use
        args.model = str(synthetic_model_dir(args.model, seed=0))
    core = create_engine_core(EngineArgs(model=args.model, dtype="float32",
                                         num_threads=args.threads))
    assert core.model_info is not None
    rng = np.random.default_rng(0)
    lengths = input_lengths(args.num_prompts, 0, 0.0, args.input_len_range, rng)
    prompts = random_prompts(lengths, core.model_info.vocab_size, rng)
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    run_engine(core, [prompts[0][:16]], SamplingParams(temperature=0.0, max_tokens=4), "warmup")
    attn = core.executor.runner.attn  # type: ignore[attr-defined]
    kernel_ok = attn.prefill_f32
    rates: dict[str, list[float]] = {k: [] for k in SETTINGS}
    outs: dict[str, dict[str, list[int]]] = {}
    for r in range(args.rounds):
        for name, (rows, prefill) in SETTINGS.items():
            linear.F32_KERNEL_MAX_ROWS = rows
            attn.prefill_f32 = prefill and kernel_ok
            core.reset_prefix_cache()
            outs[name] = {}
            secs, n = run_engine(core, prompts, sp, f"{r}{name}", tokens=outs[name])
            rates[name].append(n / secs)
            print(f"round {r} {name:>20}: {n / secs:6.1f} output tok/s ({secs:.2f} s)", flush=True)
    load1 = os.getloadavg()[0]
    base = statistics.median(rates["oneDNN+SDPA"])
    print(f"\nfloat32, {args.num_prompts} prompts ({args.input_len_range} in, {args.output_len} "
          f"out), {args.threads} threads; load average {load0:.1f} -> {load1:.1f}")
    for name in SETTINGS:
        rate = statistics.median(rates[name])
        print(f"{name:>20}: {rate:6.1f} output tok/s ({rate / base:.3f}x)  rounds: "
              + ", ".join(f"{x:.1f}" for x in rates[name]))
    a = outs["oneDNN+SDPA"]
    for name in list(SETTINGS)[1:]:
        b = outs[name]
        same = sum(a[k] == b.get(k) for k in a)
        agree = sum(x == y for k in a for x, y in zip(a[k], b.get(k, [])))
        total = sum(len(v) for v in a.values())
        print(f"{name} vs oneDNN+SDPA: requests with identical outputs {same}/{len(a)}; tokens "
              f"equal position by position {agree}/{total}")


if __name__ == "__main__":
    main()
