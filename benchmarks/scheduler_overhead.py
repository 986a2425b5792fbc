"""Scheduler overhead: microseconds per schedule() and per update_from_output().

Drives the real Scheduler with the fake model (FakeExecutor, no KV verification; its own
time is not counted) and prints median and p99 for:
  (a) steady decode with 64, 256 and 1024 running requests (prompts of 128, block size 16);
  (b) a mixed stream adding 8 requests a step (prompts 64-1024, outputs 16-256,
      max_num_seqs 256) for 2,000 steps;
  (c) the same with the KV pool at a quarter of what it needs, counting preemptions.

    python benchmarks/scheduler_overhead.py [--steps 2000] [--json out.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

from llmtower.core.config import CacheConfig, SchedulerConfig
from llmtower.core.request import Request
from llmtower.core.sampling_params import SamplingParams
from llmtower.core.sched.scheduler import Scheduler
from llmtower.executor.fake_executor import FakeExecutor


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def timed_step(sched: Scheduler, ex: FakeExecutor, t_sched: list, t_upd: list) -> int:
    t0 = time.perf_counter()
    so = sched.schedule()
    t1 = time.perf_counter()
    mro = ex.execute_model(so)
    t2 = time.perf_counter()
    sched.update_from_output(so, mro)
    t3 = time.perf_counter()
    t_sched.append((t1 - t0) * 1e6)
    t_upd.append((t3 - t2) * 1e6)
    return len(so.num_scheduled_tokens)


def steady_decode(n: int, steps: int = 200) -> dict:
    bs, prompt = 16, 128
    blocks = n * ((prompt + steps + 64) // bs + 2)
    sched = Scheduler(SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=max(2048, n),
                                      max_model_len=4096),
                      CacheConfig(block_size=bs, num_blocks=blocks))
    ex = FakeExecutor(blocks, bs, vocab_size=32000, verify_kv=False)
    rng = random.Random(0)
    for i in range(n):
        sched.add_request(Request(f"r{i}", [rng.randrange(32000) for _ in range(prompt)],
                                  SamplingParams(max_tokens=steps + 1000, ignore_eos=True)))
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        timed_step(sched, ex, [], [])  # prefill: not measured
    t_s, t_u = [], []
    gc.collect()
    gc.freeze()  # what a serving engine does after start-up: long-lived state leaves the GC's scans
    for _ in range(steps):
        assert timed_step(sched, ex, t_s, t_u) == n
    med_s, med_u = statistics.median(t_s), statistics.median(t_u)
    return {"running": n, "schedule_us_median": med_s, "schedule_us_p99": pct(t_s, 0.99),
            "update_us_median": med_u, "update_us_p99": pct(t_u, 0.99),
            "us_per_request": (med_s + med_u) / n}


def mixed_stream(steps: int, kv_fraction: float) -> dict:
    bs = 16
    rng = random.Random(0)
    max_num_seqs = 256
    # Enough blocks for max_num_seqs requests of the mean size (544 + 136 tokens), times the fraction.
    need = max_num_seqs * ((544 + 136) // bs + 1)
    blocks = max(int(need * kv_fraction), (1024 + 256) // bs + 1)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=4096,
                                      max_model_len=2048),
                      CacheConfig(block_size=bs, num_blocks=blocks))
    ex = FakeExecutor(blocks, bs, vocab_size=32000, verify_kv=False)
    t_s, t_u, running = [], [], []
    rid = 0
    gc.collect()
    for _ in range(steps):
        for _ in range(8):
            plen = rng.randint(64, 1024)
            sched.add_request(Request(f"r{rid}", [rng.randrange(32000) for _ in range(plen)],
                                      SamplingParams(max_tokens=rng.randint(16, 256), ignore_eos=True)))
            rid += 1
        running.append(timed_step(sched, ex, t_s, t_u))
    return {"kv_fraction": kv_fraction, "num_blocks": blocks, "steps": steps,
            "schedule_us_median": statistics.median(t_s), "schedule_us_p99": pct(t_s, 0.99),
            "update_us_median": statistics.median(t_u), "update_us_p99": pct(t_u, 0.99),
            "mean_scheduled_reqs": statistics.mean(running), "preemptions": sched.num_preemptions,
            "finished": rid - sched.get_num_unfinished_requests()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results = {"steady_decode": [], "mixed": []}
    print("(a) steady decode, prompts 128, block size 16")
    print(f"{'running':>8} {'sched med':>10} {'sched p99':>10} {'upd med':>9} {'upd p99':>9} {'us/req/step':>12}")
    for n in (64, 256, 1024):
        r = steady_decode(n)
        results["steady_decode"].append(r)
        print(f"{n:>8} {r['schedule_us_median']:>10.1f} {r['schedule_us_p99']:>10.1f} "
              f"{r['update_us_median']:>9.1f} {r['update_us_p99']:>9.1f} {r['us_per_request']:>12.2f}")
    for label, frac in (("(b) mixed stream, ample KV", 1.0), ("(c) mixed stream, KV at 1/4", 0.25)):
        r = mixed_stream(args.steps, frac)
        results["mixed"].append(r)
        print(f"{label}: schedule {r['schedule_us_median']:.0f} us median / {r['schedule_us_p99']:.0f} p99, "
              f"update {r['update_us_median']:.0f} / {r['update_us_p99']:.0f} us, "
              f"{r['mean_scheduled_reqs']:.0f} requests per step on average, "
              f"{r['preemptions']} preemptions, {r['finished']} finished")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
