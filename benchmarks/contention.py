"""One stream beside a busy neighbour: decode speed with and without a busy-loop process, for
fixed thread counts and for the default (the ThreadGovernor sheds threads under contention).

Each setting runs one greedy request (``--input-len`` in, ``--output-len`` out) alone, then
again while a separate process spins ``while True: pass``; settings and conditions take turns
in one process. Prints decode tok/s and the busy/quiet ratio (issue 9's target: >= 0.6), with
the load average, since "quiet" here means only "without our neighbour".

    .venv/bin/python benchmarks/contention.py
    .venv/bin/python benchmarks/contention.py --settings auto,1 --output-len 32
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import numpy as np

from llmtower.engine.args import EngineArgs
from llmtower.engine.factory import create_engine_core

from one_stream import one_request  # type: ignore[import-not-found]


def busy_loop() -> None:
    while True:
        pass


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default="none")
    p.add_argument("--settings", default="auto,2,1",
                   help="thread settings: 'auto' (the default, governed) or a fixed count")
    p.add_argument("--input-len", type=int, default=144)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    cores = {s: create_engine_core(EngineArgs(
        model=args.model, dtype=args.dtype, quantization=args.quantization,
        num_threads=0 if s == "auto" else int(s), kv_cache_memory="64MiB",
        enable_prefix_caching=False)) for s in args.settings.split(",")}
    prompt = np.random.default_rng(0).integers(0, 49152, args.input_len).tolist()
    for s, core in cores.items():
        one_request(core, prompt[:16], 4, f"warm-{s}")
    res: dict[tuple[str, str], list[float]] = {}
    load0 = os.getloadavg()[0]
    for r in range(args.rounds):
        for cond in ("without", "with"):
            neighbour = None
            if cond == "with":
                neighbour = mp.get_context("spawn").Process(target=busy_loop, daemon=True)
                neighbour.start()
                time.sleep(0.5)
            try:
                for s, core in cores.items():
                    if s == "auto":  # let the governor see the new situation
                        for _ in range(3):
                            one_request(core, prompt[:8], 2, f"look-{r}-{cond}")
                    _, tps = one_request(core, prompt, args.output_len, f"{r}-{cond}-{s}")
                    res.setdefault((s, cond), []).append(tps)
            finally:
                if neighbour is not None:
                    neighbour.kill()
                    neighbour.join()
    print(f"\none stream, {args.dtype}, quantization {args.quantization}, {args.input_len} in / "
          f"{args.output_len} out, {args.rounds} rounds (median); load average {load0:.1f} -> "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (before our neighbour)")
    print("| threads | decode tok/s without | with a busy-loop neighbour | with / without |")
    print("|---|---|---|---|")
    for s in cores:
        a = statistics.median(res[(s, "without")])
        b = statistics.median(res[(s, "with")])
        print(f"| {s} | {a:.1f} | {b:.1f} | {b / a:.2f} |")


if __name__ == "__main__":
    main()
