"""Per-step cost of decoding on the default model with the float weights pre-packed for oneDNN
(``models/linear.py``, the default) and with plain row-major weights (before), at batch 1 and
64, in one process: the two models take turns, so a noisy neighbour hits both alike.

For each batch size and weight layout: ms per decode step (median wall time and median CPU time
of this thread; with ``--threads 1``, the default here, the CPU time is what a step costs
whatever else runs on the machine), and where a step's time goes, from cProfile with this
thread's CPU clock (one thread) or the wall clock (more threads: their work is waited for in
this thread; run it at ``chrt -f 1`` on a shared machine): the GEMMs, the paged decode attention kernel, the fused C kernels, the
logits (``.float()``) and sampling; the rest (Python, bookkeeping, small torch ops) is the
step's unprofiled CPU time less those parts (cProfile's own cost would inflate it).

    .venv/bin/python benchmarks/weight_packing.py --dtype bfloat16
    .venv/bin/python benchmarks/weight_packing.py --dtype float32 --batches 1
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time

import numpy as np
import torch

import llmtower.models.llama as llama_module
from llmtower.core.outputs import EngineCoreRequest
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.args import EngineArgs
from llmtower.engine.core import EngineCore
from llmtower.engine.factory import create_engine_core
from llmtower.models import linear

# cProfile function names -> the part of a step they are.
CATEGORIES = {
    "GEMMs (oneDNN)": ("_linear_pointwise", "_weight_int4pack_mm", "_weight_int8pack_mm"),
    "decode attention (C)": ("paged_decode", "paged_decode_mq", "paged_decode_kv"),
    "fused C ops": ("add_rms_norm", "rope_kv_write", "silu_mul"),
    "logits + sampling": ("'float'", "'argmax'", "log_softmax", "'clone'", "'topk'"),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--batches", default="1,64")
    p.add_argument("--prompt-len", type=int, default=144)
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args()


def start(core: EngineCore, batch: int, prompt_len: int, steps: int, tag: str,
          rng: np.random.Generator) -> None:
    """Admit ``batch`` requests and run their prefill (not timed)."""
    sp = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    vocab = core.model_info.vocab_size  # type: ignore[union-attr]
    for i in range(batch):
        core.add_request(EngineCoreRequest(f"{tag}-{i}",
                                           rng.integers(0, vocab, prompt_len).tolist(), sp))
    sched = core.scheduler
    while sched.waiting or any(  # type: ignore[attr-defined]
            r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):  # type: ignore[attr-defined]
        core.step()


def finish(core: EngineCore) -> None:
    while core.has_unfinished_requests():
        core.step()


def timed_steps(core: EngineCore, steps: int) -> list[tuple[float, float]]:
    """(wall s, thread CPU s) of each of ``steps`` decode steps."""
    out = []
    for _ in range(steps):
        w, c = time.perf_counter(), time.thread_time()
        core.step()
        out.append((time.perf_counter() - w, time.thread_time() - c))
    return out


def breakdown(core: EngineCore, steps: int, clock) -> dict[str, float]:
    """ms per step by part (cProfile with ``clock``); the rest is the profiled steps' own time
    (``clock``, outside the profiler) less the parts, so it carries cProfile's overhead."""
    prof = cProfile.Profile(timer=clock)
    t = clock()
    prof.enable()
    for _ in range(steps):
        core.step()
    prof.disable()
    elapsed = clock() - t
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    parts = dict.fromkeys(CATEGORIES, 0.0)
    for (_file, _line, name), (_cc, _nc, tottime, _ct, _callers) in stats.items():
        for part, names in CATEGORIES.items():
            if any(n.strip("'") == name or n in name for n in names):
                parts[part] += tottime
                break
    parts["the rest (Python, small torch ops)"] = elapsed - sum(parts.values())
    parts["total (profiled steps)"] = elapsed
    return {k: 1e3 * v / steps for k, v in parts.items()}


def main() -> None:
    args = parse_args()
    if linear.prepack is linear._identity:
        raise SystemExit("this torch has no oneDNN weight packing: nothing to compare")
    cores: dict[str, EngineCore] = {}
    for name in ("plain weights (before)", "packed weights"):
        llama_module.prepack = linear.prepack if name == "packed weights" else linear._identity
        cores[name] = create_engine_core(EngineArgs(
            model=args.model, dtype=args.dtype, num_threads=args.threads,
            kv_cache_memory="512MiB", enable_prefix_caching=False))
    llama_module.prepack = linear.prepack
    rng = np.random.default_rng(0)
    one = torch.get_num_threads() == 1
    clock, label = (time.thread_time, "CPU") if one else (time.perf_counter, "wall")
    for name, core in cores.items():
        start(core, 2, 16, 2, f"warm-{name}", rng)
        finish(core)
    for batch in (int(b) for b in args.batches.split(",")):
        load0 = os.getloadavg()[0]
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in cores}
        parts: dict[str, list[dict[str, float]]] = {k: [] for k in cores}
        for r in range(args.rounds):
            for name, core in cores.items():
                start(core, batch, args.prompt_len, args.steps + 4, f"b{batch}-r{r}", rng)
                times[name] += timed_steps(core, args.steps)
                parts[name].append(breakdown(core, 4, clock))
                finish(core)
        print(f"\nbatch {batch}, {args.dtype}, {torch.get_num_threads()} thread(s), context "
              f"{args.prompt_len}+; load average {load0:.1f} -> {os.getloadavg()[0]:.1f}")
        base = statistics.median(c for _, c in times["plain weights (before)"])
        for name, ts in times.items():
            wall = statistics.median(w for w, _ in ts)
            cpu = statistics.median(c for _, c in ts)
            print(f"  {name:24s} {wall * 1e3:8.2f} ms/step wall  {cpu * 1e3:8.2f} ms/step CPU "
                  f"({base / cpu:.2f}x)")
        print(f"  {label} ms per step by part (cProfile, 4 steps a round, median of rounds):")
        names = list(cores)
        print(f"    {'':38s}" + "".join(f"{n:>26s}" for n in names))
        for part in parts[names[0]][0]:
            print(f"    {part:38s}" + "".join(
                f"{statistics.median(p[part] for p in parts[n]):26.2f}" for n in names))


if __name__ == "__main__":
    main()
