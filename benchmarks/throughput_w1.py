"""Throughput on workload W1: llmtower's engine against Hugging Face transformers' generate().

W1: 64 prompts of random tokens with lengths uniform in 32-256 (seed 0), 128 output tokens
each, ignore_eos, greedy; the model is the synthetic W1 Llama (hidden 768, 8 layers, 12 heads,
12 KV heads, intermediate 2048, vocab 16384, float32, random weights, seed 0) unless --model
says otherwise (e.g. --model smollm2-135m-instruct for the default model).

transformers runs the same prompts on the same weights in static batches of 16 (left-padded,
greedy, exactly 128 new tokens). Both run in this process, one after the other, with the
same number of torch threads. Prints both output-token rates and their ratio.

    .venv/bin/python benchmarks/throughput_w1.py            # W1, both engines
    .venv/bin/python benchmarks/throughput_w1.py --model smollm2-135m-instruct --skip-hf
    .venv/bin/python benchmarks/throughput_w1.py --attention-backend torch --skip-hf
    .venv/bin/python benchmarks/throughput_w1.py --dtype bfloat16     # both engines in bf16
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch

from llmtower.bench import throughput as tp
from llmtower.bench.synthetic import is_synthetic_model, synthetic_model_dir
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.args import EngineArgs
from llmtower.engine.factory import create_engine_core
from llmtower.models.loader import load_model_config, resolve_model_path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="w1", help="w1 (default), a model directory, a .gguf or the default model's name")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len-range", default="32:256")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weights and activations, for both engines (W1 itself is float32)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "c", "torch"],
                   help="llmtower's decode attention: the C kernel or pure PyTorch")
    p.add_argument("--skip-hf", action="store_true", help="run llmtower only")
    p.add_argument("--skip-llmtower", action="store_true", help="run transformers only")
    p.add_argument("--output-json", default=None)
    return p.parse_args()


class CpuShare:
    """How much of the machine's CPU time other processes took while a block ran, so that a
    measurement disturbed by other jobs is visible (this is a shared 2-core machine)."""

    def __enter__(self) -> "CpuShare":
        self.t0, self.busy0, self.own0 = time.perf_counter(), _busy_seconds(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self.t0
        busy = _busy_seconds() - self.busy0
        own = time.process_time() - self.own0
        cores = os.cpu_count() or 1
        self.others = max(0.0, busy - own) / (wall * cores)


def _busy_seconds() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def model_dir(name: str):
    return synthetic_model_dir(name) if is_synthetic_model(name) else resolve_model_path(name)


def run_llmtower(path, prompts, args) -> dict:
    core = create_engine_core(EngineArgs(
        model=str(path), num_threads=args.threads, kv_cache_memory=args.kv_cache_memory,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=2048, seed=args.seed,
        attention_backend=args.attention_backend, dtype=args.dtype))
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    tp.run_engine(core, [prompts[0][:16]], SamplingParams(temperature=0.0, max_tokens=4), "warmup")
    core.reset_prefix_cache()
    steps0 = core.scheduler.num_steps
    elapsed, num_out = tp.run_engine(core, prompts, sp)
    result = {"elapsed_s": elapsed, "output_tokens": num_out, "output_tok_per_s": num_out / elapsed,
              "steps": core.scheduler.num_steps - steps0, "preemptions": core.scheduler.num_preemptions,
              "attention_backend": core.executor.runner.attn.backend}
    core.shutdown()
    return result


def run_hf(path, prompts, args) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, args.dtype)).eval()
    gen = model.generation_config
    gen.eos_token_id = None  # ignore_eos
    gen.pad_token_id = 0
    bsz = args.hf_batch_size
    with torch.inference_mode():
        warm = torch.tensor([prompts[0][:16]])
        model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, do_sample=False,
                       generation_config=gen)
        num_out = 0
        t0 = time.perf_counter()
        for b in range(0, len(prompts), bsz):
            batch = prompts[b:b + bsz]
            width = max(len(p) for p in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for i, p in enumerate(batch):  # left padding, as decoder-only generation needs
                ids[i, width - len(p):] = torch.tensor(p)
                mask[i, width - len(p):] = 1
            out = model.generate(ids, attention_mask=mask, max_new_tokens=args.output_len,
                                 min_new_tokens=args.output_len, do_sample=False, generation_config=gen)
            num_out += (out.shape[1] - width) * len(batch)
        elapsed = time.perf_counter() - t0
    return {"elapsed_s": elapsed, "output_tokens": num_out, "output_tok_per_s": num_out / elapsed}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    path = model_dir(args.model)
    vocab = load_model_config(path).vocab_size
    ns = argparse.Namespace(seed=args.seed, num_prompts=args.num_prompts, input_len=0,
                            random_range_ratio=0.0, input_len_range=args.input_len_range)
    prompts = tp.make_prompts(ns, vocab)
    print(f"model {args.model} ({path}), {len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, "
          f"{args.output_len} output tokens each, {args.threads} threads, {args.dtype}")
    results: dict = {"model": args.model, "threads": args.threads, "dtype": args.dtype}
    if not args.skip_llmtower:
        with CpuShare() as share:
            results["llmtower"] = r = run_llmtower(path, prompts, args)
        r["cpu_taken_by_others"] = share.others
        print(f"llmtower:     {r['output_tok_per_s']:7.1f} output tok/s  ({r['elapsed_s']:.1f} s, "
              f"{r['steps']} steps, {r['attention_backend']} attention; other processes took {share.others:.0%} of the CPU)", flush=True)
        gc.collect()
    if not args.skip_hf:
        with CpuShare() as share:
            results["transformers"] = h = run_hf(path, prompts, args)
        h["cpu_taken_by_others"] = share.others
        print(f"transformers: {h['output_tok_per_s']:7.1f} output tok/s  ({h['elapsed_s']:.1f} s, "
              f"static batches of {args.hf_batch_size}; other processes took {share.others:.0%} "
              "of the CPU)", flush=True)
    if "llmtower" in results and "transformers" in results:
        results["ratio"] = results["llmtower"]["output_tok_per_s"] / results["transformers"]["output_tok_per_s"]
        print(f"ratio llmtower / transformers: {results['ratio']:.2f}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
