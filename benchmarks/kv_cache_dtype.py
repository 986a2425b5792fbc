"""--kv-cache-dtype: accuracy, capacity and throughput of an int8 (or bfloat16) KV cache vs
the model's float32 one, on the real EngineCore.

Accuracy: ``--prompts`` random-token prompts (``--input-len`` +- 50%), greedy, ``--output-len``
tokens each with their logprobs, all in one batch with ample KV memory; for each variant, per
request, the tokens up to the first divergence from the float32-KV run count as agreeing, and
the |logprob| error of the sampled token is taken over those agreeing positions (mean, max).
Capacity and throughput: ``--load-requests`` requests of ``--input-len`` + ``--output-len``
tokens submitted at once into a fixed ``--kv-cache-memory``: KV blocks, the peak number of
requests running at once, preemptions, and generated tokens per second over the whole run.
The load average is printed beside the figures (the machine is shared: compare ratios).

    .venv/bin/python benchmarks/kv_cache_dtype.py                       # SmolLM2, 64 prompts
    .venv/bin/python benchmarks/kv_cache_dtype.py --prompts 16 --variants auto,int8
    .venv/bin/python benchmarks/kv_cache_dtype.py --model w1 --skip-accuracy  # W1 (random weights)
"""
from __future__ import annotations

import argparse
import os
import random
import time

from llmtower.core.outputs import EngineCoreRequest
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.args import EngineArgs
from llmtower.engine.core import EngineCore
from llmtower.engine.factory import create_engine_core
from llmtower.bench.synthetic import is_synthetic_model, synthetic_model_dir
from llmtower.models.loader import load_model_config, resolve_model_path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="a model name or folder, or 'w1' (the synthetic W1 Llama, built on first use)")
    p.add_argument("--skip-accuracy", action="store_true",
                   help="only the capacity/throughput run (W1's random weights make the "
                        "accuracy figures meaningless)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--variants", default="auto,bfloat16,int8",
                   help="comma-separated --kv-cache-dtype values; the first is the reference")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--kv-cache-memory", default="24MiB",
                   help="the fixed KV memory of the capacity/throughput run")
    p.add_argument("--load-requests", type=int, default=24)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def engine(a: argparse.Namespace, kv: str, **kw) -> EngineCore:
    return create_engine_core(EngineArgs(
        model=model_path(a.model), dtype=a.dtype, kv_cache_dtype=kv, num_threads=a.threads, seed=a.seed,
        attention_backend=a.attention_backend, max_model_len=1024, **kw))


def model_path(name: str) -> str:
    """A synthetic model's folder (``w1``), else the name as given."""
    if is_synthetic_model(name):
        return str(synthetic_model_dir(name))
    return name


def run(core: EngineCore, prompts: list[list[int]], output_len: int, logprobs: bool
        ) -> tuple[dict[str, list[tuple[int, float]]], float, int]:
    """(per-request (token, logprob), wall seconds, peak running requests)."""
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(str(i), p, SamplingParams(
            temperature=0.0, max_tokens=output_len, ignore_eos=True,
            logprobs=0 if logprobs else None)))
    out: dict[str, list[tuple[int, float]]] = {}
    peak = 0
    t = time.perf_counter()
    while core.has_unfinished_requests():
        so = core.step()
        peak = max(peak, len(core.scheduler.running))
        for o in so.outputs:
            if logprobs:
                out.setdefault(o.request_id, []).extend((e[0], e[1]) for e in o.new_logprobs)
            else:
                out.setdefault(o.request_id, []).extend((tok, 0.0) for tok in o.new_token_ids)
    return out, time.perf_counter() - t, peak


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
    return same / total, identical, sum(errs) / len(errs), max(errs)


def main() -> None:
    a = parse_args()
    variants = a.variants.split(",")
    rng = random.Random(a.seed)
    vocab = min(40000, load_model_config(resolve_model_path(model_path(a.model))).vocab_size)
    lo, hi = max(1, a.input_len // 2), a.input_len * 3 // 2
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))]
               for _ in range(a.prompts)]
    load_prompts = [[rng.randrange(100, vocab) for _ in range(a.input_len)]
                    for _ in range(a.load_requests)]
    print(f"model {a.model} dtype {a.dtype}; load average at start {os.getloadavg()[0]:.1f}")
    ref = None
    for kv in ([] if a.skip_accuracy else variants):
        core = engine(a, kv, kv_cache_memory="512MiB", max_num_seqs=max(64, a.prompts))
        out, secs, _ = run(core, prompts, a.output_len, logprobs=True)
        if ref is None:
            ref = out
            print(f"[accuracy] {kv:9s} reference: {a.prompts} prompts x {a.output_len} tokens "
                  f"in {secs:.1f}s")
        else:
            agree, identical, mean_err, max_err = compare(ref, out)
            print(f"[accuracy] {kv:9s} vs {variants[0]}: token agreement {agree:.1%}, identical "
                  f"{identical}/{a.prompts}, logprob error mean {mean_err:.2e} max {max_err:.2e} "
                  f"({secs:.1f}s, load {os.getloadavg()[0]:.1f})")
        del core
    base = None
    for kv in variants:
        core = engine(a, kv, kv_cache_memory=a.kv_cache_memory, max_num_seqs=256)
        # Warm up (first-call allocations, oneDNN primitives) outside the timed run.
        run(core, [load_prompts[0][:8]], 2, logprobs=False)
        core.scheduler.num_preemptions = 0
        blocks = core.scheduler.kv.num_blocks if hasattr(core.scheduler.kv, "num_blocks") else \
            core.executor.kv_cache.num_blocks
        out, secs, peak = run(core, load_prompts, a.output_len, logprobs=False)
        tps = sum(len(v) for v in out.values()) / secs
        base = base or tps
        print(f"[capacity] {kv:9s} --kv-cache-memory {a.kv_cache_memory}: {blocks} blocks, "
              f"peak running {peak}/{a.load_requests}, preemptions "
              f"{core.scheduler.num_preemptions}, {tps:.1f} tok/s ({tps / base:.2f}x) "
              f"(load {os.getloadavg()[0]:.1f})")
        del core


if __name__ == "__main__":
    main()
