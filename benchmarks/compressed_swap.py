"""Compressed swap (degradation level 2, ``--swap-space-dtype int8``): what it costs in
accuracy and what it buys in host memory, on the real EngineCore.

Accuracy: ``--prompts`` random-token prompts (``--input-len`` +- 50%), greedy, ``--output-len``
tokens with logprobs, in a KV pool of ``--tight-blocks`` blocks so that most requests are
preempted by swap at least once; the swap space is ample. An uncompressed swap is the
reference (it is token-exact: tests/executor/test_exactness*); the int8 swap space is compared
with it: tokens up to each request's first divergence agree, the |logprob| error of the
sampled token is taken over those positions (mean, max).

Level 2 in action: ``--load-requests`` requests of ``--input-len`` + ``--load-output-len``
tokens submitted at once into the same tight pool with a small fixed ``--swap-space`` (by
default smaller than one request's blocks as they are, room for three as int8): the swap
space's capacity in blocks, the most requests held swapped at once, swap-outs (compressed),
preemptions that fell back to recompute (swap space full), the prompt tokens computed in all
(recomputes included: the work a fallback costs, independent of the machine's load), the
degradation levels visited, and generated tokens per second -- plain swap,
``--enable-degradation`` (int8 from level 2 on) and ``--swap-space-dtype int8`` (always). The load average is printed
beside the figures (the machine is shared: compare within one run).

    .venv/bin/python benchmarks/compressed_swap.py                      # SmolLM2
    .venv/bin/python benchmarks/compressed_swap.py --prompts 8 --load-requests 16
    .venv/bin/python benchmarks/compressed_swap.py --skip-accuracy --fake-executor  # seconds

``--fake-executor`` runs part 2's scheduling with SmolLM2's KV and swap geometry but the fake
model of the tests instead of the forward pass: the same swap decisions in seconds, and no
tok/s.
"""
from __future__ import annotations

import argparse
import os
import random
import time

import torch

from llmtower.core.outputs import EngineCoreRequest
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.args import EngineArgs
from llmtower.engine.core import EngineCore
from llmtower.core.sched.scheduler import Scheduler
from llmtower.engine.factory import create_engine_core, kv_cache_blocks, swap_layout
from llmtower.executor.fake_executor import FakeExecutor
from llmtower.models.loader import load_model_config, resolve_model_path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--tight-blocks", type=int, default=40,
                   help="KV blocks of 16 tokens: far fewer than the batch needs")
    p.add_argument("--swap-space", default="8MiB", help="the fixed host memory of part 2")
    p.add_argument("--load-requests", type=int, default=16)
    p.add_argument("--load-output-len", type=int, default=96)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-accuracy", action="store_true")
    p.add_argument("--fake-executor", action="store_true",
                   help="part 2 with the fake model (scheduling only, the model's geometry)")
    return p.parse_args()


def engine(a: argparse.Namespace, **kw) -> EngineCore:
    return create_engine_core(EngineArgs(
        model=a.model, dtype=a.dtype, num_threads=a.threads, seed=a.seed, max_model_len=1024,
        num_gpu_blocks=a.tight_blocks, preemption_mode="swap", max_num_seqs=256, **kw))


def fake_engine(a: argparse.Namespace, **kw) -> EngineCore:
    """The scheduler sized as ``engine`` would size it, over the tests' fake executor."""
    args = EngineArgs(model=a.model, dtype=a.dtype, max_model_len=1024,
                      num_gpu_blocks=a.tight_blocks, preemption_mode="swap", max_num_seqs=256,
                      **kw)
    config = load_model_config(resolve_model_path(a.model))
    dtype = getattr(torch, a.dtype)
    num_blocks, num_slots = kv_cache_blocks(args, config, dtype)
    cache = args.create_cache_config(num_blocks, num_slots, swap_layout(args, config, dtype))
    sched = Scheduler(args.create_scheduler_config(1024), cache)
    return EngineCore(sched, FakeExecutor(num_blocks, args.block_size, num_slots,
                                          vocab_size=config.vocab_size))


def run(core: EngineCore, prompts: list[list[int]], output_len: int
        ) -> tuple[dict[str, list[tuple[int, float]]], dict[str, int], dict[str, float]]:
    """(per-request (token, logprob), per-request preemptions, run figures)."""
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(str(i), p, SamplingParams(
            temperature=0.0, max_tokens=output_len, ignore_eos=True, logprobs=0)))
    out: dict[str, list[tuple[int, float]]] = {}
    preempted: dict[str, int] = {}
    sched = core.scheduler
    peak_swapped = prefill = 0
    levels: set[int] = set()
    t = time.perf_counter()
    while core.has_unfinished_requests():
        step = core.step()
        prefill += sched._last.num_prefill_tokens
        peak_swapped = max(peak_swapped, len(sched.swapped))
        levels.add(sched.degradation.level)
        for o in step.outputs:
            out.setdefault(o.request_id, []).extend(
                [(e[0], e[1]) for e in o.new_logprobs] if o.new_logprobs
                else [(t, 0.0) for t in o.new_token_ids])
            preempted[o.request_id] = o.num_preemptions
    secs = time.perf_counter() - t
    kv = sched.kv
    figures = dict(secs=secs, tok_s=sum(len(v) for v in out.values()) / secs,
                   peak_swapped=peak_swapped, swap_outs=sched.num_swap_outs,
                   compressed=sched.degradation.actions["compress"],
                   recomputes=sched.num_preemptions - sched.num_swap_outs,
                   preemptions=sched.num_preemptions, levels=max(levels), prefill=prefill,
                   swap_blocks=kv.num_cpu_blocks // kv.swap_layout.slots_per_block,
                   swap_blocks_int8=(kv.num_cpu_blocks // kv.swap_layout.slots_per_compressed_block
                                     if kv.swap_layout.compressible else 0))
    return out, preempted, figures


def compare(ref: dict, got: dict) -> tuple[float, int, float, float]:
    """(token agreement, identical sequences, mean and max |logprob error| while agreeing)."""
    same = total = identical = 0
    errs: list[float] = []
    for rid, want in ref.items():
        total += len(want)
        n = 0
        for (t0, lp0), (t1, lp1) in zip(want, got[rid]):
            if t0 != t1:
                break
            n += 1
            errs.append(abs(lp0 - lp1))
        same += n
        identical += n == len(want)
    return same / total, identical, sum(errs) / max(1, len(errs)), max(errs, default=0.0)


def main() -> None:
    a = parse_args()
    rng = random.Random(a.seed)
    lo, hi = max(1, a.input_len // 2), a.input_len * 3 // 2
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(lo, hi))]
               for _ in range(a.prompts)]
    load_prompts = [[rng.randrange(100, 40000) for _ in range(a.input_len)]
                    for _ in range(a.load_requests)]
    print(f"model {a.model} dtype {a.dtype}, {a.tight_blocks} KV blocks; load average at start "
          f"{os.getloadavg()[0]:.1f}")
    if not a.skip_accuracy:
        ref, pre, f = run(engine(a, swap_space="1GiB"), prompts, a.output_len)
        swapped = sum(1 for v in pre.values() if v)
        print(f"[accuracy] uncompressed swap (reference): {f['swap_outs']} swap-outs, "
              f"{swapped}/{a.prompts} requests swapped at least once, {f['recomputes']} "
              f"recomputes, {f['tok_s']:.1f} tok/s (load {os.getloadavg()[0]:.1f})")
        got, pre, f = run(engine(a, swap_space="1GiB", swap_space_dtype="int8"), prompts,
                          a.output_len)
        agree, identical, mean_err, max_err = compare(ref, got)
        print(f"[accuracy] int8 swap space: {f['swap_outs']} swap-outs ({f['compressed']} "
              f"compressed); token agreement {agree:.1%}, identical {identical}/{a.prompts}, "
              f"logprob error mean {mean_err:.2e} max {max_err:.2e}; {f['tok_s']:.1f} tok/s "
              f"(load {os.getloadavg()[0]:.1f})")
    variants = [("plain swap", {}),
                ("--enable-degradation", dict(enable_degradation=True)),
                ("--swap-space-dtype int8", dict(swap_space_dtype="int8"))]
    for name, kw in variants:
        core = (fake_engine if a.fake_executor else engine)(a, swap_space=a.swap_space, **kw)
        run(core, [load_prompts[0][:8]], 2)  # warm-up, outside the timed run
        _, _, f = run(core, load_prompts, a.load_output_len)
        cap = (f"{f['swap_blocks']} blocks, {f['swap_blocks_int8']} as int8"
               if f["swap_blocks_int8"] else f"{f['swap_blocks']} blocks")
        print(f"[level 2] {name:24s} --swap-space {a.swap_space} ({cap}): peak swapped "
              f"{f['peak_swapped']}, swap-outs {f['swap_outs']} ({f['compressed']} compressed), "
              f"recompute fallbacks {f['recomputes']}/{f['preemptions']} preemptions, prompt "
              f"tokens computed {f['prefill']}, max level {f['levels']}, {f['tok_s']:.1f} tok/s "
              f"(load {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
