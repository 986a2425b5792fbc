"""One stream on the default model in bfloat16 with the fused decode layer
(``kernels/decode_layer_bf16.c``) off, per layer, and whole (layers 1..L-2 in one C call,
attention included), in one process and one engine: the settings take turns, so a noisy
neighbour hits all alike.

The workload is the anchors harness's one-stream recipe (``LLM.generate`` of one 144-token
prompt of random ids, 128 output tokens, greedy, min_tokens = max_tokens, EOS ignored), timed
end to end per run. Prints output tok/s per setting and run, and whether the three produced
the same tokens (they must: the fused paths compute bit for bit what the separate kernels do).

    chrt -f 1 .venv/bin/python benchmarks/decode_layer_bf16.py --rounds 4
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from llmtower import LLM, SamplingParams
from llmtower.kernels import decode_layer as DL
from llmtower.models.default_model import default_model_dir

# setting -> (DL.MAX_ROWS, DL.WHOLE_LAYERS)
SETTINGS = {"off": (0, False), "per layer": (DL.MAX_ROWS, False), "whole": (DL.MAX_ROWS, True)}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a Hugging Face folder; default: SmolLM2")
    p.add_argument("--input-len", type=int, default=144)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    model = args.model or str(default_model_dir())
    llm = LLM(model=model, dtype="bfloat16", num_threads=args.threads, max_model_len=2048,
              kv_cache_memory="1GiB", seed=0, enable_prefix_caching=False)
    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    rng = np.random.RandomState(0)  # the anchors harness's prompt for seed 0
    rng.randint(args.input_len, args.input_len + 1, size=1)
    prompt = rng.randint(4, vocab, size=args.input_len).tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len,
                        min_tokens=args.output_len, ignore_eos=True, seed=0)
    llm.generate([prompt[:16]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    rates: dict[str, list[float]] = {k: [] for k in SETTINGS}
    tokens: dict[str, list[int]] = {}
    load0 = os.getloadavg()[0]
    for _ in range(args.rounds):
        for name, (rows, whole) in SETTINGS.items():
            DL.MAX_ROWS, DL.WHOLE_LAYERS = rows, whole
            t = time.perf_counter()
            out = llm.generate([prompt], sp, use_tqdm=False)
            rates[name].append(args.output_len / (time.perf_counter() - t))
            tokens[name] = list(out[0].outputs[0].token_ids)
    print(f"bfloat16, one stream, {args.input_len} in / {args.output_len} out end to end, "
          f"{args.threads} threads, {args.rounds} rounds; load average {load0:.1f} -> "
          f"{os.getloadavg()[0]:.1f}")
    base = statistics.median(rates["off"])
    for name, r in rates.items():
        med = statistics.median(r)
        print(f"{name:>10}: {med:6.1f} output tok/s ({med / base:.2f}x)  runs: "
              + ", ".join(f"{x:.1f}" for x in r))
    same = len({tuple(t) for t in tokens.values()}) == 1
    print(f"greedy tokens the same in all settings: {same}")


if __name__ == "__main__":
    main()
