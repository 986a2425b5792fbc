"""SmolLM2 in float32: llmtower's greedy answers with this page's float32 kernels on and off
(``models.linear.F32_KERNEL_MAX_ROWS``, the attention layer's float32 prefill kernel) against
transformers' ``generate()``, 16 chat prompts x 48 tokens, EOS ignored.

    chrt -f 1 .venv/bin/python benchmarks/f32_exactness.py
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmtower.kernels import ops
from llmtower.models import linear as L
from llmtower.models.default_model import default_model_dir
from tests.executor.exactness_helpers import add_greedy, hf_greedy, make_engine, run_all

TEXTS = ["The capital of France is", "Write a short poem about the sea.", "def fibonacci(n):",
         "Explain photosynthesis to a child.", "List three uses of copper:",
         "Once upon a time, in a small village,", "What is 17 times 23?",
         "Translate to German: good morning, how are you?", "The quick brown fox",
         "Summarize the plot of Hamlet in two sentences.", "import numpy as np\nx = np.",
         "Q: Why is the sky blue?\nA:", "A recipe for pancakes: ingredients:",
         "The three laws of thermodynamics are", "In 1969, astronauts",
         "SELECT name FROM users WHERE"]


def ours(model: str, prompts: list[list[int]], n: int, on: bool, threads: int) -> list[list[int]]:
    rows = L.F32_KERNEL_MAX_ROWS
    L.F32_KERNEL_MAX_ROWS = rows if on else 0
    caps = ops.capabilities
    if not on:
        off = caps().without("prefill_f32", "off")
        ops.capabilities = lambda: off  # type: ignore[assignment]
    try:
        core = make_engine(Path(model), dtype="float32", num_threads=threads, block_size=16,
                           max_model_len=1024, num_gpu_blocks=512)
        add_greedy(core, prompts, n)
        out = run_all(core)
    finally:
        ops.capabilities = caps  # type: ignore[assignment]
    if not on:
        L.F32_KERNEL_MAX_ROWS = rows
    return [out[str(i)] for i in range(len(prompts))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    from transformers import AutoTokenizer
    model = str(default_model_dir())
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}],
                                                  add_generation_prompt=True, tokenize=False))
               for t in TEXTS]
    results = {"kernels on": ours(model, prompts, args.tokens, True, args.threads),
               "kernels off": ours(model, prompts, args.tokens, False, args.threads)}
    hf = hf_greedy(Path(model), prompts, args.tokens)
    for name, got in results.items():
        same = sum(a == b for a, b in zip(got, hf))
        first = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
                 for a, b in zip(got, hf)]
        print(f"{name}: {same}/{len(hf)} answers identical to transformers; first differing "
              f"token per prompt: {first}")


if __name__ == "__main__":
    main()
