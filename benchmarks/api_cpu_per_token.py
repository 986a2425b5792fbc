"""CPU seconds the API process of `llmtower serve` spends per 1,000 streamed output tokens
at saturation (all requests at once), and the engine's beside it: psutil's cpu_times of each
process around one `llmtower bench serve` run (random 128-token prompts, 64 tokens out, EOS
ignored), after a warm-up run on other prompts.

    nice .venv/bin/python benchmarks/api_cpu_per_token.py [--serve-args "--stream-interval 4"]
    ... --profile /tmp/api.prof     # the API process under cProfile (slower; for where, not how much)
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from served_runs import Server, bench, load

from llmtower.models.default_model import DEFAULT_MODEL_NAME


def measure(serve_args: list[str], num_prompts: int, profile: str | None) -> dict:
    server = Server(["--model", DEFAULT_MODEL_NAME, *serve_args], profile)
    try:
        bench(server.port, DEFAULT_MODEL_NAME, DEFAULT_MODEL_NAME, "inf", seed=1,
              num_prompts=16)  # warm-up
        api0, eng0 = server.api_cpu_seconds(), server.engine_cpu_seconds()
        r = bench(server.port, DEFAULT_MODEL_NAME, DEFAULT_MODEL_NAME, "inf", seed=0,
                  num_prompts=num_prompts)
        api, eng = server.api_cpu_seconds() - api0, server.engine_cpu_seconds() - eng0
    finally:
        server.stop()
    tokens = r["total_output_tokens"]
    return {"tokens": tokens, "api_s": api, "engine_s": eng, "tok_s": r["output_throughput"],
            "api_per_k": 1000 * api / tokens, "engine_per_k": 1000 * eng / tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve-args", default="", help="extra `llmtower serve` flags")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--profile", default=None, help="write the API process's cProfile here")
    args = ap.parse_args()
    before = load()
    m = measure(shlex.split(args.serve_args), args.num_prompts, args.profile)
    print(f"serve {args.serve_args or '(defaults)'}: {m['tokens']} output tokens, "
          f"{m['tok_s']:.0f} tok/s; API process {m['api_s']:.2f} CPU-s = "
          f"{m['api_per_k']:.3f} CPU-s per 1,000 output tokens; engine {m['engine_per_k']:.3f} "
          f"CPU-s per 1,000 (load {before} -> {load()})")


if __name__ == "__main__":
    main()
