"""--async-scheduling against the serial step loop, offline, in one run.

Two engines over the same weights, one serial and one with async scheduling (step N+1
scheduled while step N's forward pass runs on a worker thread), alternate on the same
greedy, EOS-ignoring workloads:
  - one stream: one prompt of --stream-input-len tokens, --output-len new tokens;
  - batch: --num-prompts prompts of random lengths in --input-len-range, --output-len each
    (W1's shape).
Each (workload, mode) runs --repeats times, interleaved, and the best output tok/s of each is
printed with the async/serial ratio, whether both produced the same tokens, and `uptime`'s load
before and after (this is a shared 2-core machine; ratios from one run are what to compare).
Also printed: the share of the serial engine's wall time spent in ``schedule()`` and
``update_from_output()`` -- the host-side work that async scheduling can hide behind the
forward pass, hence about the most it can gain.

    .venv/bin/python benchmarks/async_scheduling.py                       # W1
    .venv/bin/python benchmarks/async_scheduling.py --model smollm2-135m-instruct
"""
from __future__ import annotations

import argparse
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
    p.add_argument("--repeats", type=int, default=2)
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
        tag: str) -> tuple[float, float, list[list[int]]]:
    """Output tok/s, seconds, and each request's tokens."""
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"{tag}-{i}", p, sp))
        tokens[f"{tag}-{i}"] = []
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            tokens[o.request_id] += o.new_token_ids
    elapsed = time.perf_counter() - t0
    out = list(tokens.values())
    return sum(map(len, out)) / elapsed, elapsed, out


def main() -> None:
    args = parse_args()
    model = str(synthetic_model_dir(args.model, seed=0)) if is_synthetic_model(args.model) \
        else args.model
    cores = {}
    for mode in (False, True):
        cores[mode] = create_engine_core(EngineArgs(
            model=model, dtype=args.dtype, num_threads=args.threads, seed=0,
            kv_cache_memory=args.kv_cache_memory, async_scheduling=mode))
    info = cores[False].model_info
    assert info is not None
    rng = np.random.default_rng(args.seed)
    lo, hi = (int(x) for x in args.input_len_range.split(":"))
    workloads = {
        "one stream": [rng.integers(0, info.vocab_size, args.stream_input_len).tolist()],
        f"{args.num_prompts} prompts": [rng.integers(0, info.vocab_size, int(n)).tolist()
                                        for n in rng.integers(lo, hi + 1, args.num_prompts)],
    }
    for core in cores.values():  # warm-up: first-call allocations, kernel selection
        run(core, [workloads["one stream"][0][:16]], 4, "warmup")
        core.reset_prefix_cache()
    print(f"model {args.model}, {args.dtype}, {info.num_threads} threads; {load()}")
    host = HostTimer(cores[False])
    for name, prompts in workloads.items():
        best: dict[bool, float] = {False: 0.0, True: 0.0}
        same = True
        host_share = 1.0
        for r in range(args.repeats):
            outs = {}
            for mode in (False, True):
                host0 = host.seconds
                rate, secs, outs[mode] = run(cores[mode], prompts, args.output_len,
                                             f"{name}-{r}")
                if not mode:
                    host_share = min(host_share, (host.seconds - host0) / secs)
                cores[mode].reset_prefix_cache()  # each repeat computes its prompts afresh
                best[mode] = max(best[mode], rate)
            same = same and outs[False] == outs[True]
        print(f"{name:>12}: serial {best[False]:8.1f} output tok/s, async {best[True]:8.1f} "
              f"output tok/s, ratio {best[True] / best[False]:.3f}, identical tokens: "
              f"{'yes' if same else 'NO'}; serial schedule+update {100 * host_share:.1f}% "
              f"of its time; {load()}")
    for core in cores.values():
        core.shutdown()


if __name__ == "__main__":
    main()
