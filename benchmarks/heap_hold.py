"""The 64-prompt workload with the engine's heap holding its freed pages (the default,
``executor/memory_bounds.hold_freed_pages``) or with glibc's own trim / mmap thresholds
(``LLMTOWER_MALLOC_HOLD=0``): output tok/s, page faults (minor) and seconds of the steps with a
prefill and of the pure decode steps.

``mallopt`` is process-wide and cannot be undone to glibc's adaptive defaults, so the two
settings run in separate processes, taking turns (``--rounds`` pairs); each process runs the
workload ``--runs`` times after a warm-up and reports its best run.

    chrt -f 1 .venv/bin/python benchmarks/heap_hold.py --dtype float32 --rounds 2
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

CHILD = "--child"


def child(args: argparse.Namespace) -> None:
    import numpy as np
    import torch

    from llmtower.bench.throughput import input_lengths, random_prompts, run_engine
    from llmtower.core.sampling_params import SamplingParams
    from llmtower.engine.args import EngineArgs
    from llmtower.engine.factory import create_engine_core

    torch.set_num_threads(args.threads)
    core = create_engine_core(EngineArgs(model=args.model, dtype=args.dtype,
                                         num_threads=args.threads))
    assert core.model_info is not None
    rng = np.random.default_rng(0)
    lengths = input_lengths(args.num_prompts, 0, 0.0, args.input_len_range, rng)
    prompts = random_prompts(lengths, core.model_info.vocab_size, rng)
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    run_engine(core, [prompts[0][:16]], SamplingParams(temperature=0.0, max_tokens=4), "warmup")
    ex = core.executor
    inner = ex.execute_model
    split = {"prefill_s": 0.0, "decode_s": 0.0}

    def timed(so):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        out = inner(so)
        dt = time.perf_counter() - t
        decode = all(n == 1 for n in so.num_scheduled_tokens.values())
        split["decode_s" if decode else "prefill_s"] += dt
        return out

    ex.execute_model = timed  # type: ignore[method-assign]
    best: dict[str, float] = {}
    for r in range(args.runs):
        core.reset_prefix_cache()
        split.update(prefill_s=0.0, decode_s=0.0)
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        elapsed, n_out = run_engine(core, prompts, sp, f"r{r}")
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        if not best or n_out / elapsed > best["tok_s"]:
            best = {"tok_s": n_out / elapsed, "faults": faults, **split}
    best["load"] = os.getloadavg()[0]
    print(json.dumps(best))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len-range", default="32:256")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument(CHILD, action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    argv = [a for a in sys.argv[1:] if a != CHILD]
    res: dict[str, list[dict[str, float]]] = {"glibc defaults": [], "held (default)": []}
    for _ in range(args.rounds):
        for name, hold in (("glibc defaults", "0"), ("held (default)", "1")):
            env = dict(os.environ, LLMTOWER_MALLOC_HOLD=hold)
            out = subprocess.run([sys.executable, __file__, CHILD, *argv], env=env,
                                 capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            res[name].append(r)
            print(f"{name:15s} {r['tok_s']:7.1f} output tok/s  faults {r['faults']:8.0f}  "
                  f"prefill steps {r['prefill_s']:5.2f} s  decode steps {r['decode_s']:5.2f} s  "
                  f"load {r['load']:.1f}", flush=True)
    a, b = (sorted(x["tok_s"] for x in res[k]) for k in res)
    print(f"median: glibc defaults {a[len(a) // 2]:.1f}, held {b[len(b) // 2]:.1f} output tok/s "
          f"({b[len(b) // 2] / a[len(a) // 2]:.3f}x)")


if __name__ == "__main__":
    main()
