"""Per-step cost of decoding on the default model at batch 1 and 64: the fused C kernels against
the plain torch ops they replace, in one process (the two paths take turns, so a noisy neighbour
hits both alike).

For each batch size: ms per decode step (median), and a torch profiler table of the busiest ops
of a few steps with the number of op calls per step, which is where per-step overhead shows.

    .venv/bin/python benchmarks/step_profile.py
    .venv/bin/python benchmarks/step_profile.py --dtype bfloat16 --quantization gguf --batches 1
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from torch.profiler import ProfilerActivity, profile

from llmtower.core.outputs import EngineCoreRequest
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.args import EngineArgs
from llmtower.engine.core import EngineCore
from llmtower.engine.factory import create_engine_core


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--quantization", default="none")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads; 0: the engine's default (all CPUs, fewer under contention)")
    p.add_argument("--profile-rows", type=int, default=12)
    return p.parse_args()


def decode_steps(core: EngineCore, batch: int, prompt_len: int, steps: int, tag: str,
                 rng: np.random.Generator, prof: profile | None = None) -> list[float]:
    """Seconds of each of ``steps`` decode steps of ``batch`` requests (prefill not timed);
    ``prof`` records the decode steps only."""
    sp = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    vocab = core.model_info.vocab_size  # type: ignore[union-attr]
    for i in range(batch):
        core.add_request(EngineCoreRequest(f"{tag}-{i}", rng.integers(0, vocab, prompt_len).tolist(),
                                           sp))
    while core.scheduler.waiting or any(  # type: ignore[attr-defined]
            r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running):  # type: ignore[attr-defined]
        core.step()
    times = []
    if prof is not None:
        prof.start()
    while len(times) < steps:
        t = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t)
    if prof is not None:
        prof.stop()
    while core.has_unfinished_requests():
        core.step()
    return times


def main() -> None:
    args = parse_args()
    core = create_engine_core(EngineArgs(
        model=args.model, dtype=args.dtype, quantization=args.quantization,
        num_threads=args.threads, kv_cache_memory="512MiB", enable_prefix_caching=False))
    model = core.executor.model  # type: ignore[attr-defined]
    fused = model.fused
    if fused is None:
        raise SystemExit("the fused kernels are unavailable here (no C compiler?)")
    paths = {"fused C kernels": fused, "torch ops": None}
    rng = np.random.default_rng(0)
    decode_steps(core, 2, 16, 2, "warm", rng)
    load0 = os.getloadavg()[0]
    for batch in (int(b) for b in args.batches.split(",")):
        times: dict[str, list[float]] = {k: [] for k in paths}
        for r in range(args.rounds):
            for name, fo in paths.items():
                model.fused = fo
                times[name] += decode_steps(core, batch, args.prompt_len, args.steps,
                                            f"b{batch}-r{r}", rng)
        print(f"\nbatch {batch}, {args.dtype}, quantization {args.quantization}, "
              f"{args.threads} threads; load average {load0:.1f} -> {os.getloadavg()[0]:.1f}")
        base = statistics.median(times["torch ops"])
        for name, ts in times.items():
            m = statistics.median(ts)
            print(f"  {name:16s} {m * 1e3:7.2f} ms/step  ({base / m:.2f}x the torch ops' speed)")
        for name, fo in paths.items():
            model.fused = fo
            prof = profile(activities=[ProfilerActivity.CPU])
            decode_steps(core, batch, args.prompt_len, 4, f"p{batch}-{name}", rng, prof)
            events = prof.key_averages()
            calls = sum(e.count for e in events if e.key.startswith("aten::"))
            print(f"\n  {name}: {calls / 4:.0f} aten op calls per decode step")
            print(prof.key_averages().table(sort_by="self_cpu_time_total",
                                            row_limit=args.profile_rows))
    model.fused = fused


if __name__ == "__main__":
    main()
