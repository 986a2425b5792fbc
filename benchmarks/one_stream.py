"""One stream on the default model: prefill time and decode speed of a single request.

The issue's "one user chatting" case: one prompt of 144 random tokens, 128 output tokens,
greedy, EOS ignored, through the real EngineCore (scheduler + runner + model). Every variant
(dtype x quantization) is built once in this process, then the variants take turns, ``--rounds``
times, so that a noisy neighbour hits all of them alike; the medians are printed with their
ratio to the first variant, and the load average beside them (this machine is shared).

    .venv/bin/python benchmarks/one_stream.py
    .venv/bin/python benchmarks/one_stream.py --variants float32:none,bfloat16:gguf --rounds 5

Decode tok/s counts the steps after the first (prefill) one: 127 tokens over their wall time.
llama.cpp's figure to compare with (issue 9, same machine kind, Q4_1, 2 threads): 118 tok/s
decode only, 83 end to end.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from llmtower.core.outputs import EngineCoreRequest
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.args import EngineArgs
from llmtower.engine.core import EngineCore
from llmtower.engine.factory import create_engine_core


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--variants", default="float32:none,bfloat16:none,bfloat16:gguf,"
                   "bfloat16:int4,bfloat16:int8",
                   help="comma-separated dtype:quantization pairs; the first is the baseline")
    p.add_argument("--input-len", type=int, default=144)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads; 0: the engine's default (all CPUs, fewer under contention)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def one_request(core: EngineCore, prompt: list[int], output_len: int, tag: str
                ) -> tuple[float, float]:
    """(prefill seconds, decode tokens per second) of one greedy request run alone."""
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    core.add_request(EngineCoreRequest(tag, prompt, sp))
    steps: list[float] = []
    while core.has_unfinished_requests():
        t = time.perf_counter()
        core.step()
        steps.append(time.perf_counter() - t)
    decode = steps[1:]
    return steps[0], len(decode) / sum(decode)


def main() -> None:
    args = parse_args()
    variants = [tuple(v.split(":")) for v in args.variants.split(",")]
    cores: dict[tuple[str, ...], EngineCore] = {}
    for dtype, quant in variants:
        t = time.perf_counter()
        cores[(dtype, quant)] = create_engine_core(EngineArgs(
            model=args.model, dtype=dtype, quantization=quant, num_threads=args.threads,
            kv_cache_memory="64MiB", enable_prefix_caching=False))
        print(f"built {dtype}:{quant} in {time.perf_counter() - t:.1f} s", flush=True)
    rng = np.random.default_rng(args.seed)
    vocab = next(iter(cores.values())).model_info.vocab_size  # type: ignore[union-attr]
    prompt = rng.integers(0, vocab, args.input_len).tolist()
    for key, core in cores.items():  # warm up: first-call allocations, kernel selection
        one_request(core, prompt[:16], 4, f"warm-{key}")
    results: dict[tuple[str, ...], list[tuple[float, float]]] = {k: [] for k in cores}
    load0 = os.getloadavg()[0]
    for r in range(args.rounds):
        for key, core in cores.items():
            results[key].append(one_request(core, prompt, args.output_len, f"r{r}-{key}"))
    load1 = os.getloadavg()[0]
    print(f"\none stream, {args.input_len} in / {args.output_len} out, threads "
          f"{args.threads or 'auto'}, "
          f"{args.rounds} rounds (median); load average {load0:.1f} -> {load1:.1f} "
          f"on {os.cpu_count()} CPUs")
    print("| dtype | quantization | prefill ms | decode tok/s | decode vs first |")
    print("|---|---|---|---|---|")
    base = None
    for (dtype, quant), rs in results.items():
        pre = statistics.median(x[0] for x in rs) * 1e3
        dec = statistics.median(x[1] for x in rs)
        base = base or dec
        print(f"| {dtype} | {quant} | {pre:.0f} | {dec:.1f} | {dec / base:.2f}x |")


if __name__ == "__main__":
    main()
