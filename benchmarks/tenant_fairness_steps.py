"""The two-tenant overload of `tenant_fairness.py`, in scheduler steps: the real Scheduler with
the fake model (no HTTP, no model, no machine noise), time counted in steps. It separates what
the scheduling policy does to the light tenant's TTFT from what a busy machine does to it.

    python benchmarks/tenant_fairness_steps.py [--steps 150000] [--seeds 3] [--max-num-seqs 2]

Shape: prompts of 24 tokens, 128 output tokens, --max-num-seqs slots; the capacity is
max_num_seqs / 129 requests a step (a request holds a slot for its prefill step and 128
decode steps). The light tenant alone sends 2C/11 requests a step (Poisson); under overload
the heavy tenant adds 20C/11 (2x the capacity together). Prints, per seed, the light tenant's
p99 TTFT in steps (first token's step - arrival step + 1) alone, under `fcfs` and under `fair`,
and the number of light requests behind each p99. The last column is `fair` as the real-server
benchmark runs it: on the same engine right after the light tenant's alone phase, so that the
flood *returns* to a scheduler where the light tenant has been served a lot (the returning
tenant's credit decides how long the light tenant then waits).
"""
from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from llmtower.core.request import Request  # noqa: E402
from llmtower.core.sampling_params import SamplingParams  # noqa: E402
from tests.core.sched_helpers import make_engine  # noqa: E402

PROMPT_LEN = 24
OUTPUT_LEN = 128


def p99(xs: list[int]) -> int:
    xs = sorted(xs)
    return xs[max(0, math.ceil(0.99 * len(xs)) - 1)]


def run(policy: str, rates: dict[str, float], steps: int, seed: int,
        max_num_seqs: int, after_alone: bool = False) -> dict[str, list[int]]:
    """TTFT in steps of every request that got its first token, per tenant. ``after_alone``:
    the light tenant runs alone for ``steps`` first (not counted), then ``rates``."""
    e = make_engine(policy=policy, num_blocks=1024, block_size=16, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=2048, max_model_len=512,
                    enable_prefix_caching=False)
    s = e.scheduler
    # One random stream per tenant: the light tenant's arrivals and prompts are the same
    # alone and under overload.
    rngs = {t: random.Random(f"{seed}-{t}") for t in rates}
    arrival: dict[str, tuple[str, int]] = {}
    ttft: dict[str, list[int]] = {t: [] for t in rates}
    start = steps if after_alone else 0
    nxt = {t: (0 if t == "light" else start) + rngs[t].expovariate(r) for t, r in rates.items()}
    n = 0
    for k in range(start + steps):
        for t, r in rates.items():
            while nxt[t] <= k:
                rng = rngs[t]
                req = Request(f"{t}{n}", [rng.randrange(1, 60) for _ in range(PROMPT_LEN)],
                              SamplingParams(max_tokens=OUTPUT_LEN, ignore_eos=True),
                              eos_token_id=0, arrival_time=float(k), tenant=t)
                n += 1
                s.add_request(req)
                arrival[req.request_id] = (t, k)
                nxt[t] += rng.expovariate(r)
        if not e.has_unfinished_requests():
            continue
        for o in e.step().outputs:
            if o.new_token_ids and o.request_id in arrival:
                t, k0 = arrival.pop(o.request_id)
                if k0 >= start:
                    ttft[t].append(k - k0 + 1)
    return ttft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150_000)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--max-num-seqs", type=int, default=2)
    args = ap.parse_args()
    cap = args.max_num_seqs / (OUTPUT_LEN + 1)
    light, heavy = 2 * cap / 11, 20 * cap / 11
    print(f"light p99 TTFT in steps ({args.steps} steps, light {light:.5f} + heavy "
          f"{heavy:.5f} requests/step, capacity {cap:.5f})")
    print(f"{'seed':>4} {'alone':>12} {'fcfs':>12} {'fair':>12}  fair/alone "
          f"{'fair after alone':>16}  /alone")
    for seed in range(args.seeds):
        cells = []
        both = {"heavy": heavy, "light": light}
        for policy, rates, after in (("fcfs", {"light": light}, False), ("fcfs", both, False),
                                     ("fair", both, False), ("fair", both, True)):
            xs = run(policy, rates, args.steps, seed, args.max_num_seqs, after)["light"]
            cells.append((p99(xs), len(xs)))
        print(f"{seed:>4} " + " ".join(f"{v:>6} (n={c:3d})" for v, c in cells[:3])
              + f"  {cells[2][0] / cells[0][0]:.2f}x {cells[3][0]:>7} (n={cells[3][1]:3d})"
              + f"  {cells[3][0] / cells[0][0]:.2f}x")


if __name__ == "__main__":
    main()
