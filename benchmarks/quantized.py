"""Accuracy of the default model in bfloat16 and with quantized weights, against float32.

The reference is the float32 model with the GGUF's weights dequantized (what `--quantization
none` runs). It answers 64 chat prompts greedily (``--gen-len`` tokens each, through the
engine). Every variant then reads the same prompt + answer in one prefill (teacher forcing) and
is compared at each answer position with the reference's own teacher-forced pass:

- greedy agreement: how often the variant's argmax is the reference's token;
- logprob error: |log p_variant(token) - log p_reference(token)| of the reference's token,
  mean and max over all positions;
- prompts whose whole answer the variant would reproduce (argmax equal at every position).

    .venv/bin/python benchmarks/quantized.py
    .venv/bin/python benchmarks/quantized.py --variants bfloat16:none --num-prompts 16
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.llm import LLM
from llmtower.executor.kv_cache import KVCache
from llmtower.models.attention import AttentionMetadata, PagedAttention, PrefillSeq
from llmtower.models.llama import LlamaForCausalLM
from llmtower.models.loader import load_model_config, resolve_model_path
from llmtower.models.quant_loader import load_model_weights

SUBJECTS = ["the moon", "photosynthesis", "a binary search", "the French revolution",
            "volcanoes", "the stock market", "honey bees", "black holes", "Python lists",
            "the water cycle", "chess openings", "vaccines", "the Roman empire", "rainbows",
            "electric cars", "sleep"]
TEMPLATES = ["Explain {} to a child.", "Write a short poem about {}.",
             "Give three facts about {}.", "What is the most common misconception about {}?"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--variants", default="bfloat16:none,float32:gguf,bfloat16:gguf,"
                   "bfloat16:int8,bfloat16:int4")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args()


def teacher_forced_logprobs(model: LlamaForCausalLM, ids: list[int], start: int) -> torch.Tensor:
    """log-softmax of the logits at positions start-1 .. len-2 (predicting ids[start:])."""
    cfg, n = model.config, len(ids)
    bs = 16
    kv = KVCache(cfg, num_blocks=-(-n // bs), num_cpu_blocks=0, block_size=bs, dtype=model.dtype)
    attn = PagedAttention(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, bs,
                          model.dtype, gather_buffer_blocks=1)
    meta = AttentionMetadata(n, torch.arange(n), prefills=[PrefillSeq(0, n, 0)])
    rows = torch.arange(start - 1, n - 1)
    logits = model(torch.tensor(ids), torch.arange(n), kv.kv_caches, attn, meta, rows)
    return torch.log_softmax(logits.float(), dim=-1)


def build(model: str, dtype: str, quant: str) -> LlamaForCausalLM:
    path = resolve_model_path(model)
    cfg = load_model_config(path)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    state = load_model_weights(model, path, torch_dtype, quant)
    return LlamaForCausalLM(cfg, state, torch_dtype, 4096, quant)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    questions = [t.format(s) for t in TEMPLATES for s in SUBJECTS][:args.num_prompts]
    llm = LLM(args.model, num_threads=args.threads, kv_cache_memory="256MiB")
    t = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": q}] for q in questions],
                    SamplingParams(temperature=0.0, max_tokens=args.gen_len, ignore_eos=True),
                    use_tqdm=False)
    seqs = [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]
    print(f"reference answers: {len(seqs)} x {args.gen_len} tokens in "
          f"{time.perf_counter() - t:.0f} s", flush=True)
    del llm
    ref_model = build(args.model, "float32", "none")
    refs = [teacher_forced_logprobs(ref_model, p + a, len(p)) for p, a in seqs]
    del ref_model
    print(f"\n{len(seqs)} chat prompts x {args.gen_len} answer tokens, against float32 "
          f"(dequantized GGUF); load average {os.getloadavg()[0]:.1f}")
    print("| dtype | quantization | greedy agreement | whole answer same | mean logprob error "
          "| max logprob error |")
    print("|---|---|---|---|---|---|")
    for variant in args.variants.split(","):
        dtype, quant = variant.split(":")
        model = build(args.model, dtype, quant)
        agree = total = whole = 0
        errs = []
        for (p, a), ref in zip(seqs, refs):
            lp = teacher_forced_logprobs(model, p + a, len(p))
            tok = torch.tensor(a)
            same = lp.argmax(-1) == tok
            agree += int(same.sum())
            total += len(a)
            whole += int(bool(same.all()))
            errs.append((lp.gather(1, tok[:, None]) - ref.gather(1, tok[:, None])).abs().view(-1))
        e = torch.cat(errs)
        print(f"| {dtype} | {quant} | {agree / total:.1%} | {whole}/{len(seqs)} | "
              f"{e.mean():.4f} | {e.max():.3f} |", flush=True)
        del model


if __name__ == "__main__":
    main()
