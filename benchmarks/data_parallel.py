"""Data parallelism: what 1, 2 and 4 engines give on this machine, and what the machinery costs.

    .venv/bin/python benchmarks/data_parallel.py                       # W1, 1/2/4 engines
    .venv/bin/python benchmarks/data_parallel.py --engines 1 2 --num-prompts 32

For each engine count N: the same requests through ``AsyncLLM`` (all at once, as a client
flood would), output tok/s and mean / p99 TTFT. On a 2-core machine N > 1 does not scale; what
this shows is the overhead: each engine's cost of the sync (posting + waiting for the
all-reduce, per collective = per --dp-sync-interval steps, in µs), the router's decision (µs
per request), and the bytes on the wire per step (the output message of a step, the sync's
tensor). A second part, with shared system prompts, measures prefix affinity: prefix-cache
hit rate with the router's affinity on and off — on the real engines and, side by side, in the
simulator's cluster mode on the same trace (the same prompts, the same KV blocks per engine,
the same router: ``--load-balancer coordinator``).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/serving.py's tokenizer

import msgspec

from llmtower.bench.synthetic import synthetic_model_dir
from llmtower.core.outputs import EngineCoreOutput, EngineCoreOutputs
from llmtower.core.sampling_params import SamplingParams
from llmtower.distributed.dp_group import NUM_COLUMNS, DPStatus
from llmtower.distributed.routing import EngineLoad, Router
from llmtower.engine.args import EngineArgs
from llmtower.engine.async_llm import AsyncLLM
from llmtower.sim.report import build_result
from llmtower.sim.simulator import SimConfig, Simulator
from llmtower.sim.workload import TraceRequest
from serving import W1_VOCAB_SIZE, w1_tokenizer_dir


def router_cost_us(prompt_len: int, engines: int = 4, n: int = 20000) -> float:
    router = Router(block_size=16)
    loads = [EngineLoad(in_flight=i, waiting=i, running=8, kv_usage=0.5) for i in range(engines)]
    rng = random.Random(0)
    prompts = [[rng.randrange(W1_VOCAB_SIZE) for _ in range(prompt_len)] for _ in range(64)]
    t0 = time.perf_counter()
    for i in range(n):
        router.choose(loads, prompts[i % 64])
    return (time.perf_counter() - t0) / n * 1e6


def step_bytes(batch: int) -> int:
    """One decode step's output message for ``batch`` requests, as msgpack."""
    outs = EngineCoreOutputs(outputs=[EngineCoreOutput(request_id=f"cmpl-{i:032x}-0",
                                                       new_token_ids=[1234])
                                      for i in range(batch)])
    return len(msgspec.msgpack.encode(outs))


async def run_once(args, n: int, prompts: list[list[int]], affinity: bool = True):
    eargs = EngineArgs(model=str(synthetic_model_dir("w1")), tokenizer=str(w1_tokenizer_dir()),
                       data_parallel_size=n, num_threads=args.num_threads,
                       kv_cache_memory=args.kv_cache_memory,
                       dp_sync_interval=args.dp_sync_interval)
    llm = AsyncLLM(eargs)
    await llm.start()
    if n > 1 and not affinity:
        llm.client.router.prefix_aware = False
    ttft: list[float] = []
    tokens = 0

    async def one(i: int, ids: list[int]) -> None:
        nonlocal tokens
        t0 = time.perf_counter()
        first = True
        async for ro in llm.generate(None, ids, SamplingParams(
                max_tokens=args.output_len, ignore_eos=True, temperature=0.0), f"r{i}"):
            if first and ro.outputs[0].token_ids:
                ttft.append(time.perf_counter() - t0)
                first = False
            tokens += len(ro.outputs[0].token_ids)

    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        wall = time.perf_counter() - t0
        stats = await llm.get_stats()
        dp = await llm.client.call_utility_each("dp_status", result_type=DPStatus) \
            if n > 1 else []
    finally:
        llm.shutdown()
    hit = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries \
        else 0.0
    syncs = [s.num_syncs for s in dp]
    args.blocks_per_engine = stats.num_total_blocks // n
    sync_us = [s.sync_wait_seconds_total / s.num_syncs * 1e6 for s in dp if s.num_syncs]
    return dict(tok_s=tokens / wall, ttft_mean=statistics.mean(ttft) * 1e3,
                ttft_p99=sorted(ttft)[int(0.99 * (len(ttft) - 1))] * 1e3, hit=hit,
                syncs=syncs, sync_us=sync_us, steps=stats.num_steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--system-prompt-len", type=int, default=512)
    p.add_argument("--num-system-prompts", type=int, default=8)
    p.add_argument("--num-threads", type=int, default=0)
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--dp-sync-interval", type=int, default=32)
    args = p.parse_args()
    print(f"# machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"router decision: {router_cost_us(args.input_len):.1f} us/request "
          f"(4 engines, {args.input_len}-token prompts, affinity on)")
    print(f"wire: a decode step's outputs = {step_bytes(1)} B for 1 request, "
          f"{step_bytes(64)} B for 64; a sync = 2 x 4 engines x {NUM_COLUMNS} x 8 B "
          f"= {2 * 4 * NUM_COLUMNS * 8} B per engine per {args.dp_sync_interval} steps")
    rng = random.Random(0)
    flood = [[rng.randrange(W1_VOCAB_SIZE) for _ in range(args.input_len)]
             for _ in range(args.num_prompts)]
    print("\n| engines | output tok/s | mean TTFT ms | p99 TTFT ms | syncs per engine | "
          "sync cost us (per collective, per engine) |")
    print("|---|---|---|---|---|---|")
    for n in args.engines:
        r = asyncio.run(run_once(args, n, flood))
        print(f"| {n} | {r['tok_s']:.1f} | {r['ttft_mean']:.0f} | {r['ttft_p99']:.0f} | "
              f"{r['syncs'] or '-'} | {[round(x) for x in r['sync_us']] or '-'} |", flush=True)
    systems = [[rng.randrange(W1_VOCAB_SIZE) for _ in range(args.system_prompt_len)]
               for _ in range(args.num_system_prompts)]
    shared = [systems[rng.randrange(len(systems))] +
              [rng.randrange(W1_VOCAB_SIZE) for _ in range(32)] for _ in range(args.num_prompts)]
    n = max(2, min(args.engines[-1], 4))
    print(f"\nshared system prompts ({args.num_system_prompts} x {args.system_prompt_len} tokens"
          f" + 32 own), {n} engines:")
    print("| router | prefix-cache hit rate | output tok/s | mean TTFT ms |")
    print("|---|---|---|---|")
    real = {}
    for affinity in (False, True):
        real[affinity] = r = asyncio.run(run_once(args, n, shared, affinity))
        print(f"| {'load + prefix affinity' if affinity else 'load only'} | {r['hit']:.1%} | "
              f"{r['tok_s']:.1f} | {r['ttft_mean']:.0f} |", flush=True)
    print("\nthe same trace in the simulator (device 'cpu', model 'w1', "
          f"{args.blocks_per_engine} KV blocks per replica; each simulated replica has a whole "
          "machine, so only the hit rates compare):")
    print("| router | real hit rate | simulated hit rate | simulated mean TTFT ms |")
    print("|---|---|---|---|")
    trace = [TraceRequest(arrival_time=0.0, prompt_len=len(ids), output_len=args.output_len,
                          prompt_token_ids=ids, request_id=f"r{i}")
             for i, ids in enumerate(shared)]
    for affinity in (False, True):
        cfg = SimConfig(engine=EngineArgs(num_gpu_blocks=args.blocks_per_engine),
                        device="cpu", model="w1", num_replicas=n,
                        load_balancer="coordinator" if affinity else "coordinator_no_prefix")
        s = build_result(Simulator(cfg).run(trace)).summary
        print(f"| {'load + prefix affinity' if affinity else 'load only'} | "
              f"{real[affinity]['hit']:.1%} | {s['prefix_cache_hit_rate']:.1%} | "
              f"{s['ttft_ms']['mean']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
