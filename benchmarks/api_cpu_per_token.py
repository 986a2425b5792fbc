"""CPU seconds the API process of `llmtower serve` spends per 1,000 streamed output tokens
at saturation (all requests at once), and the engine's beside it: psutil's cpu_times of each
process around one `llmtower bench serve` run (random 128-token prompts, 64 tokens out, EOS
ignored), after a warm-up run on other prompts.

    nice .venv/bin/python benchmarks/api_cpu_per_token.py [--serve-args "--stream-interval 4"]
    ... --profile /tmp/api.prof     # the API process under cProfile (slower; for where, not how much)
    ... --before-src /work/wt/before/src --pairs 4   # interleaved before/after pairs

With --before-src, each pair runs the server from those sources (another commit's checkout)
and from this tree's, taking turns which goes first (ABBA), and prints each run, the means
and their ratio. The client (`llmtower bench serve`) is this tree's in every run.
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from served_runs import ROOT, Server, bench, load

from llmtower.models.default_model import DEFAULT_MODEL_NAME


def measure(serve_args: list[str], num_prompts: int, profile: str | None,
            src: str | None = None) -> dict:
    server = Server(["--model", DEFAULT_MODEL_NAME, *serve_args], profile, src=src)
    try:
        bench(server.port, DEFAULT_MODEL_NAME, DEFAULT_MODEL_NAME, "inf", seed=1,
              num_prompts=16)  # warm-up
        api0, eng0 = server.api_cpu_times(), server.engine_cpu_seconds()
        r = bench(server.port, DEFAULT_MODEL_NAME, DEFAULT_MODEL_NAME, "inf", seed=0,
                  num_prompts=num_prompts)
        api1, eng = server.api_cpu_times(), server.engine_cpu_seconds() - eng0
    finally:
        server.stop()
    tokens = r["total_output_tokens"]
    user, system = api1[0] - api0[0], api1[1] - api0[1]
    api = user + system
    return {"tokens": tokens, "api_s": api, "engine_s": eng, "tok_s": r["output_throughput"],
            "api_per_k": 1000 * api / tokens, "user_per_k": 1000 * user / tokens,
            "system_per_k": 1000 * system / tokens, "engine_per_k": 1000 * eng / tokens}


def describe(m: dict) -> str:
    return (f"{m['tokens']} output tokens, {m['tok_s']:.0f} tok/s; API process "
            f"{m['api_s']:.2f} CPU-s = {m['api_per_k']:.3f} CPU-s per 1,000 output tokens "
            f"(user {m['user_per_k']:.3f}, system {m['system_per_k']:.3f}); engine "
            f"{m['engine_per_k']:.3f} CPU-s per 1,000")


def pairs(args: argparse.Namespace, serve_args: list[str]) -> None:
    runs: dict[str, list[float]] = {"before": [], "after": []}
    for i in range(args.pairs):
        order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
        for which in order:
            src = args.before_src if which == "before" else str(ROOT / "src")
            start = load()
            m = measure(serve_args, args.num_prompts, None, src)
            runs[which].append(m["api_per_k"])
            print(f"pair {i + 1} {which:6s}: {describe(m)} (load {start} -> {load()})",
                  flush=True)
    b, a = statistics.mean(runs["before"]), statistics.mean(runs["after"])
    print(f"means: before {b:.3f}, after {a:.3f} CPU-s per 1,000 tokens: after/before "
          f"{a / b:.2f}x (medians {statistics.median(runs['before']):.3f} / "
          f"{statistics.median(runs['after']):.3f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve-args", default="", help="extra `llmtower serve` flags")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--profile", default=None, help="write the API process's cProfile here")
    ap.add_argument("--before-src", default=None,
                    help="another checkout's src/ to pair this tree's server against")
    ap.add_argument("--pairs", type=int, default=3, help="before/after pairs (--before-src)")
    args = ap.parse_args()
    serve_args = shlex.split(args.serve_args)
    if args.before_src:
        pairs(args, serve_args)
        return
    before = load()
    m = measure(serve_args, args.num_prompts, args.profile)
    print(f"serve {args.serve_args or '(defaults)'}: {describe(m)} (load {before} -> {load()})")


if __name__ == "__main__":
    main()
