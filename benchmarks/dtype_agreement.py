"""bfloat16 against float32 on the default model (SmolLM2-135M-Instruct): how often greedy
decoding picks the same tokens, and how far the logprobs move. This is the trade that
``--dtype auto`` makes on a CPU with native bfloat16 (docs/performance.md).

64 chat prompts, 32 greedy tokens each, EOS ignored. Reported:
- tokens identical: positions where both dtypes emit the same token, up to and including the
  first difference (after it the contexts differ and nothing more is compared), over all
  positions; and sequences identical end to end;
- first-token agreement: the first generated token is the same;
- logprob error: float32's answer scored by both dtypes (prompt_logprobs over prompt + answer,
  so both see the same context): the mean and max absolute difference of the logprob of each
  answer token, and the largest drop.

    nice .venv/bin/python benchmarks/dtype_agreement.py [--tokens 32] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from llmtower import LLM, SamplingParams

TOPICS = ["The capital of France is", "Write a short poem about the sea.", "def fibonacci(n):",
          "Explain photosynthesis to a child.", "List three uses of copper:",
          "Once upon a time, in a small village,", "What is 17 times 23?",
          "Translate to German: good morning, how are you?", "The quick brown fox",
          "Summarize the plot of Hamlet in two sentences.", "import numpy as np\nx = np.",
          "Why is the sky blue?", "A recipe for pancakes: ingredients:",
          "The three laws of thermodynamics are", "In 1969, astronauts",
          "SELECT name FROM users WHERE"]
STYLES = ["{}", "Answer briefly: {}", "Explain step by step. {}", "As a teacher would: {}"]


def prompts() -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": style.format(t)}] for style in STYLES for t in TOPICS]


def run(dtype: str, convs, tokens: int, threads: int):
    llm = LLM(dtype=dtype, num_threads=threads, max_model_len=1024, seed=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.chat(convs, greedy, use_tqdm=False)
    secs = time.perf_counter() - t0
    return llm, [list(o.outputs[0].token_ids) for o in outs], [o.prompt_token_ids for o in outs], secs


def score(llm, prompts_ids: list[list[int]], answers: list[list[int]]) -> list[list[float]]:
    """The logprob of each answer token after its prompt, under ``llm``'s dtype."""
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([p + a for p, a in zip(prompts_ids, answers)],
                        sp, use_tqdm=False)
    scored = []
    for o, p, a in zip(outs, prompts_ids, answers):
        lps = o.prompt_logprobs[len(p):]
        scored.append([lp[t].logprob for lp, t in zip(lps, a)])
    return scored


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    convs = prompts()
    f32, ans32, pids, s32 = run("float32", convs, args.tokens, args.threads)
    lp32 = score(f32, pids, ans32)
    del f32
    b16, ans16, _, s16 = run("bfloat16", convs, args.tokens, args.threads)
    lp16 = score(b16, pids, ans32)
    same = compared = 0
    for a, b in zip(ans32, ans16):
        for x, y in zip(a, b):
            compared += 1
            if x != y:
                break
            same += 1
    whole = sum(a == b for a, b in zip(ans32, ans16))
    first = sum(a[:1] == b[:1] for a, b in zip(ans32, ans16))
    diffs = [abs(x - y) for r32, r16 in zip(lp32, lp16) for x, y in zip(r32, r16)]
    drops = [x - y for r32, r16 in zip(lp32, lp16) for x, y in zip(r32, r16)]
    n = len(convs)
    print(f"{n} prompts x {args.tokens} greedy tokens, SmolLM2-135M-Instruct, "
          f"{args.threads} threads")
    print(f"  first token identical:   {first}/{n} ({100 * first / n:.1f}%)")
    print(f"  tokens identical:        {same}/{compared} ({100 * same / compared:.2f}%) up to "
          "each sequence's first difference")
    print(f"  sequences identical:     {whole}/{n} ({100 * whole / n:.1f}%)")
    print(f"  logprob |bf16 - f32| over float32's answer tokens: mean {statistics.mean(diffs):.4f}"
          f", median {statistics.median(diffs):.4f}, max {max(diffs):.4f} nats; "
          f"largest drop {max(drops):.4f}")
    print(f"  generation time: float32 {s32:.1f} s, bfloat16 {s16:.1f} s "
          f"({s32 / s16:.2f}x)")


if __name__ == "__main__":
    main()
