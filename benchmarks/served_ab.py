"""Two source trees served side by side: `llmtower serve` from each tree in turn (the client
this tree's), cold runs (at an infinite rate unless --rate says otherwise) after a warm-up on
other prompts; output tok/s, TTFT (median, p99) and median TPOT per run. E.g. the thread governor before and after (a worktree whose
src/llmtower/executor/cpu_threads.py is the old one):

    git worktree add --detach /tmp/old HEAD
    git -C /tmp/old checkout 23ba7ee -- src/llmtower/executor/cpu_threads.py
    .venv/bin/python benchmarks/served_ab.py --a-src /tmp/old/src --rounds 2
    .venv/bin/python benchmarks/served_ab.py --a-src /tmp/old/src --model $A/models/llama-1b \\
        --num-prompts 16 --output-len 32
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from served_runs import ROOT, Server, bench, load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a-src", required=True, help="the other tree's src/ (run first)")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rate", default="inf", help="request rate of the measured run (req/s)")
    ap.add_argument("--serve-args", default="", help="more `llmtower serve` flags, both trees")
    args = ap.parse_args()
    trees = {"a": args.a_src, "this tree": str(ROOT / "src")}
    for r in range(args.rounds):
        for name, src in trees.items():
            s = Server(["--model", args.model, *shlex.split(args.serve_args)], src=src)
            try:
                served = httpx.get(f"http://127.0.0.1:{s.port}/v1/models").json()["data"][0]["id"]
                shape = {"input_len": args.input_len, "output_len": args.output_len}
                bench(s.port, served, args.model, "inf", seed=1,
                      num_prompts=max(4, args.num_prompts // 4), **shape)
                c = bench(s.port, served, args.model, args.rate, seed=0,
                          num_prompts=args.num_prompts, **shape)
                print(f"round {r} {name}: cold {c['output_throughput']:.1f} tok/s, TTFT median "
                      f"{c['ttft_ms']['median']:,.0f} / p99 {c['ttft_ms']['p99']:,.0f} ms, "
                      f"median TPOT {c['tpot_ms']['median']:.1f} ms (rate {args.rate}, load "
                      f"{load()})", flush=True)
            finally:
                s.stop()


if __name__ == "__main__":
    main()
