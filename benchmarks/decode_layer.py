"""The fused decode layer (``kernels/decode_layer.c``) off, per layer, whole (layers 1..L-2
in one C call, attention included) and whole step (a pure one-row decode step in one C call:
layer 0's qkv through the final norm and, where it has the decode kernel's copy, the output
layer), in one process and one engine: the settings take turns, so a noisy neighbour hits all
alike.

Workloads:
  one-stream  the anchors harness's one-stream recipe (one 144-token prompt of random ids, 128
              output tokens, greedy, min_tokens = max_tokens, EOS ignored), ``LLM.generate``
              timed end to end per run, and the median engine step after the first (decode
              ms per step);
  throughput  ``llmtower bench throughput``'s default (64 prompts of 32-256 random tokens, 128
              output tokens, greedy, EOS ignored), the engine stepped until all are done;
  layers      no engine: 30 layers of SmolLM2's shapes (random weights) after their attention,
              ``--rows`` rows, one fused call per layer against the separate calls the model
              makes (products, add + norm, RoPE + KV write), ms per 30 layers.

Prints output tok/s per setting and run (layers: ms), the load average, and whether the
settings produced the same tokens (they must: the fused paths compute bit for bit what the
separate kernels do).

    chrt -f 1 .venv/bin/python benchmarks/decode_layer.py --dtype float32 --workload throughput
    chrt -f 1 .venv/bin/python benchmarks/decode_layer.py --dtype bfloat16 --rounds 4
    chrt -f 1 .venv/bin/python benchmarks/decode_layer.py --settings "whole,whole step" --rounds 10
    chrt -f 1 .venv/bin/python benchmarks/decode_layer.py --dtype float32 --workload layers --rows 64
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from llmtower import LLM, SamplingParams
from llmtower.bench.throughput import input_lengths, random_prompts, run_engine
from llmtower.engine.args import EngineArgs
from llmtower.engine.factory import create_engine_core
from llmtower.kernels import decode_layer as DL
from llmtower.models.default_model import default_model_dir

# setting -> (DL.MAX_ROWS, DL.WHOLE_LAYERS, DL.PREFETCH_KV, DL.WHOLE_STEP)
SETTINGS = {"off": (0, False, False, False), "per layer": (DL.MAX_ROWS, False, False, False),
            "whole, no KV prefetch": (DL.MAX_ROWS, True, False, False),
            "whole": (DL.MAX_ROWS, True, True, False),
            "whole step": (DL.MAX_ROWS, True, True, True)}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a Hugging Face folder; default: SmolLM2")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--workload", default="one-stream",
                   choices=["one-stream", "throughput", "layers"])
    p.add_argument("--rows", type=int, default=64, help="layers: rows per step")
    p.add_argument("--input-len", type=int, default=144, help="one-stream prompt length")
    p.add_argument("--num-prompts", type=int, default=64, help="throughput prompts")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--settings", default=",".join(SETTINGS),
                   help="comma-separated settings to compare (the first is the baseline)")
    return p.parse_args()


def one_stream(args: argparse.Namespace, model: str):  # type: ignore[no-untyped-def]
    """A function running the workload once: (output tokens, their ids)."""
    llm = LLM(model=model, dtype=args.dtype, num_threads=args.threads, max_model_len=2048,
              kv_cache_memory="1GiB", seed=0, enable_prefix_caching=False)
    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    rng = np.random.RandomState(0)  # the anchors harness's prompt for seed 0
    rng.randint(args.input_len, args.input_len + 1, size=1)
    prompt = rng.randint(4, vocab, size=args.input_len).tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len,
                        min_tokens=args.output_len, ignore_eos=True, seed=0)
    llm.generate([prompt[:16]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    core = llm.engine_core
    real_step = core.step
    steps: list[float] = []

    def timed_step():  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        out = real_step()
        steps.append(time.perf_counter() - t)
        return out
    core.step = timed_step  # type: ignore[method-assign]

    def run() -> tuple[int, list[int], float | None]:
        steps.clear()
        out = llm.generate([prompt], sp, use_tqdm=False)
        ids = list(out[0].outputs[0].token_ids)
        return len(ids), ids, statistics.median(steps[1:]) * 1e3
    return run


def throughput(args: argparse.Namespace, model: str):  # type: ignore[no-untyped-def]
    torch.set_num_threads(args.threads)
    core = create_engine_core(EngineArgs(model=model, dtype=args.dtype,  # type: ignore[arg-type]
                                         num_threads=args.threads))
    assert core.model_info is not None
    rng = np.random.default_rng(0)
    lengths = input_lengths(args.num_prompts, 0, 0.0, "32:256", rng)
    prompts = random_prompts(lengths, core.model_info.vocab_size, rng)
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    run_engine(core, [prompts[0][:16]], SamplingParams(temperature=0.0, max_tokens=4), "warmup")
    ids: list[int] = []
    real_step = core.step

    def step():  # type: ignore[no-untyped-def]
        out = real_step()
        for o in out.outputs:
            ids.extend(o.new_token_ids)
        return out
    core.step = step  # type: ignore[method-assign]
    count = [0]

    def run() -> tuple[int, list[int], float | None]:
        core.reset_prefix_cache()
        ids.clear()
        count[0] += 1
        _, n = run_engine(core, prompts, sp, f"run{count[0]}")
        return n, sorted(ids), None
    return run


def layers(args: argparse.Namespace) -> None:
    """The ``layers`` workload (see the top of the file)."""
    from llmtower.kernels.decode_layer import DecodeLayers, LayerParts
    from llmtower.kernels.fused_ops import FusedOps
    from llmtower.kernels.gemm_f32 import GemmF32Weight
    from llmtower.kernels.gemv_bf16 import GemvWeight
    from llmtower.models.linear import PackedWeight, linear, silu_mul

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    kind = GemvWeight if dtype == torch.bfloat16 else GemmF32Weight
    hid, inter, nh, nkv, d, n_layers, m = 576, 1536, 9, 3, 64, 30, args.rows
    g = torch.Generator().manual_seed(0)

    def w(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    ones = torch.ones(hid, dtype=dtype)
    parts = [LayerParts(kind(w(hid, nh * d)), None, ones, kind(w(inter, hid), w(inter, hid)),
                        kind(w(hid, inter)), ones, kind(w((nh + 2 * nkv) * d, hid)), None)
             for _ in range(n_layers)]
    fused_layers = DecodeLayers(parts, hid, inter, nh, nkv, d, 1e-5, dtype)
    cos, sin = torch.ones(4096, d, dtype=dtype), torch.zeros(4096, d, dtype=dtype)
    pos, slots = torch.arange(m) * 3, torch.arange(m)
    cache = torch.zeros(2, 1024, 16, nkv, d, dtype=dtype)
    fused_layers.begin_step(m, cos, sin, pos, slots)
    h, attn = (torch.randn(m, hid) * 0.01).to(dtype), torch.randn(m, nh * d).to(dtype)
    fo = FusedOps(dtype)
    packed = [tuple(PackedWeight(torch.empty(0), x) for x in (p.o, p.gate_up, p.down, p.qkv))
              for p in parts]

    def fused() -> None:
        for i in range(n_layers):
            fused_layers.layer(i, h, attn, cache)

    def separate() -> None:
        for i, (o, gate_up, down, qkv) in enumerate(packed):
            x = fo.add_rms_norm(h, linear(attn, o), parts[i].post_norm, 1e-5)
            x = fo.add_rms_norm(h, linear(silu_mul(x, gate_up, None), down), ones, 1e-5)
            fo.rope_kv_write(linear(x, qkv), nh, nkv, d, cos, sin, pos, slots, cache, False)

    times: dict[str, list[float]] = {"separate": [], "fused": []}
    load0 = os.getloadavg()[0]
    for _ in range(args.rounds):
        for name, fn in (("separate", separate), ("fused", fused)):
            best = float("inf")
            for _ in range(5):
                t = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t)
            times[name].append(best * 1e3)
    print(f"{args.dtype}, {m} rows, {n_layers} layers, {args.threads} threads, {args.rounds} "
          f"rounds (best of 5 each); load average {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    for name, r in times.items():
        print(f"{name:>9}: {statistics.median(r):6.2f} ms per 30 layers  runs: "
              + ", ".join(f"{x:.2f}" for x in r))


def main() -> None:
    args = parse_args()
    if args.workload == "layers":
        layers(args)
        return
    model = args.model or str(default_model_dir())
    run = (one_stream if args.workload == "one-stream" else throughput)(args, model)
    chosen = [s.strip() for s in args.settings.split(",")]
    rates: dict[str, list[float]] = {k: [] for k in chosen}
    step_ms: dict[str, list[float]] = {k: [] for k in chosen}
    tokens: dict[str, list[int]] = {}
    load0 = os.getloadavg()[0]
    for _ in range(args.rounds):
        for name in chosen:
            DL.MAX_ROWS, DL.WHOLE_LAYERS, DL.PREFETCH_KV, DL.WHOLE_STEP = SETTINGS[name]
            t = time.perf_counter()
            n, tokens[name], ms = run()
            rates[name].append(n / (time.perf_counter() - t))
            if ms is not None:
                step_ms[name].append(ms)
    print(f"{args.dtype}, {args.workload}, {args.threads} threads, {args.rounds} rounds; "
          f"load average {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    base = statistics.median(rates[chosen[0]])
    for name, r in rates.items():
        med = statistics.median(r)
        dec = (f", decode {statistics.median(step_ms[name]):.3f} ms/step (runs: "
               + ", ".join(f"{x:.2f}" for x in step_ms[name]) + ")") if step_ms[name] else ""
        if step_ms[name] and name != chosen[0]:  # round by round against the baseline
            diff = statistics.median(a - b for a, b in zip(step_ms[name], step_ms[chosen[0]]))
            dec += f", median paired difference {diff:+.3f} ms/step"
        print(f"{name:>22}: {med:6.1f} output tok/s ({med / base:.2f}x){dec}  runs: "
              + ", ".join(f"{x:.1f}" for x in r))
    same = len({tuple(t) for t in tokens.values()}) == 1
    print(f"greedy tokens the same in all settings: {same}")


if __name__ == "__main__":
    main()
