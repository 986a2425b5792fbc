"""TTFT of the first request that shares a long system prompt: preloaded vs cold.

The offline LLM on SmolLM2-135M-Instruct (the default model) with a ~1,000-token system
prompt. Each round takes a fresh prefix cache and asks one chat question behind that system
prompt, timing its first token (``LLM.stream``): cold (nothing cached) and after
``LLM.preload`` of the system message (rendered without the generation prompt, as `llmtower
preload` does with a JSONL 'messages' line). The preload itself is timed too. Medians of
``--rounds`` rounds are printed, and their ratio.

    .venv/bin/python benchmarks/prefix_preload.py [--rounds 5] [--threads 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

WORDS = ("billing invoice refund account customer payment subscription plan upgrade "
         "downgrade receipt tax region currency support policy escalation").split()


def system_prompt(llm, target_tokens: int) -> str:
    """Sentences of policy text until the rendered system message has ``target_tokens``."""
    parts = ["You are the billing assistant of ACME. Follow these policies exactly."]
    i = 0
    while True:
        text = " ".join(parts)
        n = len(llm.render_chat([{"role": "system", "content": text}], False)[1])
        if n >= target_tokens:
            return text
        w = WORDS
        parts.append(f"Policy {i}: a {w[i % len(w)]} about a {w[(3 * i) % len(w)]} goes to the "
                     f"{w[(7 * i) % len(w)]} team within {i % 9 + 1} days.")
        i += 1


def ttft(llm, messages) -> float:
    from llmtower.core.sampling_params import SamplingParams

    t0 = time.perf_counter()
    it = llm.stream_chat(messages, SamplingParams(temperature=0.0, max_tokens=4))
    next(it)
    dt = time.perf_counter() - t0
    for _ in it:
        pass
    return dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--system-tokens", type=int, default=1000)
    args = p.parse_args()
    from llmtower.engine.llm import LLM

    llm = LLM(num_threads=args.threads, max_model_len=2048, kv_cache_memory="256MiB")
    system = system_prompt(llm, args.system_tokens)
    sys_msg = [{"role": "system", "content": system}]
    n_sys = len(llm.render_chat(sys_msg, False)[1])
    kv = llm.engine_core.scheduler.kv
    cold, warm, preload_s = [], [], []
    ttft(llm, sys_msg + [{"role": "user", "content": "warm-up"}])  # kernels, allocator
    for r in range(args.rounds):
        chat = sys_msg + [{"role": "user", "content": f"Question {r}: can I get a refund?"}]
        assert kv.reset_prefix_cache()
        cold.append(ttft(llm, chat))
        assert kv.reset_prefix_cache()
        t0 = time.perf_counter()
        st = llm.preload([sys_msg])
        preload_s.append(time.perf_counter() - t0)
        warm.append(ttft(llm, chat))
    load = os.getloadavg()[0]
    mc, mw = statistics.median(cold), statistics.median(warm)
    print(f"SmolLM2-135M, system prompt {n_sys} tokens ({st.num_cached_blocks} blocks "
          f"cached by the preload), {args.threads} threads, load avg {load:.2f}")
    print(f"TTFT cold      median {mc * 1e3:8.1f} ms  ({', '.join(f'{x * 1e3:.0f}' for x in cold)})")
    print(f"TTFT preloaded median {mw * 1e3:8.1f} ms  ({', '.join(f'{x * 1e3:.0f}' for x in warm)})")
    print(f"preload itself median {statistics.median(preload_s) * 1e3:8.1f} ms")
    print(f"cold / preloaded: {mc / mw:.1f}x")


if __name__ == "__main__":
    main()
