"""One offline run of llmtower on a GGUF file: N prompts of random token ids (seeded), each
--input tokens long, --output tokens each (EOS ignored); prints one JSON line with the
end-to-end output tok/s (prefill included, as llama-batched-bench's B x TG / T), the start-up
time and the peak RSS of this process (VmHWM). benchmarks/gguf_vs_llamacpp.sh runs it once
per cell, in a fresh process, so each peak is that run's own.

  python benchmarks/gguf_offline.py --model F.gguf --num-prompts 16 --quantization gguf
"""
from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--num-prompts", type=int, default=1)
    ap.add_argument("--input", type=int, default=144)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantization", default="gguf")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-memory", default="256MiB")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--phases", action="store_true",
                    help="also time the prompts alone (1 output token each): prefill_s, and "
                         "the decode steps' tok/s from the rest")
    ap.add_argument("--no-fused-layer", action="store_true",
                    help="decode steps through the separate block-kernel calls (A/B runs)")
    ap.add_argument("--block-kernel-max-rows", type=int, default=None,
                    help="products of more rows dequantize to bfloat16 for oneDNN, every "
                         "format (default: models/quant_block.py's int8_max_rows)")
    args = ap.parse_args()

    import torch

    from llmtower.kernels import decode_layer
    from llmtower.models import quant_block
    if args.no_fused_layer:
        decode_layer.MAX_ROWS = 0
    if args.block_kernel_max_rows is not None:
        quant_block.BLOCK_KERNEL_MAX_ROWS = args.block_kernel_max_rows
        quant_block.INT8_MAX_ROWS_NO_AMX = {}  # that limit for every format

    from llmtower import LLM, SamplingParams
    from llmtower.executor.memory_plan import rss_bytes

    t0 = time.perf_counter()
    llm = LLM(model=args.model, quantization=args.quantization, dtype=args.dtype,
              num_threads=args.threads, max_model_len=args.input + args.output + 16,
              kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=False,
              **({} if args.max_num_batched_tokens is None
                 else {"max_num_batched_tokens": args.max_num_batched_tokens}))
    start_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    vocab = llm.engine_core.executor.runner.model.config.vocab_size
    prompts = [torch.randint(100, vocab, (args.input,), generator=g).tolist()
               for _ in range(args.num_prompts)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.output, min_tokens=args.output,
                        ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    phases = {}
    if args.phases:
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                     use_tqdm=False)
        phases["prefill_s"] = round(time.perf_counter() - t, 3)
    best, best_dt = 0.0, 0.0
    for _ in range(args.runs):
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        if n_out / dt > best:
            best, best_dt = n_out / dt, dt
    if args.phases:
        steps = args.output - 1
        phases["decode_step_ms"] = round(1000 * (best_dt - phases["prefill_s"]) / steps, 1)
    _, peak = rss_bytes()
    print(json.dumps({"tok_s": round(best, 2), "start_s": round(start_s, 2),
                      "peak_rss_gb": round(peak / 1e9, 3), "file_gb": round(
                          os.path.getsize(args.model) / 1e9, 3) if os.path.isfile(args.model) else None,
                      "load": os.getloadavg()[0], **phases}))


if __name__ == "__main__":
    main()
