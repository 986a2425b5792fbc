"""--async-scheduling against the serial step loop, offline, in one run.

Two engines over the same weights, one serial and one with async scheduling (step N+1
scheduled while step N's forward pass runs on a worker thread), each in its own process (so
that their OpenMP thread pools never meet), take turns on the same greedy, EOS-ignoring
workloads:
  - one stream: one prompt of --stream-input-len tokens, --output-len new tokens;
  - batch: --num-prompts prompts of random lengths in --input-len-range, --output-len each
    (W1's shape).
Each (workload, mode) runs --repeats times, interleaved (the order flips every repeat), and the
median output tok/s of each is printed with the async/serial ratio, the CPU time of this
process per output token (all its threads: less disturbed by other jobs than wall time), whether both produced the same tokens, and `uptime`'s load
before and after (this is a shared 2-core machine; ratios from one run are what to compare).
Also printed: the share of the serial engine's wall time spent in ``schedule()`` and
``update_from_output()`` -- the host-side work that async scheduling can hide behind the
forward pass, hence about the most it can gain.

    .venv/bin/python benchmarks/async_scheduling.py                       # W1
    .venv/bin/python benchmarks/async_scheduling.py --model smollm2-135m-instruct
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

import numpy as np

from llmtower.bench.synthetic import is_synthetic_model, synthetic_model_dir
from llmtower.core.outputs import EngineCoreRequest
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.args import EngineArgs
from llmtower.engine.core import EngineCore
from llmtower.engine.factory import create_engine_core


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="w1", help="w1 (default), a model directory or name")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len-range", default="32:256")
    p.add_argument("--stream-input-len", type=int, default=144)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workloads", default="stream,batch", help="stream, batch or both")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: the engine default)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


class HostTimer:
    """Seconds spent in the scheduler's schedule() and update_from_output() of one engine."""

    def __init__(self, core: EngineCore) -> None:
        self.seconds = 0.0
        sched = core.scheduler
        for name in ("schedule", "update_from_output"):
            setattr(sched, name, self._timed(getattr(sched, name)))

    def _timed(self, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t0
        return timed


def run(core: EngineCore, prompts: list[list[int]], output_len: int,
        tag: str) -> tuple[float, float, float, list[list[int]]]:
    """Output tok/s, seconds, CPU ms per output token, and each request's tokens."""
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    t0, cpu0 = time.perf_counter(), time.process_time()
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"{tag}-{i}", p, sp))
        tokens[f"{tag}-{i}"] = []
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            tokens[o.request_id] += o.new_token_ids
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    out = list(tokens.values())
    num_out = sum(map(len, out))
    return num_out / elapsed, elapsed, 1000 * cpu / num_out, out


def _fmt(values: list[float]) -> str:
    return "/".join(f"{v:.0f}" for v in values)


def engine_process(conn, args: argparse.Namespace, mode: bool) -> None:
    """One engine (serial or async) in its own process: runs what the parent sends."""
    model = str(synthetic_model_dir(args.model, seed=0)) if is_synthetic_model(args.model) \
        else args.model
    core = create_engine_core(EngineArgs(
        model=model, dtype=args.dtype, num_threads=args.threads, seed=0,
        kv_cache_memory=args.kv_cache_memory, async_scheduling=mode))
    assert core.model_info is not None
    host = HostTimer(core)
    conn.send((core.model_info.vocab_size, core.model_info.num_threads))
    while True:
        job = conn.recv()
        if job is None:
            break
        prompts, output_len, tag = job
        host0 = host.seconds
        rate, secs, ms, out = run(core, prompts, output_len, tag)
        core.reset_prefix_cache()  # each repeat computes its prompts afresh
        conn.send((rate, ms, (host.seconds - host0) / secs, out))
    core.shutdown()


def main() -> None:
    args = parse_args()
    ctx = mp.get_context("spawn")
    conns = {}
    procs = []
    for mode in (False, True):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=engine_process, args=(child, args, mode), daemon=True)
        proc.start()
        procs.append(proc)
        conns[mode] = parent
    vocab_size, num_threads = conns[False].recv()
    conns[True].recv()
    rng = np.random.default_rng(args.seed)
    lo, hi = (int(x) for x in args.input_len_range.split(":"))
    stream = [rng.integers(0, vocab_size, args.stream_input_len).tolist()]
    batch = [rng.integers(0, vocab_size, int(n)).tolist()
             for n in rng.integers(lo, hi + 1, args.num_prompts)]
    chosen = args.workloads.split(",")
    workloads = {name: prompts for key, name, prompts in (
        ("stream", "one stream", stream), ("batch", f"{args.num_prompts} prompts", batch))
        if key in chosen}
    for mode in (False, True):  # warm-up: first-call allocations, kernel selection
        conns[mode].send(([stream[0][:16]], 4, "warmup"))
        conns[mode].recv()
    print(f"model {args.model}, {args.dtype}, {num_threads} threads; {load()}")
    for name, prompts in workloads.items():
        rates: dict[bool, list[float]] = {False: [], True: []}
        cpu_ms: dict[bool, list[float]] = {False: [], True: []}
        same = True
        host_share = 1.0
        for r in range(args.repeats):
            outs = {}
            for mode in ((False, True) if r % 2 == 0 else (True, False)):
                conns[mode].send((prompts, args.output_len, f"{name}-{r}"))
                rate, ms, share, outs[mode] = conns[mode].recv()
                if not mode:
                    host_share = min(host_share, share)
                rates[mode].append(rate)
                cpu_ms[mode].append(ms)
            same = same and outs[False] == outs[True]
        med = {m: float(np.median(v)) for m, v in rates.items()}
        cpu = {m: float(np.median(v)) for m, v in cpu_ms.items()}
        print(f"{name:>12}: serial {med[False]:7.1f} output tok/s, async {med[True]:7.1f} "
              f"(ratio {med[True] / med[False]:.3f}; runs {_fmt(rates[False])} vs "
              f"{_fmt(rates[True])}); CPU ms/token {cpu[False]:.2f} vs {cpu[True]:.2f}; "
              f"identical tokens: {'yes' if same else 'NO'}; serial schedule+update "
              f"{100 * host_share:.1f}% of its time; {load()}", flush=True)
    for mode in (False, True):
        conns[mode].send(None)
    for proc in procs:
        proc.join(timeout=60)


if __name__ == "__main__":
    main()
