"""Where the time of an offline throughput run goes, per kind of work, with the GEMM roofline.

Runs the workload of `llmtower bench throughput` (default: SmolLM2, 64 prompts of 32-256 tokens,
128 output tokens, greedy, EOS ignored) once unprofiled (output tok/s) and once under cProfile
(wall clock), and splits the profiled run into GEMMs, decode attention (C kernel), prefill
attention (SDPA), the fused C ops, logits / sampler, and the rest (scheduler, runner, Python).
cProfile adds ~1 us per Python call, so the shares carry a few percent of its own cost.

It also prints the roofline: the workload's GEMM FLOPs (prefill + decode rows through the
layers, the output layer on the sampled rows only) divided by the GEMM rate oneDNN reaches on
this model's shapes in isolation, at the run's real row counts (measured here, same threads).

    chrt -f 1 .venv/bin/python benchmarks/throughput_profile.py --dtype bfloat16 --threads 2
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np
import torch

from llmtower.bench.throughput import input_lengths, random_prompts, run_engine
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.args import EngineArgs
from llmtower.engine.factory import create_engine_core
from llmtower.models.linear import linear, prepack

# (category, predicate on a pstats key (file, line, name)): cumulative time of these functions
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    # every oneDNN product goes through models/linear.py's linear or silu_mul (the output layer
    # too: its share is printed on its own line below, inside this one)
    ("GEMMs (oneDNN, gemm_f32), all", ("linear:linear.py", "silu_mul:linear.py")),
    ("decode attention (C kernel)", ("paged_decode", "paged_decode_mq", "paged_decode_kv")),
    ("prefill attention (C kernel or SDPA)", ("prefill_attention", "prefill_attention_f32",
                                              "_fresh_prefill", "_prefill_with_context")),
    ("fused C ops (norm, RoPE+KV, SiLU)", ("add_rms_norm", "rope_kv_write", "silu_mul:fused_ops.py")),
    ("sampler (argmax)", ("__call__:sampler.py",)),
    # decode steps of up to 256 rows run each layer's products, norms, RoPE and KV write (and,
    # for whole layers, the attention) in one C call: the GEMMs above no longer include them
    ("fused decode layers (kernels/decode_layer.c)", ("layer:decode_layer.py",
                                                     "attend_and_layers:decode_layer.py")),
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len-range", default="32:256")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-num-batched-tokens", type=int, default=0, help="0: the engine default")
    p.add_argument("--top", type=int, default=0, help="also print the top N functions by own time")
    return p.parse_args()


def _match(key: tuple[str, int, str], pattern: str) -> bool:
    name, _, file = pattern.partition(":")
    return key[2] == name and (not file or key[0].endswith(file))


def gemm_rate(hidden: int, inter: int, qkv: int, rows: int, dtype: torch.dtype, reps: int = 5) -> float:
    """GFLOP/s of one layer's four GEMMs (qkv, o, gate+up, down) at ``rows`` rows, packed."""
    shapes = [(qkv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
    ws = [prepack(torch.randn(o, i).to(dtype)) for o, i in shapes]
    xs = [torch.randn(rows, i).to(dtype) for _, i in shapes]
    flops = sum(2 * rows * o * i for o, i in shapes)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for x, w in zip(xs, ws):
            linear(x, w)
        best = min(best, time.perf_counter() - t)
    return flops / best / 1e9


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    kw = {"model": args.model, "dtype": args.dtype, "num_threads": args.threads}
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    core = create_engine_core(EngineArgs(**kw))  # type: ignore[arg-type]
    assert core.model_info is not None
    rng = np.random.default_rng(0)
    lo, hi = (int(x) for x in args.input_len_range.split(":"))
    lengths = input_lengths(args.num_prompts, 0, 0.0, args.input_len_range, rng)
    prompts = random_prompts(lengths, core.model_info.vocab_size, rng)
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    run_engine(core, [prompts[0][:16]], SamplingParams(temperature=0.0, max_tokens=4), "warmup")
    core.reset_prefix_cache()

    # Row counts per step, from the scheduler's outputs of an unprofiled run.
    sched = core.scheduler
    steps0 = sched.num_steps  # type: ignore[attr-defined]
    elapsed, n_out = run_engine(core, prompts, sp, "plain")
    steps = sched.num_steps - steps0  # type: ignore[attr-defined]
    n_in = int(sum(lengths))
    print(f"unprofiled: {elapsed:.2f} s, {n_out / elapsed:.1f} output tok/s, {steps} steps "
          f"({n_in} prompt + {n_out} output tokens)")
    core.reset_prefix_cache()

    prof = cProfile.Profile()
    prof.enable()
    t0 = time.perf_counter()
    run_engine(core, prompts, sp, "prof")
    wall = time.perf_counter() - t0
    prof.disable()
    stats = pstats.Stats(prof)
    raw = stats.stats  # type: ignore[attr-defined]
    print(f"\nprofiled: {wall:.2f} s wall")
    print(f"{'what':40s} {'s':>7s} {'share':>6s}")
    accounted = 0.0
    for label, pats in CATEGORIES:
        s = sum(v[3] for k, v in raw.items() if any(_match(k, p) for p in pats))
        accounted += s
        print(f"{label:40s} {s:7.2f} {s / wall:6.1%}")
    print(f"{'the rest (scheduler, runner, Python)':40s} {wall - accounted:7.2f} {(wall - accounted) / wall:6.1%}")
    out_layer = sum(v[3] for k, v in raw.items() if _match(k, "_logits"))
    print(f"{'  of which: output layer + .float()':40s} {out_layer:7.2f} {out_layer / wall:6.1%}  (inside GEMMs)")
    if args.top:
        stats.sort_stats("tottime").print_stats(args.top)

    # Roofline: the workload's GEMM FLOPs at the measured isolated GEMM rate.
    cfg = core.model_info
    mc = core.executor.model.config  # type: ignore[attr-defined]
    hidden, inter, layers = mc.hidden_size, mc.intermediate_size, mc.num_hidden_layers
    qkv = (mc.num_attention_heads + 2 * mc.num_key_value_heads) * mc.head_dim
    per_tok = 2 * layers * (hidden * qkv + hidden * hidden + 2 * hidden * inter + inter * hidden)
    head = 2 * hidden * cfg.vocab_size
    flops = (n_in + n_out) * per_tok + n_out * head
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    big, small = gemm_rate(hidden, inter, qkv, 2048, dtype), gemm_rate(hidden, inter, qkv, 64, dtype)
    w_head = prepack(torch.randn(cfg.vocab_size, hidden).to(dtype))
    x_head = torch.randn(64, hidden).to(dtype)
    head_rate = (2 * 64 * hidden * cfg.vocab_size) / min(
        _time(lambda: linear(x_head, w_head)) for _ in range(3)) / 1e9
    t_gemm = n_in * per_tok / (big * 1e9) + n_out * per_tok / (small * 1e9) + n_out * head / (head_rate * 1e9)
    print(f"\nroofline: {flops / 1e12:.2f} TFLOP of GEMMs; layers at {big:.0f} GFLOP/s "
          f"(2048 rows) for prompt tokens and {small:.0f} (64 rows) for output tokens, the "
          f"output layer at {head_rate:.0f}: {t_gemm:.2f} s minimum, i.e. at most "
          f"{n_out / t_gemm:.0f} output tok/s with everything else free")


def _time(fn) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
